"""The web process: kvrun's OpenAI-compatible gateway on /v1/*, Django for everything else.

The gateway is a lean ASGI app of its own (gateway.app), because Django's request stack costs
more per request than the gateway's whole budget.
"""

import os

from django.core.asgi import get_asgi_application

from kvrun.common.middleware import limit_body

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvrun.settings")

django_application = limit_body(get_asgi_application())

from gateway.app import Gateway  # noqa: E402  (needs the apps loaded above)

gateway = Gateway()


async def application(scope: dict, receive: object, send: object) -> None:
    if scope["type"] == "http" and scope["path"].startswith("/v1/"):
        await gateway(scope, receive, send)
    elif scope["type"] == "lifespan":
        await gateway.lifespan(receive, send)
    else:
        await django_application(scope, receive, send)

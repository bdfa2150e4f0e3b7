"""GET /metrics: kvrun's own Prometheus exposition, for a scraper holding
KVRUN_METRICS_TOKEN (a bearer token); absent when no token is set."""

import hmac

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST

from telemetry.exposition import exposition


def metrics(request: HttpRequest) -> HttpResponse:
    token = settings.KVRUN_METRICS_TOKEN
    if not token:
        raise Http404("Set KVRUN_METRICS_TOKEN to expose kvrun's metrics.")
    sent = request.headers.get("Authorization", "").removeprefix("Bearer ")
    if not hmac.compare_digest(sent.encode(), token.encode()):
        return HttpResponse("Send the metrics token: "
                            "Authorization: Bearer <KVRUN_METRICS_TOKEN>.\n",
                            status=401, content_type="text/plain")
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)

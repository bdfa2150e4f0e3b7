"""Who sent a request: the one client address that every throttle and lockout keys on."""

from django.conf import settings
from django.http import HttpRequest


def client_address(request: HttpRequest) -> str:
    """The address of the client that sent `request`.

    Each of the KVRUN_TRUSTED_PROXIES proxies in front appends the address it received the
    request from to X-Forwarded-For, so the client is the Nth address from the right; what
    lies further left was written by the client and proves nothing. With no trusted proxy,
    or fewer addresses than proxies (a request that did not come through them), it is
    REMOTE_ADDR: throttles keyed on a header the client chooses would be no throttles.
    """
    proxies = settings.KVRUN_TRUSTED_PROXIES
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
                 if part.strip()]
    if proxies and len(forwarded) >= proxies:
        return forwarded[-proxies]
    return request.META.get("REMOTE_ADDR", "")

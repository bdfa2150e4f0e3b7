"""Who sent a request: the one client address that every throttle and lockout keys on."""

from django.conf import settings
from django.http import HttpRequest


def client_address(request: HttpRequest) -> str:
    """The address of the client that sent `request` (see client_address_from)."""
    return client_address_from(remote_addr=request.META.get("REMOTE_ADDR", ""),
                               forwarded_for=request.META.get("HTTP_X_FORWARDED_FOR", ""))


def client_address_from(*, remote_addr: str, forwarded_for: str) -> str:
    """The client's address, from the connection's and the X-Forwarded-For header.

    Each of the KVRUN_TRUSTED_PROXIES proxies in front appends the address it received the
    request from to X-Forwarded-For, so the client is the Nth address from the right; what
    lies further left was written by the client and proves nothing. With no trusted proxy,
    or fewer addresses than proxies (a request that did not come through them), it is
    the connection's: throttles keyed on a header the client chooses would be no throttles.
    """
    proxies = settings.KVRUN_TRUSTED_PROXIES
    forwarded = [part.strip() for part in forwarded_for.split(",") if part.strip()]
    if proxies and len(forwarded) >= proxies:
        return forwarded[-proxies]
    return remote_addr

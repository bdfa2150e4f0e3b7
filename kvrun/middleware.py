from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse


class BodySizeLimitMiddleware:
    """Refuse a declared body above DATA_UPLOAD_MAX_MEMORY_SIZE with 413 before it is read.

    Django would otherwise answer 400 (RequestDataTooBig) only once a view reads the body.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if limit is not None and length > limit:
            return body_too_large_response(limit)
        return self.get_response(request)


def body_too_large_message(limit: int) -> str:
    """What every part of kvrun (REST API, dashboard, gateway) says of a body over the limit."""
    return f"The request body is larger than the limit of {limit} bytes; send a smaller body."


def body_too_large_error(limit: int) -> dict[str, object]:
    return {"type": "request_too_large", "message": body_too_large_message(limit), "fields": {}}


def body_too_large_response(limit: int) -> JsonResponse:
    return JsonResponse({"error": body_too_large_error(limit)}, status=413)

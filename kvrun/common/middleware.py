import json
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class BodySizeLimitMiddleware:
    """Refuse a declared body above DATA_UPLOAD_MAX_MEMORY_SIZE with 413 before a view reads it.

    Django would otherwise answer 400 (RequestDataTooBig) only once a view reads the body.
    Under ASGI, limit_body (below) has refused such a body before Django read any of it.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = body_limit(request.path)
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if limit is not None and length > limit:
            return body_too_large_response(limit)
        return self.get_response(request)


class ApiNotFoundMiddleware:
    """A path under /api/ that no route matches answers the API's JSON 404, never an HTML
    page: Django's handler404 (kvrun.common.api.not_found) is not used while DEBUG is on,
    and its debug page would otherwise reach API clients of `make run`. Outside
    CommonMiddleware, so that a path missing its trailing slash is still redirected."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        # Only where no route matched: a route's own 404 (an object not found, in the
        # browsable API's HTML too) says what it means.
        if (response.status_code == 404 and request.path.startswith("/api/")
                and getattr(request, "resolver_match", None) is None):
            return no_such_api_path()
        return response


def no_such_api_path() -> JsonResponse:
    """The API's 404 for a path no route matches, in its error envelope."""
    return JsonResponse({"error": {"type": "not_found", "fields": {},
                                   "message": "No such API path; /api/docs/ lists them."}},
                        status=404)


def limit_body(app: ASGIApp) -> ASGIApp:
    """`app` (Django's ASGI handler) behind the body limit: 413 as soon as a body is known to be
    over DATA_UPLOAD_MAX_MEMORY_SIZE, from its declared length or, for a chunked upload, from
    the bytes received so far.

    Django's handler reads the whole body into a temporary file (on disk past
    FILE_UPLOAD_MAX_MEMORY_SIZE) before any middleware runs, so a check in middleware comes
    after an upload of any size has been stored.
    """
    async def limited(scope: dict[str, Any], receive: Any, send: Any) -> None:
        limit = body_limit(scope["path"]) if scope["type"] == "http" else None
        if limit is None:
            await app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _send_too_large(send, limit)
            return
        received = 0

        async def counted() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received <= limit:
                return message
            await _send_too_large(send, limit)
            # Django stops reading at a disconnect and answers nothing more.
            return {"type": "http.disconnect"}

        await app(scope, counted, send)
    return limited


# The routes that take a LoRA adapter's files (the REST API's and the dashboard's); what a
# multipart body adds around the files is far below this margin.
UPLOAD_PATH_SUFFIX = "/adapters/upload/"
MULTIPART_MARGIN_BYTES = 64 * 1024


def body_limit(path: str) -> int | None:
    """The largest body `path` takes: an adapter's upload limit on the routes that take one,
    DATA_UPLOAD_MAX_MEMORY_SIZE everywhere else."""
    if path.endswith(UPLOAD_PATH_SUFFIX):
        return settings.KVRUN_ADAPTER_UPLOAD_MIB * 2**20 + MULTIPART_MARGIN_BYTES
    limit: int | None = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return limit


async def _send_too_large(send: Any, limit: int) -> None:
    body = json.dumps({"error": body_too_large_error(limit)}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def body_too_large_message(limit: int) -> str:
    """What every part of kvrun (REST API, dashboard, gateway) says of a body over the limit."""
    return f"The request body is larger than the limit of {limit} bytes; send a smaller body."


def body_too_large_error(limit: int) -> dict[str, object]:
    return {"type": "request_too_large", "message": body_too_large_message(limit), "fields": {}}


def body_too_large_response(limit: int) -> JsonResponse:
    return JsonResponse({"error": body_too_large_error(limit)}, status=413)

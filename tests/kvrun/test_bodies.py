"""Request bodies on Django's paths, as uvicorn hands them over: the size limit holds for a
chunked upload too, and no body breaks the JSON parser."""

import asyncio
import json

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from accounts.models import User
from kvrun.asgi import django_application

pytestmark = pytest.mark.django_db(transaction=True)

PIECE = 64 * 1024


def call(path: str, pieces: int, headers: list[tuple[bytes, bytes]]) -> tuple[dict, int]:
    """Send `pieces` body pieces of 64 KiB to `path` through the ASGI app; the response's
    start message (with its body) and how many pieces the app read."""
    read = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal read
        if read == pieces:  # all sent; the client waits for its answer
            await asyncio.Event().wait()
        read += 1
        return {"type": "http.request", "body": b"x" * PIECE, "more_body": read < pieces}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "server": ("testserver", 80),
             "client": ("127.0.0.1", 40000),
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                         *headers]}

    async def run() -> None:
        await asyncio.wait_for(django_application(scope, receive, send), 30)

    asyncio.run(run())
    start = {**sent[0], "body": b"".join(message.get("body", b"") for message in sent[1:])}
    return start, read


def test_a_chunked_upload_is_refused_as_soon_as_it_passes_the_limit() -> None:
    pieces = 4 * settings.DATA_UPLOAD_MAX_MEMORY_SIZE // PIECE

    response, read = call("/api/v1/signup/", pieces, [(b"transfer-encoding", b"chunked")])

    assert response["status"] == 413
    message = json.loads(response["body"])["error"]["message"]
    assert f"limit of {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes" in message
    # Not a byte past the piece that went over the limit was read, let alone stored.
    assert read == settings.DATA_UPLOAD_MAX_MEMORY_SIZE // PIECE + 1
    assert not User.objects.exists()


def test_a_declared_length_over_the_limit_is_refused_before_any_of_the_body_is_read() -> None:
    size = 4 * settings.DATA_UPLOAD_MAX_MEMORY_SIZE

    response, read = call("/api/v1/signup/", size // PIECE,
                          [(b"content-length", str(size).encode())])

    assert response["status"] == 413
    assert read == 0


def test_a_body_within_the_limit_still_reaches_the_view() -> None:
    response, read = call("/api/v1/signup/", 2, [(b"transfer-encoding", b"chunked")])

    # Read whole, and answered by the view (DRF reads no body without a declared length).
    assert read == 2
    assert response["status"] == 400
    assert "email" in json.loads(response["body"])["error"]["fields"]


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deeply_nested_json_is_a_400_that_says_so(api: APIClient, depth: int) -> None:
    body = '{"email": ' + "[" * depth + "]" * depth + ', "password": "analytical engine 1843"}'

    response = api.generic("POST", "/api/v1/signup/", body, content_type="application/json")

    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["type"] == "malformed_request"
    assert "nested" in error["message"]
    assert not User.objects.exists()
    # The process is well: the next request is served.
    response = api.post("/api/v1/signup/", {"email": "ada@example.com",
                                            "password": "analytical engine 1843"}, format="json")
    assert response.status_code == 201


def test_an_adapter_upload_may_pass_the_limit_up_to_its_own(settings: object) -> None:
    settings.KVRUN_ADAPTER_UPLOAD_MIB = 2  # type: ignore[attr-defined]
    path = "/api/v1/organizations/acme/endpoints/chat/adapters/upload/"
    pieces = 2 * settings.DATA_UPLOAD_MAX_MEMORY_SIZE // PIECE  # type: ignore[attr-defined]

    taken, read = call(path, pieces, [(b"transfer-encoding", b"chunked")])
    refused, _ = call(path, 1, [(b"content-length", str(3 * 2**20).encode())])

    assert taken["status"] != 413 and read == pieces  # read whole, then judged by the view
    assert refused["status"] == 413
    assert f"limit of {2 * 2**20 + 64 * 1024} bytes" in json.loads(refused["body"])["error"][
        "message"]

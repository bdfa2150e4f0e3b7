"""The engine's key on every path but /health, as vLLM loads the middleware."""

import asyncio

import httpx
import pytest

from engine.key_guard import RequireEngineKey


async def served(scope: dict, receive: object, send: object) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"engine answer"})


@pytest.mark.parametrize(("path", "authorization", "status"), [
    ("/health", None, 200), ("/invocations", None, 401), ("/tokenize", "Bearer wrong", 401),
    ("/metrics", "Bearer engine-secret", 200), ("/v1/completions", None, 401),
])
def test_it_lets_through_only_the_key_and_health(monkeypatch: pytest.MonkeyPatch, path: str,
                                                 authorization: str | None, status: int) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "engine-secret")
    app = RequireEngineKey(served)
    headers = {"Authorization": authorization} if authorization else {}

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://engine") as client:
            return await client.post(path, headers=headers)
    response = asyncio.run(call())

    assert response.status_code == status
    assert (response.text == "engine answer") == (status == 200)

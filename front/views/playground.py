"""The playground: chat with an endpoint through the gateway, answers streaming in; or, for
an embedding model, compare two texts' embeddings, and for a reranker, rank documents.

The browser never holds a key. The page posts to `chat`, which calls the gateway with a
short-lived inference key of the signed-in person, restricted to this endpoint, whose secret
is derived from the key's id under the pepper for each message (kvrun.common.digests): nothing
stores it. What the playground spends is recorded against that key, never another's.
"""

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from accounts.selectors import playground_key_of
from accounts.services import do_issue_playground_key
from endpoints.models import Adapter, Endpoint, Task
from endpoints.selectors import adapters_of
from front.scoping import Member, endpoint_of, membership
from kvrun.common.digests import playground_secret

KEY_LIFETIME = timedelta(hours=1)
# A key with less life than this left is replaced before a message, not during one.
KEY_RENEW_BEFORE = timedelta(minutes=5)
ROLES = {"system", "user", "assistant"}
MAX_MESSAGES = 100
# The most tokens one playground answer may ask for: a console to try a model, not a batch job.
MAX_TOKENS = 4096
MAX_DOCUMENTS = 50  # a reranking to look at, not a batch
MAX_TEXT_CHARACTERS = 20_000


@login_required
def playground(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    member = membership(request, org_slug)
    endpoint = endpoint_of(member, name)
    if not member.manages:
        messages.error(request, "Only owners and admins can use the playground: it spends, "
                                "and can wake an endpoint at zero; ask one of them.")
        return redirect("endpoint", org_slug=org_slug, name=name)
    return render(request, "front/playground.html", {
        "member": member, "organization": member.organization, "endpoint": endpoint,
        "adapters": adapters_of(endpoint=endpoint), "section": "endpoints"})


@login_required
@require_POST
async def chat(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    """Relay one chat completion as server-sent events, exactly as the gateway sends them;
    the gateway's own errors pass through with their status, and a gateway that cannot be
    reached is a 502."""
    allowed = await _manager_s_endpoint(request, org_slug, name)
    if isinstance(allowed, HttpResponse):
        return allowed
    member, endpoint = allowed
    try:
        payload = _payload(request.body)
    except ValueError as exc:
        return _error(400, str(exc))
    adapter = payload.pop("adapter")
    if adapter and not await Adapter.objects.filter(endpoint=endpoint, name=adapter).aexists():
        return _error(400, f"Endpoint {endpoint.name} has no adapter {adapter!r}; pick one "
                           "from the list.")
    payload["model"] = f"{endpoint.name}:{adapter}" if adapter else endpoint.name
    if payload["max_tokens"] >= endpoint.context_length:
        return _error(400, f"Max tokens must leave room for the prompt in this endpoint's "
                           f"{endpoint.context_length:,}-token context; ask for fewer.")
    client = _gateway_client()
    try:
        upstream = await _through_gateway(client, "/v1/chat/completions", payload,
                                          request=request, member=member, endpoint=endpoint)
        if upstream.status_code != 200:
            body = await upstream.aread()
            await upstream.aclose()
            await client.aclose()
            return HttpResponse(body, status=upstream.status_code,
                                content_type="application/json")
    except httpx.HTTPError as exc:
        await client.aclose()
        return _unanswered(exc)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            await client.aclose()

    response = StreamingHttpResponse(relay(), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


@login_required
@require_POST
async def pooled(request: HttpRequest, org_slug: str, name: str) -> HttpResponse:
    """Embed two texts (an embedding model's endpoint) or rank documents for a query (a
    reranker's) through the gateway, and answer with the gateway's JSON as it came; the
    page compares and orders."""
    allowed = await _manager_s_endpoint(request, org_slug, name)
    if isinstance(allowed, HttpResponse):
        return allowed
    member, endpoint = allowed
    if endpoint.model.task == Task.GENERATE:
        return _error(400, f"{endpoint.name} serves chat: use the chat above.")
    try:
        path, payload = _pooled_payload(request.body, task=endpoint.model.task)
    except ValueError as exc:
        return _error(400, str(exc))
    payload["model"] = endpoint.name
    async with _gateway_client() as client:
        try:
            answer = await _through_gateway(client, path, payload, request=request,
                                            member=member, endpoint=endpoint)
            await answer.aread()
        except httpx.HTTPError as exc:
            return _unanswered(exc)
    return HttpResponse(answer.content, status=answer.status_code,
                        content_type="application/json")


def _pooled_payload(body: bytes, *, task: str) -> tuple[str, dict[str, Any]]:
    """The gateway path and request for what the page sends: two texts to embed, or a query
    and its documents to rank; ValueError says what is wrong."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise ValueError("Send a JSON object.")
    if task == Task.EMBED:
        texts = data.get("texts")
        if not (isinstance(texts, list) and len(texts) == 2 and all(
                isinstance(text, str) and 0 < len(text.strip()) <= MAX_TEXT_CHARACTERS
                for text in texts)):
            raise ValueError(f"Write both texts to compare (each up to {MAX_TEXT_CHARACTERS:,} "
                             "characters).")
        return "/v1/embeddings", {"input": texts, "encoding_format": "float"}
    query, documents = data.get("query"), data.get("documents")
    if not isinstance(query, str) or not 0 < len(query.strip()) <= MAX_TEXT_CHARACTERS:
        raise ValueError(f"Write a query (up to {MAX_TEXT_CHARACTERS:,} characters).")
    if not (isinstance(documents, list) and 0 < len(documents) <= MAX_DOCUMENTS and all(
            isinstance(text, str) and 0 < len(text.strip()) <= MAX_TEXT_CHARACTERS
            for text in documents)):
        raise ValueError(f"Write 1 to {MAX_DOCUMENTS} documents, one a line.")
    return "/v1/rerank", {"query": query, "documents": documents}


def _gateway_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(
        10.0, read=settings.KVRUN_GATEWAY_UPSTREAM_TIMEOUT_SECONDS))


def _unanswered(exc: httpx.HTTPError) -> JsonResponse:
    return _error(502, f"The gateway did not answer ({exc.__class__.__name__}); try again, "
                       "and if it persists ask an operator to check the web process.")


async def _through_gateway(client: httpx.AsyncClient, path: str, payload: dict[str, Any], *,
                           request: HttpRequest, member: Member, endpoint: Endpoint
                           ) -> httpx.Response:
    """The gateway's answer to `payload` at `path`, its body still to be read, sent with the
    person's playground key; a key revoked meanwhile is replaced once."""
    async def send(renew: bool) -> httpx.Response:
        secret = await sync_to_async(_secret_for)(request, member, endpoint, renew)
        return await client.send(client.build_request(
            "POST", f"{settings.KVRUN_GATEWAY_URL}{path}", json=payload,
            headers={"Authorization": f"Bearer {secret}"}), stream=True)

    answer = await send(False)
    if answer.status_code == 401:
        await answer.aclose()
        answer = await send(True)
    return answer


async def _manager_s_endpoint(request: HttpRequest, org_slug: str, name: str
                              ) -> tuple[Member, Endpoint] | HttpResponse:
    """The member and the endpoint the playground acts on, or the refusal to answer: an
    endpoint the organisation does not have, a person who may not spend."""
    try:
        member, endpoint = await sync_to_async(_visible)(request, org_slug, name)
    except Http404:
        return _error(404, "No such endpoint in this organisation.")
    if not member.manages:
        return _error(403, "Only owners and admins can use the playground; ask one of them.")
    return member, endpoint


def _visible(request: HttpRequest, org_slug: str, name: str) -> tuple[Member, Endpoint]:
    member = membership(request, org_slug)
    return member, endpoint_of(member, name)


def _secret_for(request: HttpRequest, member: Member, endpoint: Endpoint,
                renew: bool) -> str:
    """The secret of the person's playground key for the endpoint, minted when none has
    enough life left (or when `renew`)."""
    key = None if renew else playground_key_of(
        user=request.user, organization=member.organization, endpoint_name=endpoint.name,
        usable_for=KEY_RENEW_BEFORE)
    if key is None:
        key = do_issue_playground_key(organization=member.organization, user=request.user,
                                      actor_role=member.role, endpoint_name=endpoint.name,
                                      lifetime=KEY_LIFETIME)
    return playground_secret(key.id)


def _payload(body: bytes) -> dict[str, Any]:
    """The chat request the page sends, checked; ValueError says what is wrong."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ValueError("Send a JSON object with 'messages'.") from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if (not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES
            or not all(isinstance(m, dict) and m.get("role") in ROLES
                       and isinstance(m.get("content"), str) for m in messages)):
        raise ValueError(f"'messages' must be 1 to {MAX_MESSAGES} objects with a role "
                         "(system, user or assistant) and text content.")
    max_tokens = data.get("max_tokens", 256)
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS:
        raise ValueError(f"'max_tokens' must be a whole number from 1 to {MAX_TOKENS}.")
    temperature = data.get("temperature", 0.7)
    if not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
        raise ValueError("'temperature' must be between 0 and 2.")
    adapter = data.get("adapter") or ""
    if not isinstance(adapter, str):
        raise ValueError("'adapter' must be an adapter's name, or empty for the base model.")
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "adapter": adapter}


def _error(status: int, message: str) -> JsonResponse:
    return JsonResponse({"error": {"message": message}}, status=status)

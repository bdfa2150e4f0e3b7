"""A minimal OpenAI-compatible upstream for the gateway benchmark: a raw ASGI app that answers
every completion at once with a fixed body and usage, so that what is measured through it is
the gateway's own cost. `"stream": true` gets four SSE chunks (the last with its finish
reason), the usage chunk when asked for, and [DONE]. /v1/messages gets an Anthropic message,
/v1/embeddings an embedding of 384 dimensions (BGE small's).

    python -m uvicorn bench.minimal_upstream:app --port P --no-access-log
"""

import orjson

USAGE = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
         "prompt_tokens_details": {"cached_tokens": 0}}
COMPLETION = orjson.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "text": " a b c d", "finish_reason": "length", "logprobs": None}],
    "usage": USAGE,
})
MESSAGE = orjson.dumps({
    "id": "msg_bench", "type": "message", "role": "assistant", "model": "bench",
    "content": [{"type": "text", "text": " a b c d"}], "stop_reason": "max_tokens",
    "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 4},
})
EMBEDDING = orjson.dumps({
    "id": "embd-bench", "object": "list", "created": 0, "model": "bench",
    "data": [{"index": 0, "object": "embedding", "embedding": [0.0510] * 384}],
    "usage": {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0},
})
JSON_HEADERS = [(b"content-type", b"application/json"),
                (b"content-length", str(len(COMPLETION)).encode())]
MESSAGE_HEADERS = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(MESSAGE)).encode())]
EMBEDDING_HEADERS = [(b"content-type", b"application/json"),
                     (b"content-length", str(len(EMBEDDING)).encode())]
SSE_HEADERS = [(b"content-type", b"text/event-stream")]


def _chunk(text: str, usage: dict | None, finish_reason: str | None) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "bench",
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}],
        "usage": usage,
    }) + b"\n\n"


async def app(scope: dict, receive: object, send: object) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    request = orjson.loads(body) if body else {}
    if scope["path"] == "/v1/messages":
        await send({"type": "http.response.start", "status": 200, "headers": MESSAGE_HEADERS})
        await send({"type": "http.response.body", "body": MESSAGE})
        return
    if scope["path"] == "/v1/embeddings":
        await send({"type": "http.response.start", "status": 200, "headers": EMBEDDING_HEADERS})
        await send({"type": "http.response.body", "body": EMBEDDING})
        return
    if not request.get("stream"):
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": COMPLETION})
        return
    options = request.get("stream_options") or {}
    running = bool(options.get("continuous_usage_stats"))
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    for done, text in enumerate([" a", " b", " c", " d"], start=1):
        usage = {"prompt_tokens": 7, "completion_tokens": done,
                 "total_tokens": 7 + done} if running else None
        # The last token's event carries the finish reason, as vLLM's does.
        await send({"type": "http.response.body",
                    "body": _chunk(text, usage, "length" if done == 4 else None),
                    "more_body": True})
    tail = b""
    if options.get("include_usage"):
        tail = b"data: " + orjson.dumps({"id": "cmpl-bench", "object": "text_completion",
                                         "created": 0, "model": "bench", "choices": [],
                                         "usage": USAGE}) + b"\n\n"
    await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})

"""A scripted stand-in for a vLLM engine, for tests of the gateway's own logic.

    python -m uvicorn tests.stub_upstream:app --port P

It keeps every completion request it was sent (GET /_requests), with the gateway's request id;
counts a prompt's words as its tokens (POST /tokenize); and behaves by the prompt (or the last
chat message): "context" answers vLLM's context-length 400, "crash" the 500 of an engine core
that failed, "slow" takes its time (a second, or a chunk every 0.2 s), "steady" streams 200
chunks, one every 10 ms (answered at once when not streamed), "lasting" streams 150 chunks, one
every 0.1 s, "drop" dies after two chunks of a stream, "huge" answers 1 MiB of text (in pieces,
with no declared length), "long" streams one event of 640 KiB, past aiohttp's line limit (twice
its read buffer: 512 KiB in aiohttp 3.14), "lie" reports impossible usage (a negative prompt,
10**12 completion tokens, more cached tokens than prompt tokens), "garbled" answers a JSON
list, or streams one such event, "think" answers as a reasoning model with a tool-call
parser does (vLLM's `reasoning` field, then a tool call and no text); anything else is
answered at once with usage. /v1/messages answers in Anthropic's shapes, as vLLM does:
"context" is its 400, "drop" dies after two deltas, "fail" ends on the engine's error event
after two, "lie" reports a negative cache read; anything else four deltas; its count_tokens
counts the last message's words. Streams carry running usage when asked, as vLLM's do.
/v1/embeddings, /v1/score and /v1/rerank answer in vLLM's shapes, a word of their texts a
token (a rerank's query read again for each document); an input "context" is the
context-length 400.
"""

import asyncio

import orjson

RECEIVED: list[dict] = []
ENGINE_ERROR = orjson.dumps({"error": {"message": "EngineCore encountered an issue.",
                                       "type": "InternalServerError", "param": None,
                                       "code": 500}})
HUGE_TEXT_BYTES = 1024 * 1024
LONG_EVENT_TEXT_BYTES = 640 * 1024
CONTEXT_ERROR = orjson.dumps({"error": {
    "message": "This model's maximum context length is 2048 tokens. However, your prompt "
               "contains 3000 input tokens. Please reduce the length of the input prompt.",
    "type": "BadRequestError", "param": "input_tokens", "code": 400}})


LIES = {"prompt_tokens": -5, "completion_tokens": 10**12, "total_tokens": 10**12,
        "prompt_tokens_details": {"cached_tokens": 99}}


def _prompt(request: dict) -> str:
    if "messages" in request:
        return str(request["messages"][-1].get("content", ""))
    prompt = request.get("prompt", "")
    return str(prompt[0] if isinstance(prompt, list) and prompt else prompt)  # a batch's first


def _chunk(index: int, usage: dict | None, text: str = "", *, last: bool = False) -> bytes:
    """One token's event; the last carries its finish reason, as vLLM's does."""
    return b"data: " + orjson.dumps({
        "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
        "choices": [{"index": 0, "text": text or f" t{index}",
                     "finish_reason": "length" if last else None}],
        "usage": usage}) + b"\n\n"


async def _respond(send: object, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def app(scope: dict, receive: object, send: object) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/_requests":
        if scope["method"] == "DELETE":
            RECEIVED.clear()
        await _respond(send, 200, orjson.dumps(RECEIVED))
        return
    request = orjson.loads(body)
    if scope["path"] == "/tokenize":  # one token a word, as far as the stub's tokenizer goes
        await _respond(send, 200, orjson.dumps({"count": len(_prompt(request).split())}))
        return
    headers = dict(scope["headers"])
    RECEIVED.append({"path": scope["path"], "body": request,
                     "authorization": headers.get(b"authorization", b"").decode(),
                     "request_id": headers.get(b"x-request-id", b"").decode()})
    prompt = _prompt(request)
    if scope["path"] == "/v1/messages":
        await _messages(send, prompt, stream=bool(request.get("stream")))
        return
    if scope["path"] == "/v1/messages/count_tokens":
        await _respond(send, 200, orjson.dumps({"input_tokens": len(prompt.split())}))
        return
    if scope["path"] in POOLED:
        await _pooled(send, scope["path"], request)
        return
    if prompt == "think":
        await _think(send, stream=bool(request.get("stream")))
        return
    if prompt == "context":
        await _respond(send, 400, CONTEXT_ERROR)
        return
    if prompt == "crash":
        await _respond(send, 500, ENGINE_ERROR)
        return
    slow, steady, lasting = prompt == "slow", prompt == "steady", prompt == "lasting"
    chunks = 20 if slow else 200 if steady else 150 if lasting else 4
    if not request.get("stream"):
        if slow:
            await asyncio.sleep(1.0)
        answer = orjson.dumps({
            "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
            "choices": [{"index": 0, "finish_reason": "length",
                         "text": "x" * HUGE_TEXT_BYTES if prompt == "huge" else " t0 t1 t2 t3"}],
            "usage": LIES if prompt == "lie" else {
                "prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                "prompt_tokens_details": {"cached_tokens": 3}}})
        if prompt == "garbled":
            answer = b"[1, 2]"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        piece = 64 * 1024
        for start in range(0, len(answer), piece):
            await send({"type": "http.response.body", "body": answer[start:start + piece],
                        "more_body": start + piece < len(answer)})
        return
    options = request.get("stream_options") or {}
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for index in range(chunks):
        if prompt == "drop" and index == 2:
            raise ConnectionAbortedError("the stub engine dies in mid-stream")
        if prompt == "garbled" and index == 2:
            await send({"type": "http.response.body", "body": b"data: [1, 2]\n\n",
                        "more_body": True})
        usage = ({"prompt_tokens": 7, "completion_tokens": index + 1,
                  "total_tokens": 8 + index} if options.get("continuous_usage_stats") else None)
        text = "x" * LONG_EVENT_TEXT_BYTES if prompt == "long" and index == 1 else ""
        await send({"type": "http.response.body",
                    "body": _chunk(index, usage, text, last=index == chunks - 1),
                    "more_body": True})
        if slow or steady or lasting:
            await asyncio.sleep(0.2 if slow else 0.1 if lasting else 0.01)
    tail = b""
    if options.get("include_usage"):
        tail = b"data: " + orjson.dumps({
            "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
            "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": chunks,
                                     "total_tokens": 7 + chunks}}) + b"\n\n"
    await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})


THOUGHTS = ["The user asks", " for the weather", " in Paris."]
TOOL_CALL = {"id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
THINK_USAGE = {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}


async def _think(send: object, *, stream: bool) -> None:
    """A chat answer of thinking and a tool call, shaped as vLLM's: thoughts stream in
    `delta.reasoning`, and no `content` ever comes."""
    def chat(**fields: object) -> dict:
        return {"id": "chatcmpl-stub", "created": 0, "model": "stub", **fields}

    if not stream:
        await _respond(send, 200, orjson.dumps(chat(object="chat.completion", choices=[{
            "index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "reasoning": "".join(THOUGHTS),
                "tool_calls": [TOOL_CALL]}}], usage=THINK_USAGE)))
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    deltas = [{"role": "assistant", "reasoning": THOUGHTS[0]},
              *({"reasoning": thought} for thought in THOUGHTS[1:]),
              {"tool_calls": [{"index": 0, **TOOL_CALL}]}]
    for number, delta in enumerate(deltas):
        last = number == len(deltas) - 1
        event = chat(object="chat.completion.chunk", choices=[{
            "index": 0, "delta": delta, "finish_reason": "tool_calls" if last else None}])
        await send({"type": "http.response.body", "more_body": True,
                    "body": b"data: " + orjson.dumps(event) + b"\n\n"})
    await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chat(
        object="chat.completion.chunk", choices=[], usage=THINK_USAGE)) + b"\n\ndata: [DONE]\n\n"})


# An Anthropic answer's usage as vLLM gives it: its prompt of 9 is 4 new tokens, 3 read from
# the prefix cache and 2 written to it.
MESSAGE_USAGE = {"input_tokens": 4, "cache_read_input_tokens": 3,
                 "cache_creation_input_tokens": 2, "output_tokens": 4}
ENGINE_ERROR_EVENT = orjson.dumps({"type": "error", "error": {
    "type": "internal_error", "message": "EngineCore encountered an issue."}})


async def _messages(send: object, prompt: str, *, stream: bool) -> None:
    if prompt == "context":
        await _respond(send, 400, orjson.dumps({"type": "error", "error": {
            "type": "BadRequestError", "message": "This model's maximum context length is "
            "2048 tokens. However, your prompt contains 3000 input tokens."}}))
        return
    message = {"id": "msg_stub", "type": "message", "role": "assistant", "model": "stub",
               "content": [{"type": "text", "text": " t0 t1 t2 t3"}],
               "stop_reason": "max_tokens", "stop_sequence": None}
    usage = {**MESSAGE_USAGE, "cache_read_input_tokens": -4} if prompt == "lie" else (
        MESSAGE_USAGE)
    if not stream:
        await _respond(send, 200, orjson.dumps({**message, "usage": usage}))
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})

    async def event(kind: str, **data: object) -> None:
        await send({"type": "http.response.body", "more_body": True, "body": (
            f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **data})
            + b"\n\n")})

    await event("message_start", message={**message, "content": [], "stop_reason": None,
                                          "usage": {**MESSAGE_USAGE, "output_tokens": 0}})
    await event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    for index in range(4):
        if prompt == "drop" and index == 2:
            raise ConnectionAbortedError("the stub engine dies in mid-stream")
        if prompt == "fail" and index == 2:
            await send({"type": "http.response.body", "body": b"event: error\ndata: "
                        + ENGINE_ERROR_EVENT + b"\n\n"})
            return
        await event("content_block_delta", index=0,
                    delta={"type": "text_delta", "text": f" t{index}"})
    await event("content_block_stop", index=0)
    await event("message_delta", delta={"stop_reason": "max_tokens", "stop_sequence": None},
                usage=usage)
    await event("message_stop")
    await send({"type": "http.response.body", "body": b""})


POOLED = ("/v1/embeddings", "/v1/score", "/v1/rerank")
EMBEDDING = [0.6, 0.8]


async def _pooled(send: object, path: str, request: dict) -> None:
    def listed(texts: object) -> list[str]:
        return [str(text) for text in (texts if isinstance(texts, list) else [texts])]

    if path == "/v1/embeddings":
        inputs = listed(request["input"])
        pairs = [(text, "") for text in inputs]
    else:
        query = request.get("query", request.get("text_1"))
        documents = listed(request.get("documents", request.get("text_2")))
        pairs = [(str(query), document) for document in documents]
    if any("context" in pair for pair in pairs):
        await _respond(send, 400, CONTEXT_ERROR)
        return
    tokens = sum(len(first.split()) + len(second.split()) for first, second in pairs)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    if path == "/v1/embeddings":
        answer = {"id": "embd-stub", "object": "list", "created": 0, "model": request["model"],
                  "data": [{"index": index, "object": "embedding", "embedding": EMBEDDING}
                           for index in range(len(pairs))], "usage": usage}
    elif path == "/v1/score":
        answer = {"id": "score-stub", "object": "list", "created": 0, "model": request["model"],
                  "data": [{"index": index, "object": "score", "score": 1 / (index + 1)}
                           for index in range(len(pairs))], "usage": usage}
    else:
        answer = {"id": "score-stub", "model": request["model"],
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                  "results": [{"index": index, "document": {"text": document},
                               "relevance_score": 1 / (index + 1)}
                              for index, (_, document) in enumerate(pairs)]}
    await _respond(send, 200, orjson.dumps(answer))

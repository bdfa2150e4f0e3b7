"""The OpenAI-compatible surface: which paths are operations, what a request must hold, how
many tokens it may use, and how an endpoint is listed as a model."""

from __future__ import annotations

import math
from typing import Any

import orjson

from engine import tasks
from gateway.directory import Route
from gateway.errors import GatewayError

# Path → the operation a usage record names; the engine serves the same path.
MESSAGES = "messages"  # Anthropic's Messages API (gateway.messages)
# Anthropic's count of a message's input tokens, which the engine serves: a request that
# consumes none (metered as a request, of no tokens).
COUNT_TOKENS = "count_tokens"
OPERATIONS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions",
              "/v1/messages": MESSAGES, "/v1/messages/count_tokens": COUNT_TOKENS,
              "/v1/embeddings": "embeddings", "/v1/score": "score", "/v1/rerank": "rerank"}
CHATS = frozenset({"chat.completions", MESSAGES})
POOLED = tasks.OPERATIONS[tasks.EMBED] | tasks.OPERATIONS[tasks.SCORE]
# Operations that generate nothing: each reserves, and a client that leaves one is billed,
# the input tokens it was estimated to read.
NOTHING_GENERATED = POOLED | {COUNT_TOKENS}
# Where each operation's texts are in its request: an embedding's inputs, and the two sides
# a score or a rerank pairs (vLLM's names for them, all of which it takes).
POOLED_FIELDS = {"embeddings": (("input", ""),),
                 "score": (("text_1", "text_2"), ("queries", "documents"),
                           ("queries", "items"), ("data_1", "data_2")),
                 "rerank": (("query", "documents"),)}
ENCODINGS = ("float", "base64")  # an embedding's, in JSON
ENGINE_PATHS = {operation: path for path, operation in OPERATIONS.items()}
# OpenAI's rule of thumb for a prompt before it is tokenized, and what a chat template adds
# around each message.
CHARACTERS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4


def parse_request(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object naming an endpoint; 400 saying what is wrong."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"The request body is not valid JSON ({exc}); send a JSON "
                           "object.", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise GatewayError(400, "The request body must be a JSON object.", code="invalid_json")
    if not isinstance(payload.get("model"), str) or not payload["model"]:
        raise GatewayError(400, "Say which endpoint to use: 'model' is the endpoint's name.",
                           code="invalid_request", param="model")
    if not isinstance(payload.get("messages", []), list):
        raise GatewayError(400, "'messages' must be a list of messages.",
                           code="invalid_request", param="messages")
    if not isinstance(payload.get("prompt", ""), str | list):
        raise GatewayError(400, "'prompt' must be a string, or a list of strings or token ids.",
                           code="invalid_request", param="prompt")
    if not isinstance(payload.get("stream", False), bool):
        raise GatewayError(400, "'stream' must be true or false.", code="invalid_request",
                           param="stream")
    if not isinstance(payload.get("stream_options") or {}, dict):
        raise GatewayError(400, "'stream_options' must be an object.", code="invalid_request",
                           param="stream_options")
    return payload


def sequences(payload: dict[str, Any]) -> int:
    """How many sequences the request asks the engine to run: its prompts (a completion may
    send a list of them) times its choices (`n`)."""
    prompt = payload.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(
        prompt[0], int) else 1
    choices = payload.get("n")
    if isinstance(choices, bool) or not isinstance(choices, int) or choices < 1:
        choices = 1
    return prompts * choices


def require_task(operation: str, route: Route) -> None:
    """400 for an operation the endpoint's engines do not serve: a chat sent to an embedding
    model, an embedding asked of a chat model."""
    if operation in tasks.OPERATIONS[route.task]:
        return
    served = {tasks.GENERATE: "chat and completions (/v1/chat/completions, /v1/completions "
                              "and /v1/messages)",
              tasks.EMBED: "embeddings (/v1/embeddings, and /v1/score and /v1/rerank by "
                           "their similarity)",
              tasks.SCORE: "scores (/v1/score and /v1/rerank)"}
    raise GatewayError(400, f"The endpoint {route.name} serves {served[route.task]}, not "
                       f"{operation}: send this request to an endpoint whose model is made "
                       "for it (GET /v1/models lists what each serves).",
                       code="unsupported_operation", param="model")


def pooled_estimate(operation: str, payload: dict[str, Any], *, task: str) -> tuple[int, int]:
    """The prompt tokens of an embedding, score or rerank request as far as they can be
    known without the model's tokenizer, and the most inputs the engine may read for it
    (what bounds the usage it reports); 400 for a request without its texts, or an
    embedding asked in an encoding other than JSON's. A reranker (a cross-encoder) reads the
    query again with each document; an embedding model embeds each text once and compares."""
    if operation == "embeddings" and payload.get("encoding_format", "float") not in ENCODINGS:
        raise GatewayError(400, "'encoding_format' must be \"float\" or \"base64\".",
                           code="invalid_request", param="encoding_format")
    for first, second in POOLED_FIELDS[operation]:
        if payload.get(first) and (not second or payload.get(second)):
            lefts, rights = _items(payload[first]), _items(payload.get(second))
            break
    else:
        wanted = " and ".join(f"'{name}'" for name in POOLED_FIELDS[operation][0] if name)
        raise GatewayError(400, f"A request to {operation} needs {wanted}.",
                           code="invalid_request", param=POOLED_FIELDS[operation][0][0])
    repeated = len(rights) if task == tasks.SCORE and len(lefts) == 1 else 1
    return (repeated * sum(map(_input_tokens, lefts)) + sum(map(_input_tokens, rights)),
            len(lefts) + len(rights))


def _items(texts: object) -> list[object]:
    """One side of a pooled request as its inputs: a list of texts (or of token-id lists),
    or one text, or one list of token ids."""
    if texts is None:
        return []
    if isinstance(texts, list) and texts and not isinstance(texts[0], int):
        return texts
    return [texts]


def _input_tokens(item: object) -> int:
    if isinstance(item, list):  # token ids
        return len(item)
    text = item.get("text") if isinstance(item, dict) else item  # a rerank document's
    return math.ceil(len(text) / CHARACTERS_PER_TOKEN) if isinstance(text, str) else 1


def model_entry(route: Route) -> dict[str, Any]:
    """How `route` is listed in /v1/models; an adapter names its endpoint as its parent.
    `task` says what its engines serve (engine.tasks: generate, embed or score), and
    `capabilities` what they take beyond plain chat: tools (any tool_choice), reasoning
    (thinking in the answer's `reasoning` field) and structured outputs (response_format
    with a JSON schema, which every generating engine takes)."""
    entry: dict[str, Any] = {
        "id": route.name, "object": "model", "created": route.created,
        "owned_by": route.organization_slug, "task": route.task,
        "capabilities": {"tools": route.tools and route.chat_template,
                         "reasoning": route.reasoning,
                         "structured_outputs": route.task == tasks.GENERATE}}
    if route.adapter:
        entry["parent"] = route.endpoint_name
    return entry


def require_tool_parser(payload: dict[str, Any], route: Route, *, anthropic: bool) -> None:
    """400 for a chat's tools sent to an endpoint whose engines have no tool-call parser: the
    engine would refuse them naming its own start flags, which its user cannot set. vLLM
    takes tools with tool_choice "none" or null without one (and "auto" when it is absent)."""
    choice = payload.get("tool_choice", "auto")
    if anthropic:  # its "none" is {"type": "none"}, and null is "auto"
        choice = "none" if isinstance(choice, dict) and choice.get("type") == "none" else "auto"
    if payload.get("tools") and choice not in (None, "none") and not route.tools:
        raise GatewayError(400, f"The model behind {route.name} has no tool-call parser, so "
                           "its engines take no tools (GET /v1/models shows each endpoint's "
                           "capabilities). Send tool_choice "
                           + ('{"type": "none"}' if anthropic else '\"none\"')
                           + ", or use a model whose catalog entry names a tool-call parser.",
                           code="tools_unsupported",
                           param="tools")


def estimated_prompt_tokens(payload: dict[str, Any]) -> int:
    """The prompt's tokens as far as they can be known without the model's tokenizer: token
    ids count as themselves, text one token per CHARACTERS_PER_TOKEN characters; tools, and
    the calls of earlier turns, as their JSON (the chat template writes them in)."""
    characters, tokens = 0, 0
    if isinstance(payload.get("tools"), list):
        characters += len(orjson.dumps(payload["tools"]))
    characters += len(_text_of(payload.get("system")))  # Anthropic's
    for message in payload.get("messages") or ():
        tokens += TOKENS_PER_MESSAGE
        characters += len(_text_of(message.get("content") if isinstance(message, dict)
                                   else None))
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            characters += len(orjson.dumps(calls))
    prompt = payload.get("prompt")
    for item in prompt if isinstance(prompt, list) else [prompt]:
        if isinstance(item, str):
            characters += len(item)
        elif isinstance(item, int):
            tokens += 1
        elif isinstance(item, list):  # one prompt as token ids
            tokens += len(item)
    return tokens + math.ceil(characters / CHARACTERS_PER_TOKEN)


def _text_of(content: object) -> str:
    """What a message's content writes into the prompt: its text, or its blocks' (text,
    thinking, a tool call's input and a tool result's content, as Anthropic's blocks hold
    them; not images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    written = []
    for block in content:
        if isinstance(block, str):
            written.append(block)
        elif isinstance(block, dict):
            for field in ("text", "thinking"):
                if isinstance(block.get(field), str):
                    written.append(block[field])
            if "input" in block:
                written.append(orjson.dumps(block["input"]).decode())
            written.append(_text_of(block.get("content")))
    return "".join(written)


def tokens_to_reserve(payload: dict[str, Any], *, prompt_tokens: int, context_length: int) -> int:
    """What a request may consume at most: its prompt and the completion it allows
    (max_completion_tokens or max_tokens), within the endpoint's context; the whole context
    when it sets no bound."""
    limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return context_length
    return max(1, min(context_length, prompt_tokens + limit))

"""Errors in OpenAI's shape and codes, whatever the engine said.

OpenAI clients read `error.code` and `error.type` and map the status to an exception
(401 AuthenticationError, 404 NotFoundError, 429 RateLimitError, ...); vLLM answers with an
integer `code` and its own type names, so engine errors are rewritten here.
"""

from __future__ import annotations

import ast
import re

import orjson

CONTEXT_LENGTH_MARKERS = ("maximum context length", "maximum model length", "max_model_len")
# vLLM's request validation: a count, then pydantic's error dicts as Python literals, a line
# each. And what its own checks append to their messages, also in `param`.
VALIDATION_ERRORS = re.compile(r"\d+ validation errors?:\n")
PARAMETER_SUFFIX = re.compile(r" \(parameter=[^()]*\)$")
# vLLM's messages are a few hundred characters; one that echoes a request may be as long as
# the request. Reading it costs time in the gateway's event loop: a person reads this much.
LONGEST_MESSAGE = 2000


class GatewayError(Exception):
    """A request the gateway answers itself, with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, code: str | None,
                 kind: str | None = None, param: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.kind = kind or _kind_for(status)
        self.param = param
        self.headers = headers or []

    def body(self) -> bytes:
        return orjson.dumps({"error": self.as_dict()})

    def as_dict(self) -> dict[str, object]:
        return {"message": self.message, "type": self.kind, "param": self.param,
                "code": self.code}

    def anthropic_body(self, request_id: str = "") -> bytes:
        """The error in the shape of Anthropic's Messages API (gateway.messages); an
        overloaded engine is Anthropic's overloaded_error, an endpoint not serving (stopped,
        failed, starting) its api_error."""
        kind = ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500
                                   else "api_error")
        if kind == "overloaded_error" and self.code != "engine_unavailable":
            kind = "api_error"
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": self.message},
                             **({"request_id": request_id} if request_id else {})})

    def anthropic_event(self, request_id: str = "") -> bytes:
        """The error as an Anthropic stream's last event, as its own streams end on one."""
        return b"event: error\ndata: " + self.anthropic_body(request_id) + b"\n\n"


# Anthropic's error types by status (its SDK reads the status; people read the type).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   402: "billing_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _kind_for(status: int) -> str:
    if status == 403:
        return "permission_error"
    if status == 429:
        return "requests"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def from_engine(status: int, body: bytes) -> GatewayError:
    """The engine's error response, as the client should see it."""
    try:
        detail = orjson.loads(body).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        detail = {}
    message = str(detail.get("message") or body[:500].decode("utf-8", "replace")
                  or f"the engine answered {status}")
    return engine_message(status, message, param=detail.get("param"))


def engine_message(status: int, message: str, *, param: str | None = None) -> GatewayError:
    if status in (400, 422):
        message = readable(message)
        if any(marker in message for marker in CONTEXT_LENGTH_MARKERS):
            return GatewayError(400, message, code="context_length_exceeded", param=param)
        return GatewayError(400, message, code="invalid_request", param=param)
    if status == 404:
        return GatewayError(404, message, code="model_not_found", param=param)
    if status in (401, 403):
        # The engine refused the gateway's own credentials: kvrun's fault, not the caller's.
        return GatewayError(502, "The engine refused the gateway; this is kvrun's error, "
                            "retry shortly.", code="engine_unavailable")
    if status == 503:
        return GatewayError(503, f"The engine is overloaded or restarting ({message}); retry "
                            "shortly.", code="engine_unavailable")
    return GatewayError(502, f"The engine failed: {message}", code="engine_error")


def readable(message: str) -> str:
    """An engine's refusal as a person reads it: a validation error's fields and what is wrong
    with each ("messages: Field required"), not pydantic's dicts; at most LONGEST_MESSAGE
    characters of it."""
    if len(message) > LONGEST_MESSAGE:
        message = message[:LONGEST_MESSAGE] + "…"
    lines = message.splitlines()
    if not VALIDATION_ERRORS.match(message) or len(lines) < 2:
        return PARAMETER_SUFFIX.sub("", message.rstrip())
    problems = [_problem(line.strip()) for line in lines[1:]]
    return f"Invalid request: {'; '.join(problems)}."


def _problem(line: str) -> str:
    """One of vLLM's validation error lines as "field: what is wrong"; the line as it is
    when it is not one ("...and 3 more errors")."""
    field: str | None
    problem: str | None
    try:
        error = ast.literal_eval(line)
        field, problem = str(error["loc"]), str(error["msg"])
    except Exception:  # not a literal (a ValueError(...) in ctx), or too deep to read
        field, problem = _quoted_after(line, "'loc': "), _quoted_after(line, "'msg': ")
        if field is None or problem is None:
            return line
    return f"{field.removeprefix('body.')}: {PARAMETER_SUFFIX.sub('', problem).rstrip('.')}"


def _quoted_after(line: str, key: str) -> str | None:
    """The quoted string after `key` in a dict's repr, up to its closing quote before the next
    key or the end of the dict."""
    start = line.find(key)
    if start < 0 or len(line) <= start + len(key):
        return None
    start += len(key)
    quote = line[start]
    if quote not in "'\"":
        return None
    end = line.find(f"{quote}, '", start + 1)
    if end < 0:
        end = line.find(f"{quote}}}", start + 1)
    return line[start + 1:end] if end > 0 else None

"""The OpenAI-compatible surface: which paths are operations, what a request must hold, and
how an endpoint is listed as a model."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.directory import Route
from gateway.errors import GatewayError

# Path → the operation a usage record names; the engine serves the same path.
OPERATIONS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions"}
ENGINE_PATHS = {operation: path for path, operation in OPERATIONS.items()}


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
    if not isinstance(payload.get("stream", False), bool):
        raise GatewayError(400, "'stream' must be true or false.", code="invalid_request",
                           param="stream")
    if not isinstance(payload.get("stream_options") or {}, dict):
        raise GatewayError(400, "'stream_options' must be an object.", code="invalid_request",
                           param="stream_options")
    return payload


def model_entry(route: Route) -> dict[str, Any]:
    return {"id": route.name, "object": "model", "created": route.created,
            "owned_by": route.organization_slug}

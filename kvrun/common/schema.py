"""What the API schema says beyond drf-spectacular's reading of the views: the errors each
operation may answer with, in the envelope of kvrun.common.api.exception_handler, so that a client
generated from the schema knows every status code it can get."""

from typing import Any

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["type", "message", "fields"],
        "properties": {
            "type": {"type": "string", "description": "What went wrong, e.g. invalid_request."},
            "message": {"type": "string", "description": "A sentence a person can act on."},
            "fields": {"type": "object", "description": "Each invalid field's messages."},
        },
    }},
}
ALWAYS = {
    "401": "No credentials, or a key or session that is not valid.",
    "403": "The caller may not do this (its role, or its key's scope).",
    "429": "Too many requests; the Retry-After header says when to try again.",
}
WITH_PATH_PARAMETERS = {"404": "No such object in an organisation the caller belongs to."}
WITH_INPUT = {"400": "The request is invalid; the message and fields say what to change."}
PAGED = {"404": "No such page."}
WITH_BODY = {"413": "The request body is larger than the limit.",
             "415": "The request body is not JSON."}


def document_errors(result: dict[str, Any], **_: Any) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the Error schema, and the error responses each
    operation may give, added where the view did not document its own."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = ERROR
    # Every input serializer is a kvrun.common.api.StrictSerializer: unknown fields are refused.
    for name, schema in schemas.items():
        if name.endswith("Request") and schema.get("type") == "object":
            schema["additionalProperties"] = False
            for field in schema.get("properties", {}).values():
                _refuse_nul(field.get("items", field))
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path, operations in result["paths"].items():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["in"] != "query" or parameter["name"] == "ordering":
                    continue  # an ordering it cannot read leaves the default order
                # A filter left empty (`?state=`) filters nothing, as django-filter reads it.
                if "enum" in parameter["schema"]:
                    parameter["schema"]["enum"] = ["", *parameter["schema"]["enum"]]
                _refuse_nul(parameter["schema"])
            codes = dict(ALWAYS)
            if "{" in path:
                codes |= WITH_PATH_PARAMETERS
            if operation.get("parameters") or operation.get("requestBody"):
                codes |= WITH_INPUT
            if any(parameter["name"] == "page" for parameter in operation.get("parameters", [])):
                codes |= PAGED
            if operation.get("requestBody"):
                codes |= WITH_BODY
            for code, description in codes.items():
                operation["responses"].setdefault(code, {"description": description,
                                                         "content": error})
    return result


def _refuse_nul(field: dict[str, Any]) -> None:
    """DRF refuses text with NUL characters (PostgreSQL cannot store them); say so."""
    if field.get("type") == "string" and not {"format", "enum", "pattern"} & set(field):
        field["pattern"] = "^[^\\u0000]*$"

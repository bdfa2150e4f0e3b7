"""API conventions shared by every app: error shape, pagination, strict input."""

from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions, serializers, status
from rest_framework.pagination import PageNumberPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from kvrun.clients import client_address
from kvrun.middleware import body_too_large_error


class Pagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 200


class AddressRateThrottle(SimpleRateThrottle):
    """A throttle per client address (kvrun.clients), signed in or not; subclasses set `scope`
    and `rate`. DRF's own would key on a whole X-Forwarded-For the client writes itself."""

    def get_cache_key(self, request: Request, view: APIView | None) -> str:
        return self.cache_format % {"scope": self.scope, "ident": client_address(request)}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Render every API error as {"error": {"type", "message", "fields"}}.

    `message` is a sentence a person can act on; `fields` maps each field to its messages.
    """
    if isinstance(exc, RequestDataTooBig):
        error = body_too_large_error(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
        return Response({"error": error}, status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("Not found; check the identifier and the organisation.")
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)
    elif isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        exc = exceptions.ValidationError(detail)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    response.data = {"error": _error_body(exc, response.data)}
    return response


def _error_body(exc: Exception, data: Any) -> dict[str, Any]:
    if isinstance(exc, exceptions.ValidationError):
        fields = _flatten(data) if isinstance(data, dict) else {"non_field_errors": _flatten(data)}
        general = fields.pop("non_field_errors", [])
        parts = [*general] + [f"{name}: {' '.join(msgs)}" for name, msgs in fields.items()]
        return {
            "type": "invalid_request",
            "message": " ".join(parts) or "The request is invalid.",
            "fields": fields if not general else {**fields, "non_field_errors": general},
        }
    if isinstance(exc, exceptions.ParseError):
        message = f"The request body is not valid JSON ({exc.detail}); send a JSON object."
        return {"type": "malformed_request", "message": message, "fields": {}}
    detail = data.get("detail", "") if isinstance(data, dict) else data
    return {"type": _type_of(exc), "message": str(detail), "fields": {}}


def _flatten(data: Any) -> Any:
    if isinstance(data, dict):
        return {key: _flatten(value) for key, value in data.items()}
    if isinstance(data, list):
        if all(isinstance(item, str) for item in data):
            return [str(item) for item in data]
        return [_flatten(item) for item in data]
    return [str(data)]


def _type_of(exc: Exception) -> str:
    return {
        exceptions.NotAuthenticated: "not_authenticated",
        exceptions.AuthenticationFailed: "authentication_failed",
        exceptions.PermissionDenied: "permission_denied",
        exceptions.NotFound: "not_found",
        exceptions.MethodNotAllowed: "method_not_allowed",
        exceptions.Throttled: "rate_limited",
        exceptions.UnsupportedMediaType: "unsupported_media_type",
    }.get(type(exc), "error")


def validated(serializer_class: type[serializers.Serializer], request: Any) -> dict[str, Any]:
    """The request body checked by `serializer_class`; a 400 with field messages otherwise."""
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


class StrictSerializer(serializers.Serializer):
    """A serializer that refuses fields it does not know instead of ignoring them."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {name: ["Unknown field; remove it from the request."] for name in unknown}
                )
        return super().to_internal_value(data)

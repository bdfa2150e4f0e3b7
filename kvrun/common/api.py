"""API conventions shared by every app: error shape, pagination, strict input."""

from typing import Any, cast

import django_filters
from django import forms
from django.conf import settings
from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.utils.cache import add_never_cache_headers
from django.views.defaults import page_not_found
from rest_framework import exceptions, serializers, status
from rest_framework.pagination import PageNumberPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from kvrun.common.clients import client_address
from kvrun.common.middleware import body_too_large_error, no_such_api_path


class Pagination(PageNumberPagination):
    """Pages of 50 (page_size up to 200); a page or page_size that is not a number in range
    is a 400, not ignored (a page past the last is a 404)."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 200
    last_page_strings = ()  # page is a number, as the schema says

    def get_page_number(self, request: Request, paginator: Any) -> str:
        asked = request.query_params.get(self.page_query_param)
        if asked is None:
            return "1"
        if not asked.isdigit() or int(asked) < 1:
            raise exceptions.ValidationError({"page": ["A whole number from 1."]})
        return asked

    def get_page_size(self, request: Request) -> int:
        asked = request.query_params.get(self.page_size_query_param)
        if asked is None:
            return self.page_size
        if not asked.isdigit() or not 1 <= int(asked) <= self.max_page_size:
            raise exceptions.ValidationError(
                {"page_size": [f"A whole number from 1 to {self.max_page_size}."]})
        return int(asked)

    def get_schema_operation_parameters(self, view: APIView) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.page_query_param: {"minimum": 1},
                  self.page_size_query_param: {"minimum": 1, "maximum": self.max_page_size}}
        for parameter in parameters:
            parameter["schema"] |= bounds.get(parameter["name"], {})
        return parameters


class AddressRateThrottle(SimpleRateThrottle):
    """A throttle per client address (kvrun.common.clients), signed in or not; subclasses set
    `scope` and `rate`. DRF's own would key on a whole X-Forwarded-For the client writes
    itself."""

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
        detail = (exc.message_dict if hasattr(exc, "error_dict")
                  else {"non_field_errors": exc.messages})
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
        parts = [*_sentences(general)] + [f"{name}: {' '.join(_sentences(msgs))}"
                                          for name, msgs in fields.items()]
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


def _sentences(messages: Any) -> list[str]:
    """The messages of one field as sentences; a list's items say which item they are about
    (DRF keys them by index)."""
    if isinstance(messages, dict):
        return [f"item {key + 1}: {sentence}" if isinstance(key, int) else f"{key}: {sentence}"
                for key, value in messages.items() for sentence in _sentences(value)]
    if isinstance(messages, list):
        return [sentence for message in messages for sentence in _sentences(message)]
    return [str(messages)]


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


def validated(serializer_class: type[serializers.Serializer], request: Any, *,
              partial: bool = False, context: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request body checked by `serializer_class` (each field optional when `partial`),
    with `context` for fields that read it; a 400 with field messages otherwise."""
    serializer = serializer_class(data=request.data, partial=partial, context=context or {})
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


class StrictSerializer(serializers.Serializer):
    """A serializer that refuses fields it does not know instead of ignoring them, and values
    of another JSON type than its schema says (DRF would take 0 for "0" and "5" for 5)."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {name: ["Unknown field; remove it from the request."] for name in unknown}
                )
            mistyped = {name: [f"Must be {_json_type(self.fields[name])[1]}."]
                        for name, value in data.items() if not _of_json_type(self.fields[name],
                                                                             value)}
            mistyped |= {name: ["Null characters are not allowed."]
                         for name, value in data.items()
                         if isinstance(value, str) and "\x00" in value}
            if mistyped:
                raise serializers.ValidationError(mistyped)
        return super().to_internal_value(data)


def _json_type(field: serializers.Field) -> tuple[tuple[type, ...], str]:
    """The JSON types a field takes, and how to say so; ((), "") for any."""
    if isinstance(field, serializers.BooleanField):
        return (bool,), "true or false"
    if isinstance(field, serializers.IntegerField):
        return (int,), "a whole number"
    if isinstance(field, serializers.ListField):
        return (list,), "a list"
    if isinstance(field, serializers.ChoiceField):
        kinds = {type(choice) for choice in field.choices}
        return tuple(kinds), "one of " + ", ".join(map(str, field.choices))
    if isinstance(field, serializers.CharField | serializers.DateTimeField
                  | serializers.UUIDField | serializers.RelatedField):
        return (str,), "a string"
    return (), ""


def _of_json_type(field: serializers.Field, value: Any) -> bool:
    types, _ = _json_type(field)
    if value is None or not types:
        return True
    if isinstance(value, bool) and bool not in types:
        return False
    if not isinstance(value, types):
        return False
    if isinstance(field, serializers.ListField):
        items = cast("list[Any]", value)  # a list: its type was checked above
        return all(item is not None and _of_json_type(field.child, item) for item in items)
    return True


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """A URL no route matches (Django's handler404): under /api/ in the API's error envelope,
    so that API clients never get an HTML page; elsewhere Django's page."""
    if request.path.startswith("/api/"):
        return no_such_api_path()
    return page_not_found(request, exception)


class TrueOrFalse(forms.Field):
    """A query parameter that is `true` or `false`; anything else is refused, where
    django-filter's boolean field would read it as no filter at all."""

    def to_python(self, value: str | None) -> bool | None:
        if value is None:
            return None
        if value not in ("true", "false"):
            raise forms.ValidationError("Must be true or false.")
        return value == "true"


class BooleanFilter(django_filters.BooleanFilter):
    field_class = TrueOrFalse


def secret_response(data: dict[str, Any]) -> Response:
    """A 201 that carries a secret shown once: no cache, shared or the client's own, may
    keep it."""
    response = Response(data, status=status.HTTP_201_CREATED)
    add_never_cache_headers(response)
    return response

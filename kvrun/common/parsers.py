"""The API's request parsers. Kept apart from kvrun.common.api: DRF imports them while its own
views module is still loading."""

from collections.abc import Mapping
from typing import Any

from rest_framework import exceptions, parsers


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, with a body nested past the interpreter's recursion limit refused as
    malformed (400) instead of failing the request (500)."""

    def parse(self, stream: Any, media_type: str | None = None,
              parser_context: Mapping[str, Any] | None = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError(
                "arrays or objects nested too deeply; nest them a few levels at most") from None

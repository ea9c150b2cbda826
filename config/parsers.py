"""The control plane's request parser: one JSON object, within bounds.

Public surface: ``BodyParser`` (``REST_FRAMEWORK["DEFAULT_PARSER_CLASSES"]``).

DRF's own JSONParser lets a body nested about 1,000 deep raise RecursionError, a
500; this one parses with ``config.json_body``, the gateway's bounds
(nesting, lone surrogates, non-finite numbers, huge integers), each a 400 naming
the field. Kept apart from ``config.api``: DRF imports its parser classes while
``rest_framework.views`` is still loading, so this module must not import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework.parsers import JSONParser

from config.errors import InvalidRequest
from config.json_body import BodyError, parse_json_object

__all__ = ["BodyParser"]


class BodyParser(JSONParser):
    """Parse a JSON object within ``config.json_body``'s bounds."""

    def parse(
        self,
        stream: Any,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        raw = stream.read() if stream is not None else b""
        try:
            return parse_json_object(raw)
        except BodyError as exc:
            raise InvalidRequest(exc.message, param=exc.param, code=exc.code) from None

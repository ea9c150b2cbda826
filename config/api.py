"""Helpers shared by the control-plane views."""

from __future__ import annotations

from typing import Any

from config.errors import InvalidRequest


def validated(serializer_class: type, data: Any) -> dict[str, Any]:
    """Return the validated body or raise DRF's ValidationError (rendered as a 400)."""
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)

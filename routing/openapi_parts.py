"""Small pieces the gateway's OpenAPI schemas are built from.

Public surface: ``Schema``, ``nullable``, ``pattern``, ``needs``, ``json_content``,
``EVENT``, ``SERVED_BY``.

Shared by ``routing.openapi`` and the schemas of each generation surface beside it
(``routing.openapi_completions``, ``routing.openapi_responses``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EVENT",
    "SERVED_BY",
    "Schema",
    "json_content",
    "needs",
    "nullable",
    "pattern",
]

Schema = dict[str, Any]


def nullable(schema: Schema) -> Schema:
    """Return ``schema`` or null."""
    return {"anyOf": [schema, {"type": "null"}]}


def pattern(regex: str) -> str:
    """Return ``regex`` anchored at both ends (JSON Schema patterns search)."""
    return f"^{regex}$"


def needs(field: str, other: str, *, value: Any = None) -> Schema:
    """``field`` absent or null, or ``other`` present (equal to ``value``, if
    given)."""
    present: Schema = {"required": [other]}
    if value is not None:
        present["properties"] = {other: {"const": value}}
    return {"anyOf": [{"properties": {field: {"type": "null"}}}, present]}


def json_content(ref: str) -> Schema:
    """Return a JSON body of the component ``ref``."""
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


# One server-sent event: its data is a chat.completion.chunk (JSON), an error
# object, or the closing "[DONE]".
EVENT: Schema = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}
SERVED_BY: dict[str, Schema] = {
    "model_version": {"type": "string"},
    "region": {"type": "string"},
    "replica_id": {"type": "string"},
}

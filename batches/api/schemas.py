"""The OpenAPI shapes of the Files and Batch APIs (OpenAI's, with the seed's fields).

Public surface: ``FILE``, ``FILE_UPLOAD``, ``BATCH``, ``BATCH_CREATE``, ``page_of``,
``ID_PATTERN``, ``list_parameters``.

Written beside the views that answer them (``batches.api.views``,
``batches.services.file_object`` and ``batch_object``); schemathesis holds the
answers to them (``tests/test_v1_schema_live.py``).
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter

from batches.domain.lines import ENDPOINTS

__all__ = [
    "BATCH",
    "BATCH_CREATE",
    "FILE",
    "FILE_UPLOAD",
    "ID_PATTERN",
    "list_parameters",
    "page_of",
]

ID_PATTERN = r"^[A-Za-z0-9_-]{1,40}$"


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_INT = {"type": "integer"}
_STR = {"type": "string"}

FILE: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
    "properties": {
        "id": _STR,
        "object": {"const": "file"},
        "bytes": {"type": "integer", "minimum": 0},
        "created_at": _INT,
        "filename": _STR,
        "purpose": _STR,
        "status": _STR,
        "status_details": _nullable(_STR),
        "expires_at": _nullable(_INT),
    },
}

FILE_UPLOAD: dict[str, Any] = {
    "multipart/form-data": {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {
            "file": {
                "type": "string",
                "format": "binary",
                "description": "JSONL: one request per line.",
            },
            "purpose": {"const": "batch"},
        },
    }
}

BATCH: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "endpoint", "status", "created_at", "request_counts"],
    "properties": {
        "id": _STR,
        "object": {"const": "batch"},
        "endpoint": _STR,
        "errors": _nullable({"type": "object"}),
        "input_file_id": _nullable(_STR),
        "completion_window": _nullable(_STR),
        "status": _STR,
        "output_file_id": _nullable(_STR),
        "error_file_id": _nullable(_STR),
        **{
            f"{moment}_at": _nullable(_INT)
            for moment in (
                "created",
                "in_progress",
                "expires",
                "finalizing",
                "completed",
                "failed",
                "expired",
                "cancelling",
                "cancelled",
                "projected_finish",
            )
        },
        "at_risk_since": _nullable(_INT),
        "request_counts": {
            "type": "object",
            "required": ["total", "completed", "failed"],
            "properties": {"total": _INT, "completed": _INT, "failed": _INT},
        },
        "metadata": _nullable(
            {"type": "object", "additionalProperties": {"type": "string"}}
        ),
        "batch_id": _STR,
        "model": _nullable(_STR),
        "input_uri": _nullable(_STR),
        "output_uri": _nullable(_STR),
        "deadline": _nullable(_INT),
        "priority": _nullable(_STR),
        "refused": _nullable(_INT),
        "at_risk": _nullable({"type": "boolean"}),
        "schedule": _nullable(_STR),
    },
}

_TEXT = {
    "type": "string",
    "minLength": 1,
    "maxLength": 1024,
    "pattern": r"^[^\x00]*\S[^\x00]*$",
}

BATCH_CREATE: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI's form (input_file_id, completion_window), or the "
    "seed's (input_uri, output_uri, model, deadline).",
    "properties": {
        "input_file_id": _nullable(_TEXT),
        "endpoint": _nullable({"enum": list(ENDPOINTS)}),
        "completion_window": _nullable(_TEXT),
        "metadata": _nullable(
            {
                "type": "object",
                "maxProperties": 16,
                "propertyNames": {"maxLength": 64, "pattern": r"^[^\x00]*$"},
                "additionalProperties": {
                    "type": "string",
                    "maxLength": 512,
                    "pattern": r"^[^\x00]*$",
                },
            }
        ),
        "input_uri": _nullable(_TEXT),
        "output_uri": _nullable(_TEXT),
        "model": _nullable(_TEXT),
        "deadline": _nullable(
            {
                "anyOf": [
                    {"type": "number"},
                    {"type": "string", "format": "date-time"},
                ],
                "description": "A unix time in seconds or an ISO 8601 time with "
                "its offset; at most 7 days away.",
            }
        ),
    },
}


def page_of(item: dict[str, Any]) -> dict[str, Any]:
    """Return the schema of a list page of ``item``s (OpenAI's cursor page)."""
    return {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": item},
            "first_id": _nullable(_STR),
            "last_id": _nullable(_STR),
            "has_more": {"type": "boolean"},
        },
    }


def list_parameters(*, most: int) -> list[OpenApiParameter]:
    """Return a list's ``after`` and ``limit`` query parameters."""
    return [
        OpenApiParameter(
            "after",
            OpenApiTypes.STR,
            description="The last id of the previous page (empty: the first).",
            pattern=r"^[A-Za-z0-9_-]{0,40}$",
        ),
        OpenApiParameter(
            "limit",
            {"type": "integer", "minimum": 1, "maximum": most},
            description="How many to list.",
        ),
    ]

"""The OpenAPI schema of ``POST /v1/responses``: its request and its answer.

Public surface: ``responses_components``, ``responses_path_item``.

The request is written from the constants ``routing.domain.responses_body``
checks with (accepted fields, roles, item kinds, formats, what may be included,
the metadata caps), so the schema and the check cannot drift apart; a test holds
them equal. Unknown fields are a 400, so the request admits no others; what the
platform never does (store, continue a stored response) admits only false or
null. ``routing.openapi`` puts it into the /v1 schema.
"""

from __future__ import annotations

from routing.domain import chat_body as rules
from routing.domain import responses_body as responses_rules
from routing.openapi_parts import (
    EVENT,
    SERVED_BY,
    Schema,
    json_content,
    needs,
    nullable,
    pattern,
)

__all__ = ["responses_components", "responses_path_item"]


def responses_components() -> dict[str, Schema]:
    """Return the response's schemas by name."""
    return {
        "InputItems": _input_items(),
        "ResponseRequest": _responses_request(),
        "Response": _response(),
    }


def responses_path_item(parameters: list[Schema], errors: dict[str, Schema]) -> Schema:
    """Return the path item of ``/v1/responses``."""
    return {
        "post": {
            "operationId": "createResponse",
            "summary": "Answer a conversation (Responses API), whole or as a "
            "stream of typed events. Nothing is stored.",
            "parameters": parameters,
            "requestBody": {
                "required": True,
                "content": json_content("ResponseRequest"),
            },
            "responses": {
                "200": {
                    "description": "The response object, with who served it; "
                    "with stream true, server-sent typed events (response.created "
                    "... response.completed, whose response carries the usage "
                    "and who served it). An error after the first token comes "
                    "as an error event.",
                    "content": {
                        **json_content("Response"),
                        "text/event-stream": {"schema": EVENT},
                    },
                },
                **errors,
            },
        }
    }


def _input_items() -> Schema:
    """A response's input items: messages, function calls and their outputs."""

    def parts(kind: str) -> Schema:
        return {"type": "array", "minItems": 1, "items": _typed_text_part(kind)}

    def message(roles: list[str], part: str) -> Schema:
        return {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": roles},
                "content": {"anyOf": [{"type": "string"}, parts(part)]},
            },
        }

    def call(kind: str, fields: list[str]) -> Schema:
        return {
            "type": "object",
            "required": ["type", *fields],
            "properties": {
                "type": {"const": kind},
                **{name: {"type": "string"} for name in fields},
            },
        }

    speakers = sorted(responses_rules.INPUT_ROLES - {"assistant"})
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                message(speakers, "input_text"),
                message(["assistant"], "output_text"),
                call("function_call", ["call_id", "name", "arguments"]),
                call("function_call_output", ["call_id", "output"]),
            ]
        },
    }


def _typed_text_part(kind: str) -> Schema:
    return {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": kind}, "text": {"type": "string"}},
    }


def _text_config() -> Schema:
    name = {"type": "string", "pattern": pattern(rules.NAME_PATTERN)}
    simple = sorted(responses_rules.TEXT_FORMATS - {"json_schema"})
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "format": nullable(
                {
                    "anyOf": [
                        {
                            "type": "object",
                            "required": ["type"],
                            "properties": {"type": {"enum": simple}},
                        },
                        {
                            "type": "object",
                            "required": ["type", "name", "schema"],
                            "properties": {
                                "type": {"const": "json_schema"},
                                "name": name,
                                "schema": {"type": "object"},
                                "strict": nullable({"type": "boolean"}),
                                "description": nullable({"type": "string"}),
                            },
                        },
                    ]
                }
            )
        },
    }


def _responses_request() -> Schema:
    name = {"type": "string", "pattern": pattern(rules.NAME_PATTERN)}
    tool = {
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "function"},
            "name": name,
            "description": nullable({"type": "string"}),
            "parameters": nullable(
                {"type": "object", "description": "A JSON Schema of an object."}
            ),
            "strict": nullable({"type": "boolean"}),
        },
    }
    refused = "Not served (any other value is a 400, unsupported_parameter): "
    properties: dict[str, Schema] = {
        "model": {"type": "string", "minLength": 1},
        "input": {
            "anyOf": [{"type": "string"}, {"$ref": "#/components/schemas/InputItems"}],
            "description": "A user message, or the whole conversation as items.",
        },
        "instructions": nullable({"type": "string"}),
        "max_output_tokens": nullable(
            {
                "type": "integer",
                "minimum": 1,
                "description": "The prompt and this must fit the model's context "
                "length (a 400, context_length_exceeded, otherwise).",
            }
        ),
        "stream": nullable({"type": "boolean"}),
        "parallel_tool_calls": nullable({"type": "boolean"}),
        "user": nullable({"type": "string"}),
        "metadata": nullable(
            {
                "type": "object",
                "maxProperties": responses_rules.MAX_METADATA_PAIRS,
                "propertyNames": {"maxLength": responses_rules.MAX_METADATA_KEY_CHARS},
                "additionalProperties": {
                    "type": "string",
                    "maxLength": responses_rules.MAX_METADATA_VALUE_CHARS,
                },
            }
        ),
        "store": nullable(
            {
                "const": False,
                "description": "The platform never stores prompts or answers: "
                "true is a 400 (unsupported_value).",
            }
        ),
        "background": nullable(
            {"const": False, "description": "true is a 400 (unsupported_value)."}
        ),
        "include": nullable(
            {
                "type": "array",
                "items": {"enum": sorted(responses_rules.INCLUDABLE)},
            }
        ),
        "top_logprobs": nullable(
            {"type": "integer", "minimum": 0, "maximum": rules.MAX_TOP_LOGPROBS}
        ),
        "truncation": nullable({"enum": sorted(responses_rules.TRUNCATIONS)}),
        "text": nullable(_text_config()),
        "tools": nullable(
            {
                "type": "array",
                "minItems": 1,
                "maxItems": rules.MAX_TOOLS,
                "items": tool,
                "description": "Function tools with unique names. Served by "
                "versions whose engine parses tool calls; elsewhere a 400 "
                "(unsupported_parameter).",
            }
        ),
        "tool_choice": nullable(
            {
                "anyOf": [
                    {"enum": sorted(rules.TOOL_CHOICES)},
                    {
                        "type": "object",
                        "required": ["type", "name"],
                        "description": "Names one of tools.",
                        "properties": {"type": {"const": "function"}, "name": name},
                    },
                ]
            }
        ),
    }
    for field_name in responses_rules.RESPONSES_SAMPLING:
        low, high = rules.NUMBER_RANGES[field_name]
        properties[field_name] = nullable(
            {"type": "number", "minimum": low, "maximum": high}
        )
    for field_name, why in responses_rules.UNSUPPORTED_FIELDS.items():
        properties[field_name] = {"type": "null", "description": refused + why}
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": dict(sorted(properties.items())),
        "additionalProperties": False,
        "allOf": [
            needs("tool_choice", "tools"),
            needs("parallel_tool_calls", "tools"),
        ],
        "description": "OpenAI's Responses request, as far as the platform serves "
        "it: nothing is stored, so the whole conversation comes in input.",
    }


def _response() -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created_at", "model", "output", "status"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "created_at": {"type": "number"},
            "model": {"type": "string"},
            "status": {"type": "string"},
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": nullable(
                {
                    "type": "object",
                    "required": ["input_tokens", "output_tokens", "total_tokens"],
                    "properties": {
                        "input_tokens": {"type": "integer", "minimum": 0},
                        "output_tokens": {"type": "integer", "minimum": 0},
                        "total_tokens": {"type": "integer", "minimum": 0},
                        "input_tokens_details": {
                            "type": "object",
                            "properties": {
                                "cached_tokens": {"type": "integer", "minimum": 0}
                            },
                        },
                    },
                }
            ),
            **SERVED_BY,
        },
    }

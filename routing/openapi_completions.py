"""The OpenAPI schema of ``POST /v1/completions``: its request and its answer.

Public surface: ``completion_components``, ``completion_path_item``.

The request is written from the constants ``routing.domain.completion_body``
checks with (and chat's, for the fields they share), so the schema and the check
cannot drift apart. ``routing.openapi`` puts it into the /v1 schema.
"""

from __future__ import annotations

from routing.domain import chat_body as rules
from routing.domain import completion_body as completion_rules
from routing.domain import prompt_list
from routing.openapi_parts import (
    EVENT,
    SERVED_BY,
    Schema,
    json_content,
    needs,
    nullable,
)

__all__ = ["completion_components", "completion_path_item"]


def completion_components(chat_properties: dict[str, Schema]) -> dict[str, Schema]:
    """Return the completion's schemas by name; ``chat_properties`` are the chat
    request's, whose shared fields the completion request takes as they are."""
    return {
        "CompletionRequest": _completion_request(chat_properties),
        "Completion": _completion(),
    }


def completion_path_item(parameters: list[Schema], errors: dict[str, Schema]) -> Schema:
    """Return the path item of ``/v1/completions``."""
    return {
        "post": {
            "operationId": "createCompletion",
            "summary": "Continue a prompt (or several), whole or as a stream.",
            "parameters": parameters,
            "requestBody": {
                "required": True,
                "content": json_content("CompletionRequest"),
            },
            "responses": {
                "200": {
                    "description": "The completion; with stream true, "
                    "server-sent events of text_completion objects, the last "
                    "with usage and who served it, then [DONE].",
                    "content": {
                        **json_content("Completion"),
                        "text/event-stream": {"schema": EVENT},
                    },
                },
                **errors,
            },
        }
    }


def _completion_request(chat: dict[str, Schema]) -> Schema:
    token_ids = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "integer",
            "minimum": 0,
            "maximum": prompt_list.MAX_TOKEN_ID,
        },
    }
    properties: dict[str, Schema] = {
        name: chat[name]
        for name in (
            "model",
            "stream",
            "stream_options",
            "n",
            "seed",
            "stop",
            "logit_bias",
            "user",
            "max_tokens",
            *rules.NUMBER_RANGES,
        )
    }
    properties.update(
        prompt={
            "anyOf": [
                {"type": "string", "minLength": 1},
                token_ids,
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": completion_rules.MAX_PROMPTS,
                    "items": {"anyOf": [{"type": "string"}, token_ids]},
                },
            ],
            "description": "A prompt, token ids, or a list of either: each prompt "
            "of a list gets n choices of its own.",
        },
        echo=nullable({"type": "boolean"}),
        logprobs=nullable(
            {
                "type": "integer",
                "minimum": 0,
                "maximum": completion_rules.MAX_COMPLETION_LOGPROBS,
            }
        ),
        suffix={
            "type": "null",
            "description": "Not served: the models here do not fill in the middle "
            "(any other value is a 400, unsupported_parameter).",
        },
        best_of=nullable({"const": 1}),
    )
    properties["max_tokens"] = nullable(
        {
            "type": "integer",
            "minimum": 1,
            "description": "Per choice; "
            f"{completion_rules.DEFAULT_COMPLETION_MAX_TOKENS} when absent. Each "
            "prompt and this must fit the model's context length.",
        }
    )
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": dict(sorted(properties.items())),
        "allOf": [needs("stream_options", "stream", value=True)],
        "description": "OpenAI's (legacy) completions request. Fields not named "
        "here go to the engine as they are.",
    }


def _completion() -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "text", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer"},
                        "text": {"type": "string"},
                        "logprobs": nullable({"type": "object"}),
                        "finish_reason": {"type": "string"},
                    },
                },
            },
            "usage": {"$ref": "#/components/schemas/Usage"},
            **SERVED_BY,
        },
    }

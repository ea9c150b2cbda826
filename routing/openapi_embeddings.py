"""The OpenAPI schema of ``POST /v1/embeddings``: its request and its answer.

Public surface: ``embedding_components``, ``embedding_path_item``.

The request is written from the constants ``routing.domain.embedding_body``
checks with, so the schema and the check cannot drift apart. ``routing.openapi``
puts it into the /v1 schema.
"""

from __future__ import annotations

from routing.domain import embedding_body as rules
from routing.domain import prompt_list
from routing.openapi_parts import SERVED_BY, Schema, json_content, nullable

__all__ = ["embedding_components", "embedding_path_item"]


def embedding_components(chat_properties: dict[str, Schema]) -> dict[str, Schema]:
    """Return the embeddings' schemas by name; ``chat_properties`` are the chat
    request's, whose ``model`` and ``user`` the embeddings request takes."""
    return {
        "EmbeddingRequest": _embedding_request(chat_properties),
        "EmbeddingList": _embedding_list(),
    }


def embedding_path_item(parameters: list[Schema], errors: dict[str, Schema]) -> Schema:
    """Return the path item of ``/v1/embeddings``."""
    return {
        "post": {
            "operationId": "createEmbedding",
            "summary": "Embed an input (or several) with an embedding model.",
            "parameters": parameters,
            "requestBody": {
                "required": True,
                "content": json_content("EmbeddingRequest"),
            },
            "responses": {
                "200": {
                    "description": "One vector per input, in the input's order, "
                    "with the input tokens used and who served it. Never a "
                    "stream.",
                    "content": json_content("EmbeddingList"),
                },
                **errors,
            },
        }
    }


def _embedding_request(chat: dict[str, Schema]) -> Schema:
    token_ids = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0, "maximum": prompt_list.MAX_TOKEN_ID},
    }
    properties: dict[str, Schema] = {
        "model": chat["model"],
        "user": chat["user"],
        "input": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                token_ids,
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": rules.MAX_EMBEDDING_INPUTS,
                    "items": {"anyOf": [{"type": "string", "minLength": 1}, token_ids]},
                },
            ],
            "description": "A text, token ids, or a list of either (at most "
            f"{rules.MAX_EMBEDDING_INPUTS}): one vector each. Each must fit the "
            "model's max_input_tokens, or the request is a 400, never charged.",
        },
        "encoding_format": nullable({"enum": list(rules.ENCODING_FORMATS)}),
        "dimensions": nullable(
            {
                "type": "integer",
                "minimum": 1,
                "description": "At most the model's own dimensions.",
            }
        ),
        "stream": {
            "enum": [False, None],
            "description": "Embeddings are answered whole (true is a 400).",
        },
    }
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": dict(sorted(properties.items())),
        "description": "OpenAI's embeddings request, for an embedding model only "
        "(a chat model is a 400 naming model). Charged its input tokens only. "
        "Fields not named here go to the engine as they are.",
    }


def _embedding_list() -> Schema:
    return {
        "type": "object",
        "required": ["object", "model", "data", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "list"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "object", "embedding"],
                    "properties": {
                        "index": {"type": "integer"},
                        "object": {"const": "embedding"},
                        "embedding": {
                            "anyOf": [
                                {"type": "array", "items": {"type": "number"}},
                                {
                                    "type": "string",
                                    "description": "base64 of little-endian "
                                    "float32s (encoding_format base64).",
                                },
                            ]
                        },
                    },
                },
            },
            "usage": {
                "type": "object",
                "required": ["prompt_tokens", "total_tokens"],
                "properties": {
                    "prompt_tokens": {"type": "integer", "minimum": 0},
                    "total_tokens": {"type": "integer", "minimum": 0},
                },
            },
            **SERVED_BY,
        },
    }

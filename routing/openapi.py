"""The OpenAPI 3.1 description of the gateway's own operations under the team API.

Public surface: ``gateway_paths``, ``gateway_components``, ``error_responses``.

``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/responses``
(each a whole answer or a ``text/event-stream``), ``GET /v1/models`` and ``POST
/tokenize``; the completion's and the response's schemas are their own modules
(``routing.openapi_completions``, ``routing.openapi_responses``). The request
bodies are written from the constants ``routing.domain.chat_body`` and its
siblings check with (ranges, roles, the stop count, the name pattern, the caps on
``n``, tools and prompts...), so the schema and the checks cannot drift apart; a
test holds them equal. What the platform does not
serve (the deprecated ``functions``, a completion's ``suffix``, content parts
other than text) is stated: only ``null`` is valid there.
``config.v1_schema`` merges these paths with the Django-served ones.
"""

from __future__ import annotations

from routing.domain import chat_body as rules
from routing.domain.snapshot import MODEL_KINDS
from routing.domain.tiers import Tier
from routing.openapi_completions import completion_components, completion_path_item
from routing.openapi_embeddings import embedding_components, embedding_path_item
from routing.openapi_parts import (
    EVENT,
    SERVED_BY,
    Schema,
    json_content,
    needs,
    nullable,
    pattern,
)
from routing.openapi_responses import responses_components, responses_path_item

__all__ = ["error_responses", "gateway_components", "gateway_paths"]

ERROR_REF = {"$ref": "#/components/schemas/Error"}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before trying again.",
        "schema": {"type": "string"},
    }
}
# What each error status means on this API; an operation names the ones it can answer.
_ERRORS = {
    "400": "The request is malformed; the error's param names the field.",
    "401": "No API key, or one that is unknown or revoked.",
    "403": "The key may not do this (a batch job's key; a model without limits).",
    "404": "The model (or path) named does not exist.",
    "405": "The path does not take this method.",
    "413": "The body is larger than the gateway takes.",
    "422": "The replica refused the request's values.",
    "429": "The team's token or concurrency limit is reached; retry after a while.",
    "503": "No replica can serve now (starting, shedding, draining); retry later.",
}


def error_responses(*statuses: str) -> dict[str, Schema]:
    """Return the responses of ``statuses``, each in the one error shape."""
    responses: dict[str, Schema] = {}
    for status in statuses:
        response: Schema = {
            "description": _ERRORS[status],
            "content": {"application/json": {"schema": ERROR_REF}},
        }
        if status in ("429", "503"):
            response["headers"] = _RETRY_AFTER
        responses[status] = response
    return responses


def _text_part(kind: str) -> Schema:
    return {
        "type": "object",
        "required": ["type", kind],
        "properties": {"type": {"const": kind}, kind: {"type": "string"}},
    }


def _message(roles: list[str], *, content: Schema, required: list[str]) -> Schema:
    return {
        "type": "object",
        "required": ["role", *required],
        "properties": {
            "role": {"enum": roles},
            "content": content,
            "name": nullable({"type": "string"}),
        },
    }


def _messages() -> Schema:
    """Messages: a known role each; content a string or a non-empty list of text
    parts (refusal parts too in an assistant message, whose content may be null)."""
    text = {"$ref": "#/components/schemas/TextPart"}
    refusal = {"$ref": "#/components/schemas/RefusalPart"}
    content = {
        "anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": text}]
    }
    assistant_content = {
        "anyOf": [
            {"type": "string"},
            {"type": "null"},
            {"type": "array", "minItems": 1, "items": {"anyOf": [text, refusal]}},
        ]
    }
    speakers = sorted(rules.ALLOWED_ROLES - {"assistant", "tool"})
    tool = _message(["tool"], content=content, required=["content", "tool_call_id"])
    tool["properties"]["tool_call_id"] = {"type": "string"}
    assistant = _message(["assistant"], content=assistant_content, required=[])
    assistant["properties"]["tool_calls"] = nullable(
        {"type": "array", "items": {"$ref": "#/components/schemas/ToolCall"}}
    )
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "oneOf": [
                _message(speakers, content=content, required=["content"]),
                assistant,
                tool,
            ]
        },
    }


def _tool_call() -> Schema:
    """A tool call as the model made it: its arguments are a JSON string."""
    return {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": "string"},
                },
            },
        },
    }


def _tool() -> Schema:
    return {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": pattern(rules.NAME_PATTERN)},
                    "description": nullable({"type": "string"}),
                    "parameters": nullable(
                        {
                            "type": "object",
                            "description": "A JSON Schema of an object (checked "
                            "against the 2020-12 metaschema).",
                        }
                    ),
                    "strict": nullable({"type": "boolean"}),
                },
            },
        },
    }


def _tool_choice() -> Schema:
    return {
        "anyOf": [
            {"enum": sorted(rules.TOOL_CHOICES)},
            {
                "type": "object",
                "required": ["type", "function"],
                "description": "Names one of tools.",
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {
                                "type": "string",
                                "pattern": pattern(rules.NAME_PATTERN),
                            }
                        },
                    },
                },
            },
        ]
    }


def _chat_request() -> Schema:
    properties: dict[str, Schema] = {
        "model": {
            "type": "string",
            "minLength": 1,
            "description": "A model's name, or name@version to pin a version.",
        },
        "messages": {"$ref": "#/components/schemas/Messages"},
        "stream": nullable({"type": "boolean"}),
        "stream_options": nullable(
            {
                "type": "object",
                "description": "Only with stream true.",
                "properties": {"include_usage": nullable({"type": "boolean"})},
            }
        ),
        "n": nullable(
            {
                "type": "integer",
                "minimum": 1,
                "maximum": rules.MAX_N,
                "description": "Choices; each is charged max_tokens up front.",
            }
        ),
        "tools": nullable(
            {
                "type": "array",
                "minItems": 1,
                "maxItems": rules.MAX_TOOLS,
                "items": {"$ref": "#/components/schemas/Tool"},
                "description": "Functions the model may call, with unique names. "
                "Served by versions whose engine parses tool calls; elsewhere a "
                "400 (unsupported_parameter).",
            }
        ),
        "tool_choice": nullable({"$ref": "#/components/schemas/ToolChoice"}),
        "seed": nullable(
            {
                "type": "integer",
                "minimum": rules.INT64_RANGE[0],
                "maximum": rules.INT64_RANGE[1],
            }
        ),
        "stop": nullable(
            {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "maxItems": rules.MAX_STOP,
                        "items": {"type": "string"},
                    },
                ]
            }
        ),
        "top_logprobs": nullable(
            {
                "type": "integer",
                "minimum": 0,
                "maximum": rules.MAX_TOP_LOGPROBS,
                "description": "Only with logprobs true.",
            }
        ),
        "response_format": nullable({"$ref": "#/components/schemas/ResponseFormat"}),
        "logit_bias": nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {
                    "type": "number",
                    "minimum": rules.LOGIT_BIAS_RANGE[0],
                    "maximum": rules.LOGIT_BIAS_RANGE[1],
                },
            }
        ),
        "user": nullable({"type": "string"}),
    }
    for name in ("max_tokens", "max_completion_tokens"):
        properties[name] = nullable({"type": "integer", "minimum": 1})
    properties["max_completion_tokens"]["description"] = (
        "Wins over max_tokens. The prompt and this must fit the model's context "
        "length (a 400, context_length_exceeded, otherwise)."
    )
    for name, (low, high) in rules.NUMBER_RANGES.items():
        properties[name] = nullable({"type": "number", "minimum": low, "maximum": high})
    for name in rules.BOOLEAN_FLAGS:
        properties.setdefault(name, nullable({"type": "boolean"}))
    for name in rules.UNSUPPORTED_FIELDS:
        properties[name] = {
            "type": "null",
            "description": "Deprecated by OpenAI for tools and tool_choice, and not "
            "served (any other value is a 400, unsupported_parameter).",
        }
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": dict(sorted(properties.items())),
        # Fields that need another: stream_options needs stream true, top_logprobs
        # logprobs true, tool_choice and parallel_tool_calls tools.
        "allOf": [
            needs("stream_options", "stream", value=True),
            needs("top_logprobs", "logprobs", value=True),
            needs("tool_choice", "tools"),
            needs("parallel_tool_calls", "tools"),
        ],
        "description": "OpenAI's chat request. Fields not named here go to the "
        "engine as they are.",
    }


def _response_format() -> Schema:
    simple = sorted(rules.RESPONSE_FORMATS - {"json_schema"})
    return {
        "oneOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": simple}},
            },
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {
                                "type": "string",
                                "pattern": pattern(rules.NAME_PATTERN),
                            },
                            "schema": nullable({"type": "object"}),
                            "strict": nullable({"type": "boolean"}),
                            "description": nullable({"type": "string"}),
                        },
                    },
                },
            },
        ]
    }


def _tokenize_request() -> Schema:
    properties: dict[str, Schema] = {
        "model": {"type": "string", "minLength": 1},
        "prompt": {"type": "string"},
        "messages": {"$ref": "#/components/schemas/Messages"},
    }
    for name in rules.TOKENIZE_FLAGS:
        properties[name] = nullable({"type": "boolean"})
    return {
        "type": "object",
        "required": ["model"],
        "properties": properties,
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
        "description": "vLLM's two forms: a prompt, or chat messages (not both).",
    }


_USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "cached_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
        },
    },
}


def _chat_completion() -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer"},
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": nullable({"type": "string"}),
                                "tool_calls": {
                                    "type": "array",
                                    "items": {"$ref": "#/components/schemas/ToolCall"},
                                },
                            },
                        },
                        "logprobs": nullable({"type": "object"}),
                        "finish_reason": {"type": "string"},
                    },
                },
            },
            "usage": {"$ref": "#/components/schemas/Usage"},
            **SERVED_BY,
        },
    }


def _model_list() -> Schema:
    return {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "created", "owned_by", "kind"],
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"const": "model"},
                        "created": {"type": "integer"},
                        "owned_by": {"type": "string"},
                        "live_version": {"type": "string"},
                        "kind": {
                            "enum": list(MODEL_KINDS),
                            "description": "The API the model answers: chat "
                            "(chat completions, completions, responses) or "
                            "embedding (/v1/embeddings).",
                        },
                        "dimensions": {
                            "type": "integer",
                            "minimum": 1,
                            "description": "An embedding model's vector size.",
                        },
                        "max_input_tokens": {
                            "type": "integer",
                            "minimum": 1,
                            "description": "The most tokens one input of an "
                            "embedding model may take.",
                        },
                    },
                },
            },
        },
    }


def _tokenize_answer() -> Schema:
    return {
        "type": "object",
        "required": ["count", "tokens"],
        "properties": {
            "count": {"type": "integer", "minimum": 0},
            "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": nullable({"type": "array", "items": {"type": "string"}}),
        },
    }


def gateway_components() -> dict[str, Schema]:
    """Return the schemas the gateway's operations refer to, by name."""
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["type", "message", "param", "code"],
                    "properties": {
                        "type": {"type": "string"},
                        "message": {"type": "string"},
                        "param": nullable({"type": "string"}),
                        "code": nullable({"type": "string"}),
                    },
                }
            },
            "description": "Every error: OpenAI's shape.",
        },
        "TextPart": _text_part("text"),
        "RefusalPart": _text_part("refusal"),
        "Messages": _messages(),
        "ResponseFormat": _response_format(),
        "Tool": _tool(),
        "ToolChoice": _tool_choice(),
        "ToolCall": _tool_call(),
        "ChatCompletionRequest": _chat_request(),
        "ChatCompletion": _chat_completion(),
        **completion_components(_chat_request()["properties"]),
        **embedding_components(_chat_request()["properties"]),
        "Usage": _USAGE,
        "ModelList": _model_list(),
        **responses_components(),
        "TokenizeRequest": _tokenize_request(),
        "TokenizeAnswer": _tokenize_answer(),
    }


def gateway_paths() -> dict[str, Schema]:
    """Return the gateway's operations, keyed by path (OpenAPI ``paths``)."""
    tiers = [tier.value for tier in Tier]
    headers = [
        {
            "name": "x-priority",
            "in": "header",
            "required": False,
            "description": "The request's tier (standard when absent).",
            "schema": {"enum": tiers},
        },
        {
            "name": "x-conversation-id",
            "in": "header",
            "required": False,
            "description": "Keeps a conversation on one replica (its prefix cache).",
            "schema": {"type": "string"},
        },
    ]
    chat_errors = ("400", "401", "403", "404", "405", "413", "422", "429", "503")
    return {
        "/v1/chat/completions": {
            "post": {
                "operationId": "createChatCompletion",
                "summary": "Answer a chat, whole or as a stream of events.",
                "parameters": headers,
                "requestBody": {
                    "required": True,
                    "content": json_content("ChatCompletionRequest"),
                },
                "responses": {
                    "200": {
                        "description": "The answer; with stream true, server-sent "
                        "events of chat.completion.chunk objects, the last with usage "
                        "and who served it, then [DONE]. An error after the first "
                        "token comes as an error event.",
                        "content": {
                            **json_content("ChatCompletion"),
                            "text/event-stream": {"schema": EVENT},
                        },
                    },
                    **error_responses(*chat_errors),
                },
            }
        },
        "/v1/completions": completion_path_item(headers, error_responses(*chat_errors)),
        "/v1/responses": responses_path_item(headers, error_responses(*chat_errors)),
        "/v1/embeddings": embedding_path_item(headers, error_responses(*chat_errors)),
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "List the models the key's team may call.",
                "responses": {
                    "200": {
                        "description": "The models.",
                        "content": json_content("ModelList"),
                    },
                    **error_responses("401", "403", "405", "503"),
                },
            }
        },
        "/tokenize": {
            "post": {
                "operationId": "tokenize",
                "summary": "Count a prompt's tokens with the model's tokenizer.",
                "parameters": headers[1:],
                "requestBody": {
                    "required": True,
                    "content": json_content("TokenizeRequest"),
                },
                "responses": {
                    "200": {
                        "description": "The tokens.",
                        "content": json_content("TokenizeAnswer"),
                    },
                    **error_responses(
                        "400", "401", "403", "404", "405", "413", "422", "503"
                    ),
                },
            }
        },
    }

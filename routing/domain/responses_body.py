"""The fields of a ``/v1/responses`` request body, checked as OpenAI checks them.

Public surface: ``ResponsesBody``, ``check_responses_body``, ``input_messages``
and the constants they check with, which ``routing.openapi`` writes into the
schema (``ACCEPTED_FIELDS``, ``INPUT_ROLES``, ``INPUT_ITEMS``, ``TEXT_FORMATS``,
``INCLUDABLE``...).

The input is a string or a non-empty list of items: messages (a role of
``INPUT_ROLES``, content a string or ``input_text`` parts, ``output_text`` for an
assistant), ``function_call`` and ``function_call_output`` items. It is turned
into chat messages (``instructions`` first, as a system message), which is what
vLLM's Responses serving renders with the chat template: the gateway counts the
prompt and keys the route on them as it does a chat's. Tools are Responses' flat
functions, returned in chat's shape for the count.

This platform never stores prompts or answers, and serves only what vLLM serves,
so these are refused, never dropped in silence: ``store: true``,
``previous_response_id`` and ``conversation`` (send the whole conversation in
``input``), ``background: true``, ``include`` beyond ``INCLUDABLE``, tools other
than functions, media input parts, and any field not in ``ACCEPTED_FIELDS``.
Messages never quote the client's values: they may be prompt text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from config.json_body import BodyError
from routing.domain.chat_body import (
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    NAME_PATTERN,
    NUMBER_RANGES,
    TOOL_CHOICES,
    check_json_schema,
    check_model,
)

__all__ = [
    "ACCEPTED_FIELDS",
    "INCLUDABLE",
    "INPUT_ITEMS",
    "INPUT_ROLES",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_PAIRS",
    "MAX_METADATA_VALUE_CHARS",
    "MEDIA_INPUT_PARTS",
    "RESPONSES_SAMPLING",
    "TEXT_FORMATS",
    "TRUNCATIONS",
    "UNSUPPORTED_FIELDS",
    "ResponsesBody",
    "check_responses_body",
    "input_messages",
]

INPUT_ROLES = frozenset({"user", "system", "developer", "assistant"})
INPUT_ITEMS = frozenset({"message", "function_call", "function_call_output"})
MEDIA_INPUT_PARTS = frozenset({"input_image", "input_file", "input_audio"})
TEXT_FORMATS = frozenset({"text", "json_object", "json_schema"})
# What vLLM adds to an answer on request: the output text's log probabilities.
INCLUDABLE = frozenset({"message.output_text.logprobs"})
# vLLM does not truncate a long conversation for the client ("auto").
TRUNCATIONS = frozenset({"disabled"})
RESPONSES_SAMPLING = ("temperature", "top_p")
MAX_METADATA_PAIRS = 16  # OpenAI's caps
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Fields refused whatever their value (null aside), and why.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "previous_response_id": "this platform never stores responses, so none can be "
    "continued: send the whole conversation in input",
    "conversation": "this platform never stores conversations: send the whole "
    "conversation in input",
}
ACCEPTED_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "text",
        "stream",
        "user",
        "metadata",
        "store",
        "background",
        "include",
        "top_logprobs",
        "truncation",
        *RESPONSES_SAMPLING,
        *UNSUPPORTED_FIELDS,
    }
)
_UNSUPPORTED_VALUE = "unsupported_value"
_NAME = re.compile(NAME_PATTERN)


@dataclass(frozen=True, slots=True)
class ResponsesBody:
    """What the gateway needs of a valid ``/v1/responses`` body.

    ``messages`` is the input as chat messages, instructions first;
    ``max_output_tokens`` the client's, None when absent; ``tools`` the function
    tools in chat's shape (``{"type": "function", "function": {...}}``), None
    without tools.
    """

    model: str
    messages: list[dict[str, Any]]
    stream: bool
    max_output_tokens: int | None
    tools: list[dict[str, Any]] | None = None


def check_responses_body(body: Mapping[str, Any]) -> ResponsesBody:
    """Return what the gateway needs of ``body``, every field checked.

    Raises:
        BodyError: the first field OpenAI would refuse, or the platform cannot
            serve, naming it.
    """
    for name in body:
        if name not in ACCEPTED_FIELDS:
            raise BodyError(
                "unknown parameter: the responses API here takes "
                + ", ".join(sorted(ACCEPTED_FIELDS - UNSUPPORTED_FIELDS.keys())),
                param=name,
                code="unknown_parameter",
            )
    model = check_model(body)
    _check_storage(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BodyError("instructions must be a string", param="instructions")
    items = _check_input(body.get("input"))
    max_output_tokens = _check_scalars(body)
    _check_metadata(body.get("metadata"))
    _check_include(body)
    truncation = body.get("truncation")
    if truncation is not None and not _is_one_of(truncation, TRUNCATIONS):
        raise BodyError(
            "truncation may only be disabled here: send a conversation that fits "
            "the model's context",
            param="truncation",
            code=_UNSUPPORTED_VALUE if isinstance(truncation, str) else None,
        )
    _check_text(body.get("text"))
    tools = _check_tools(body)
    return ResponsesBody(
        model=model,
        messages=input_messages(instructions, items),
        stream=bool(body.get("stream")),
        max_output_tokens=max_output_tokens,
        tools=tools,
    )


def input_messages(
    instructions: str | None, items: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Return checked input items as chat messages, ``instructions`` first.

    A message keeps its role and text; consecutive function calls become one
    assistant message's ``tool_calls``; a call's output a ``tool`` message.
    """
    messages: list[dict[str, Any]] = []
    if instructions:  # as vLLM: empty instructions add no system message
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append(
                    {"role": "assistant", "content": None, "tool_calls": [call]}
                )
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": item["output"],
                }
            )
        else:
            content = item["content"]
            if isinstance(content, list):
                content = [{"type": "text", "text": part["text"]} for part in content]
            messages.append({"role": item["role"], "content": content})
    return messages


# -- one field at a time ------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_one_of(value: object, names: frozenset[str]) -> bool:
    """True when ``value`` is one of ``names`` (a list or object never is, and
    must not reach a set's hash)."""
    return isinstance(value, str) and value in names


def _check_scalars(body: Mapping[str, Any]) -> int | None:
    """Check the numbers, flags and ``user``; return ``max_output_tokens``."""
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None and not (
        _is_int(max_output_tokens) and max_output_tokens >= 1
    ):
        raise BodyError(
            "max_output_tokens must be a positive integer", param="max_output_tokens"
        )
    for name in RESPONSES_SAMPLING:
        low, high = NUMBER_RANGES[name]
        value = body.get(name)
        if value is not None and not (_is_number(value) and low <= value <= high):
            raise BodyError(
                f"{name} must be a number between {low:g} and {high:g}", param=name
            )
    for name in ("stream", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BodyError(f"{name} must be a boolean", param=name)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BodyError("user must be a string", param="user")
    return max_output_tokens


def _check_storage(body: Mapping[str, Any]) -> None:
    """Refuse what asks the platform to keep or find a response."""
    store = body.get("store")
    if store is not None:
        if not isinstance(store, bool):
            raise BodyError("store must be a boolean", param="store")
        if store:
            raise BodyError(
                "this platform never stores prompts or answers: send store false, "
                "or leave it out",
                param="store",
                code=_UNSUPPORTED_VALUE,
            )
    background = body.get("background")
    if background is not None:
        if not isinstance(background, bool):
            raise BodyError("background must be a boolean", param="background")
        if background:
            raise BodyError(
                "background responses are not served: this platform never stores "
                "a response to fetch later; send background false, or leave it out",
                param="background",
                code=_UNSUPPORTED_VALUE,
            )
    for name, why in UNSUPPORTED_FIELDS.items():
        if body.get(name) is not None:
            raise BodyError(
                f"{name} is not supported: {why}",
                param=name,
                code="unsupported_parameter",
            )


def _check_input(value: Any) -> list[dict[str, Any]]:
    """Return the input as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BodyError(
            "input must be a string or a non-empty list of items", param="input"
        )
    for index, item in enumerate(value):
        where = f"input.{index}"
        if not isinstance(item, dict):
            raise BodyError("each input item must be an object", param=where)
        kind = item.get("type", "message")
        if not _is_one_of(kind, INPUT_ITEMS):
            raise BodyError(
                "an input item's type must be one of "
                + ", ".join(sorted(INPUT_ITEMS))
                + " (nothing is stored here to refer to)",
                param=f"{where}.type",
                code=_UNSUPPORTED_VALUE if isinstance(kind, str) else None,
            )
        if kind == "message":
            _check_message(item, where)
        else:
            fields = (
                ("call_id", "output")
                if kind == "function_call_output"
                else ("call_id", "name", "arguments")
            )
            for name in fields:
                if not isinstance(item.get(name), str):
                    raise BodyError(
                        f"a {kind} item needs {name} (a string)",
                        param=f"{where}.{name}",
                    )
    return value


def _check_message(item: Mapping[str, Any], where: str) -> None:
    role = item.get("role")
    if not isinstance(role, str) or role not in INPUT_ROLES:
        raise BodyError(
            f"each message needs a role of {', '.join(sorted(INPUT_ROLES))}",
            param=f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise BodyError(
            "a message's content must be a string or a non-empty list of parts",
            param=f"{where}.content",
        )
    text_part = "output_text" if role == "assistant" else "input_text"
    for index, part in enumerate(content):
        at = f"{where}.content.{index}"
        kind = part.get("type") if isinstance(part, dict) else None
        if _is_one_of(kind, MEDIA_INPUT_PARTS):
            raise BodyError(
                f"{kind} parts are not supported: the models here are text-only",
                param=f"{at}.type",
                code=_UNSUPPORTED_VALUE,
            )
        if kind != text_part:
            raise BodyError(
                f"a{'n' if role == 'assistant' else ''} {role} message's parts "
                f"must be {text_part} parts",
                param=f"{at}.type" if isinstance(part, dict) else at,
            )
        assert isinstance(part, dict)
        if not isinstance(part.get("text"), str):
            raise BodyError("a text part needs text (a string)", param=f"{at}.text")


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise BodyError(
            f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs",
            param="metadata",
        )
    for key, value in metadata.items():
        if not (
            len(key) <= MAX_METADATA_KEY_CHARS
            and isinstance(value, str)
            and len(value) <= MAX_METADATA_VALUE_CHARS
        ):
            raise BodyError(
                f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters, "
                f"values strings of at most {MAX_METADATA_VALUE_CHARS}",
                param="metadata",
            )


def _check_include(body: Mapping[str, Any]) -> None:
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise BodyError("include must be a list", param="include")
        for index, name in enumerate(include):
            if not _is_one_of(name, INCLUDABLE):
                raise BodyError(
                    "include may name only " + ", ".join(sorted(INCLUDABLE)),
                    param=f"include.{index}",
                    code=_UNSUPPORTED_VALUE if isinstance(name, str) else None,
                )
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None and not (
        _is_int(top_logprobs) and 0 <= top_logprobs <= MAX_TOP_LOGPROBS
    ):
        raise BodyError(
            f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}",
            param="top_logprobs",
        )


def _check_text(text: Any) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise BodyError("text must be an object", param="text")
    for name in text:
        if name != "format":
            raise BodyError("text takes only format here", param=f"text.{name}")
    fmt = text.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise BodyError("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if not isinstance(kind, str) or kind not in TEXT_FORMATS:
        raise BodyError(
            "text.format.type must be one of " + ", ".join(sorted(TEXT_FORMATS)),
            param="text.format.type",
        )
    if kind == "json_schema":
        _check_schema_format(fmt)


def _check_schema_format(fmt: Mapping[str, Any]) -> None:
    _check_name(fmt.get("name"), param="text.format.name")
    if "schema" not in fmt:
        raise BodyError(
            "a json_schema format needs schema (an object)", param="text.format.schema"
        )
    check_json_schema(fmt["schema"], param="text.format.schema")
    for name, kind_type, kind_name in (
        ("strict", bool, "a boolean"),
        ("description", str, "a string"),
    ):
        value = fmt.get(name)
        if value is not None and not isinstance(value, kind_type):
            raise BodyError(
                f"text.format.{name} must be {kind_name}", param=f"text.format.{name}"
            )


def _check_name(name: Any, *, param: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BodyError(
            "a name must be 1 to 64 letters, digits, underscores or dashes",
            param=param,
        )


def _check_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Check the tool fields; return the tools in chat's shape (None: none)."""
    tools = body.get("tools")
    if tools is None:
        for name in ("tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise BodyError(
                    f"{name} is only allowed when tools are specified", param=name
                )
        return None
    if not isinstance(tools, list) or not tools:
        raise BodyError("tools must be a non-empty list", param="tools")
    if len(tools) > MAX_TOOLS:
        raise BodyError(f"tools may hold at most {MAX_TOOLS} tools", param="tools")
    chat_tools: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        chat_tools.append(_chat_tool(tool, f"tools.{index}", chat_tools))
    _check_tool_choice(body.get("tool_choice"), chat_tools)
    return chat_tools


def _chat_tool(tool: Any, at: str, earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """Check one flat function tool; return it in chat's shape."""
    if not isinstance(tool, dict):
        raise BodyError("each tool must be an object", param=at)
    kind = tool.get("type")
    if kind != "function":
        raise BodyError(
            "only function tools are served here (no hosted tools)",
            param=f"{at}.type",
            code=_UNSUPPORTED_VALUE if isinstance(kind, str) else None,
        )
    _check_name(tool.get("name"), param=f"{at}.name")
    if tool["name"] in (t["function"]["name"] for t in earlier):
        raise BodyError("tool names must be unique", param=f"{at}.name")
    for name, kind_type, kind_name in (
        ("parameters", dict, "an object"),
        ("strict", bool, "a boolean"),
        ("description", str, "a string"),
    ):
        value = tool.get(name)
        if value is not None and not isinstance(value, kind_type):
            raise BodyError(
                f"a function's {name} must be {kind_name}", param=f"{at}.{name}"
            )
    function: dict[str, Any] = {"name": tool["name"]}
    if tool.get("parameters") is not None:
        check_json_schema(tool["parameters"], param=f"{at}.parameters", of_object=True)
        function["parameters"] = tool["parameters"]
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _check_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> None:
    if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICES):
        return
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise BodyError(
            "tool_choice must be one of "
            + ", ".join(sorted(TOOL_CHOICES))
            + " or an object of type function naming one",
            param="tool_choice",
        )
    _check_name(choice.get("name"), param="tool_choice.name")
    if choice["name"] not in (tool["function"]["name"] for tool in tools):
        raise BodyError(
            "tool_choice names a function that is not in tools",
            param="tool_choice.name",
        )

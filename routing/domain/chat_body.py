"""The fields of a chat (or tokenize) request body, checked as OpenAI checks them.

Public surface: ``ALLOWED_ROLES``, ``ChatBody``, ``TokenizeBody``,
``check_chat_body``, ``check_messages``, ``check_tokenize_body``, and the
constants they check with, which ``routing.openapi`` writes into the API's schema
(``NUMBER_RANGES``, ``MAX_STOP``, ``MAX_TOP_LOGPROBS``, ``NAME_PATTERN``...).

The gateway relies on a few fields (``model``, ``messages``, ``max_tokens``,
``stream``, ``stream_options``) and passes the rest to the engine. A value OpenAI
would refuse is refused here, before admission, with a ``BodyError`` naming the
parameter (``messages.0.content.1.type``), so a bad request is never charged and
never reaches a replica. What the platform cannot serve is refused as clearly
(code ``unsupported_parameter`` or ``unsupported_value``), never dropped in silence:

- ``n`` other than the integer 1: one choice per request;
- ``tools`` and ``functions`` (so ``tool_choice``, ``function_call`` and
  ``parallel_tool_calls`` too): the replicas run no tool-call parser, the prompt
  count leaves tools out, and whole answers are assembled from text;
- content parts other than ``text`` (and ``refusal``, in an assistant message):
  the models are text-only.

Messages never quote the client's values: they may be prompt text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from config.json_body import BodyError

__all__ = [
    "ALLOWED_ROLES",
    "BOOLEAN_FLAGS",
    "INT64_RANGE",
    "LOGIT_BIAS_RANGE",
    "MAX_STOP",
    "MAX_TOP_LOGPROBS",
    "MEDIA_PARTS",
    "NAME_PATTERN",
    "NUMBER_RANGES",
    "RESPONSE_FORMATS",
    "TOKENIZE_FLAGS",
    "TOOL_CHOICES",
    "UNSUPPORTED_FIELDS",
    "ChatBody",
    "TokenizeBody",
    "check_chat_body",
    "check_messages",
    "check_tokenize_body",
]

ALLOWED_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MEDIA_PARTS = frozenset({"image_url", "input_audio", "file"})
TOOL_CHOICES = frozenset({"none", "auto", "required"})
RESPONSE_FORMATS = frozenset({"text", "json_object", "json_schema"})
# The sampling numbers and their closed ranges.
NUMBER_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
NAME_PATTERN = r"[a-zA-Z0-9_-]{1,64}"
_NAME = re.compile(NAME_PATTERN)
INT64_RANGE = (-(2**63), 2**63 - 1)
LOGIT_BIAS_RANGE = (-100, 100)
MAX_TOP_LOGPROBS = 20
MAX_STOP = 4
_UNSUPPORTED = "unsupported_parameter"
BOOLEAN_FLAGS = ("logprobs", "parallel_tool_calls")
# Refused whatever their value (null aside): the platform runs no tool calls.
UNSUPPORTED_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
)
_KIND_NAMES: dict[type, str] = {dict: "an object", bool: "a boolean", str: "a string"}
TOKENIZE_FLAGS = (
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
)


@dataclass(frozen=True, slots=True)
class ChatBody:
    """What the gateway needs of a valid chat body.

    ``max_tokens`` is the client's (``max_completion_tokens`` wins), None when
    absent; ``include_usage`` is False only when ``stream_options.include_usage``
    is false (absent, the stream still ends with the usage event).
    """

    model: str
    messages: list[dict[str, Any]]
    stream: bool
    max_tokens: int | None
    include_usage: bool


@dataclass(frozen=True, slots=True)
class TokenizeBody:
    """A valid ``/tokenize`` body: a ``prompt`` or chat ``messages``, not both."""

    model: str
    prompt: str | None
    messages: list[dict[str, Any]] | None


def check_chat_body(body: Mapping[str, Any]) -> ChatBody:
    """Return what the gateway needs of ``body``, every field checked.

    Raises:
        BodyError: the first field OpenAI would refuse, or the platform cannot
            serve.
    """
    model = _model(body)
    messages = check_messages(body.get("messages"))
    max_tokens = _max_tokens(body)
    for name, (low, high) in NUMBER_RANGES.items():
        value = body.get(name)
        if value is not None and not (_is_number(value) and low <= value <= high):
            raise BodyError(
                f"{name} must be a number between {low:g} and {high:g}", param=name
            )
    _check_stop(body.get("stop"))
    seed = body.get("seed")
    if seed is not None and not (
        _is_int(seed) and INT64_RANGE[0] <= seed <= INT64_RANGE[1]
    ):
        raise BodyError("seed must be a 64-bit integer", param="seed")
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise BodyError(
            "n must be the integer 1: the platform returns one choice per request",
            param="n",
            code=None if _is_int(n) else "invalid_type",
        )
    for name in (*BOOLEAN_FLAGS, "stream"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BodyError(f"{name} must be a boolean", param=name)
    stream = bool(body.get("stream"))
    include_usage = _include_usage(body.get("stream_options"), stream=stream)
    _check_logprobs(body)
    _check_response_format(body.get("response_format"))
    _check_tools(body)
    _check_logit_bias(body.get("logit_bias"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BodyError("user must be a string", param="user")
    return ChatBody(
        model=model,
        messages=messages,
        stream=stream,
        max_tokens=max_tokens,
        include_usage=include_usage,
    )


def check_tokenize_body(body: Mapping[str, Any]) -> TokenizeBody:
    """Return a valid ``/tokenize`` body (vLLM's two forms).

    Raises:
        BodyError: no model, neither or both of ``prompt`` and ``messages``, or a
            field of the wrong type.
    """
    model = _model(body)
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise BodyError(
            "send either prompt (a string) or messages (a chat), not both",
            param="messages" if has_messages else "prompt",
        )
    prompt = body.get("prompt")
    if has_prompt and not isinstance(prompt, str):
        raise BodyError("prompt must be a string", param="prompt")
    messages = check_messages(body["messages"]) if has_messages else None
    for name in TOKENIZE_FLAGS:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BodyError(f"{name} must be a boolean", param=name)
    return TokenizeBody(model=model, prompt=prompt, messages=messages)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Return ``messages`` once every message has a known role and valid content.

    Content is a string or a non-empty list of text parts; only an assistant
    message may go without it.

    Raises:
        BodyError: naming the message, its role or content, or the part.
    """
    if not isinstance(messages, list) or not messages:
        raise BodyError("messages must be a non-empty list", param="messages")
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if not isinstance(message, dict):
            raise BodyError("each message must be an object", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ALLOWED_ROLES:
            raise BodyError(
                f"each message needs a role of {', '.join(sorted(ALLOWED_ROLES))}",
                param=f"{where}.role",
            )
        _check_content(message.get("content"), role=role, where=f"{where}.content")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise BodyError("name must be a string", param=f"{where}.name")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise BodyError(
                "a tool message needs tool_call_id (a string)",
                param=f"{where}.tool_call_id",
            )
    return messages


# -- one field at a time ------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise BodyError("model is required", param="model")
    if not isinstance(model, str):
        raise BodyError("model must be a string", param="model")
    if not model:
        raise BodyError("model must not be empty", param="model")
    return model


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    """Return ``max_completion_tokens``, else ``max_tokens``; both are checked (a
    bad ``max_tokens`` beside a good ``max_completion_tokens`` is still a 400)."""
    for param in ("max_tokens", "max_completion_tokens"):
        value = body.get(param)
        if value is not None and not (_is_int(value) and value >= 1):
            raise BodyError(f"{param} must be a positive integer", param=param)
    value = body.get("max_completion_tokens")
    return value if value is not None else body.get("max_tokens")


def _check_content(content: Any, *, role: str, where: str) -> None:
    if content is None:
        if role != "assistant":
            raise BodyError(f"content is required in a {role} message", param=where)
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise BodyError(
            "content must be a string or a non-empty list of parts", param=where
        )
    for index, part in enumerate(content):
        at = f"{where}.{index}"
        if not isinstance(part, dict):
            raise BodyError("each content part must be an object", param=at)
        kind = part.get("type")
        if kind == "text" or (kind == "refusal" and role == "assistant"):
            if not isinstance(part.get(kind), str):
                raise BodyError(f"a {kind} part needs {kind} (a string)", param=at)
        elif isinstance(kind, str) and kind in MEDIA_PARTS:
            raise BodyError(
                "only text content is supported: the models here are text-only",
                param=f"{at}.type",
                code="unsupported_value",
            )
        else:
            raise BodyError(
                "a content part's type must be text"
                + (" or refusal" if role == "assistant" else ""),
                param=f"{at}.type",
            )


def _check_stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not (
        isinstance(stop, list)
        and len(stop) <= MAX_STOP
        and all(isinstance(s, str) for s in stop)
    ):
        raise BodyError(
            f"stop must be a string or a list of up to {MAX_STOP} strings",
            param="stop",
        )


def _include_usage(options: Any, *, stream: bool) -> bool:
    if options is None:
        return True
    if not isinstance(options, dict):
        raise BodyError("stream_options must be an object", param="stream_options")
    if not stream:
        raise BodyError(
            "stream_options is only allowed when stream is true",
            param="stream_options",
        )
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise BodyError(
            "include_usage must be a boolean", param="stream_options.include_usage"
        )
    return include is not False


def _check_logprobs(body: Mapping[str, Any]) -> None:
    top = body.get("top_logprobs")
    if top is None:
        return
    if not (_is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
        raise BodyError(
            f"top_logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}",
            param="top_logprobs",
        )
    if body.get("logprobs") is not True:
        raise BodyError("top_logprobs needs logprobs set to true", param="top_logprobs")


def _check_response_format(response_format: Any) -> None:
    if response_format is None:
        return
    param = "response_format"
    if not isinstance(response_format, dict):
        raise BodyError("response_format must be an object", param=param)
    kind = response_format.get("type")
    if not isinstance(kind, str) or kind not in RESPONSE_FORMATS:
        raise BodyError(
            "response_format.type must be one of "
            + ", ".join(sorted(RESPONSE_FORMATS)),
            param=f"{param}.type",
        )
    if kind != "json_schema":
        return
    schema = response_format.get("json_schema")
    if not isinstance(schema, dict):
        raise BodyError(
            "a json_schema response format needs json_schema (an object)",
            param=f"{param}.json_schema",
        )
    _check_name(schema.get("name"), param=f"{param}.json_schema.name")
    for name, kinds in (("schema", dict), ("strict", bool), ("description", str)):
        value = schema.get(name)
        if value is not None and not isinstance(value, kinds):
            raise BodyError(
                f"json_schema.{name} must be {_KIND_NAMES[kinds]}",
                param=f"{param}.json_schema.{name}",
            )


def _check_name(name: Any, *, param: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BodyError(
            "a name must be 1 to 64 letters, digits, underscores or dashes",
            param=param,
        )


def _check_tools(body: Mapping[str, Any]) -> None:
    """Check the tool fields' shape as OpenAI does, then refuse tools clearly."""
    for tools_name, choice_name, check in (
        ("tools", "tool_choice", _check_tool),
        ("functions", "function_call", _check_function),
    ):
        tools = body.get(tools_name)
        if tools is not None:
            if not isinstance(tools, list) or not tools:
                raise BodyError(
                    f"{tools_name} must be a non-empty list", param=tools_name
                )
            for index, tool in enumerate(tools):
                check(tool, f"{tools_name}.{index}")
            raise BodyError(
                f"{tools_name} are not supported: the platform's replicas run no "
                "tool-call parser",
                param=tools_name,
                code=_UNSUPPORTED,
            )
        choice = body.get(choice_name)
        if choice is not None:
            _check_tool_choice(choice, choice_name)
            raise BodyError(
                f"{choice_name} is only allowed when {tools_name} are specified",
                param=choice_name,
            )
    if body.get("parallel_tool_calls") is not None:
        raise BodyError(
            "parallel_tool_calls is only allowed when tools are specified",
            param="parallel_tool_calls",
        )


def _check_tool(tool: Any, param: str) -> None:
    if not isinstance(tool, dict):
        raise BodyError("each tool must be an object", param=param)
    if tool.get("type") != "function":
        raise BodyError("a tool's type must be function", param=f"{param}.type")
    _check_function(tool.get("function"), f"{param}.function")


def _check_function(function: Any, param: str) -> None:
    if not isinstance(function, dict):
        raise BodyError("a function must be an object", param=param)
    _check_name(function.get("name"), param=f"{param}.name")
    for name, kinds in (("parameters", dict), ("strict", bool), ("description", str)):
        value = function.get(name)
        if value is not None and not isinstance(value, kinds):
            raise BodyError(
                f"a function's {name} must be {_KIND_NAMES[kinds]}",
                param=f"{param}.{name}",
            )


def _check_tool_choice(choice: Any, param: str) -> None:
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise BodyError(
                f"{param} must be one of {', '.join(sorted(TOOL_CHOICES))} or an "
                "object naming a function",
                param=param,
            )
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    if param == "function_call" and isinstance(choice, dict):
        function = choice  # the legacy form: {"name": ...}
    elif not isinstance(choice, dict) or choice.get("type") != "function":
        raise BodyError(
            f"{param} must be a string or an object of type function", param=param
        )
    if not isinstance(function, dict):
        raise BodyError(f"{param} must name a function", param=param)
    _check_name(function.get("name"), param=f"{param}.name")


def _check_logit_bias(bias: Any) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise BodyError("logit_bias must be an object", param="logit_bias")
    for token, value in bias.items():
        if not (
            token.isascii()
            and token.isdigit()
            and _is_number(value)
            and LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]
        ):
            raise BodyError(
                "logit_bias maps token ids (digits) to numbers between -100 and 100",
                param="logit_bias",
            )

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

- ``n`` above ``MAX_N`` (each choice is charged ``max_tokens`` up front);
- ``functions`` and ``function_call``, which OpenAI deprecated for ``tools`` and
  ``tool_choice`` (vLLM has no parser for them either);
- content parts other than ``text`` (and ``refusal``, in an assistant message):
  the models are text-only.

Tools are checked as OpenAI checks them: at most ``MAX_TOOLS`` functions with
distinct names, each ``parameters`` a JSON Schema of an object (checked against
the metaschema, as is a ``json_schema`` response format's ``schema``);
``tool_choice`` and ``parallel_tool_calls`` only beside ``tools``, a named choice
naming one of them; an assistant message's ``tool_calls`` are functions with an
id, a name and their arguments as a string. Whether the version can parse tool
calls is the plan's question (``routing.plan``): the body does not know the version.

Messages never quote the client's values: they may be prompt text.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.exceptions

from config.json_body import BodyError

__all__ = [
    "ALLOWED_ROLES",
    "BOOLEAN_FLAGS",
    "INT64_RANGE",
    "LOGIT_BIAS_RANGE",
    "MAX_N",
    "MAX_STOP",
    "MAX_TOOLS",
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
    "check_json_schema",
    "check_messages",
    "check_model",
    "check_n",
    "check_sampling",
    "check_stream",
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
# Choices per request: each is charged max_tokens up front, so a cap keeps one
# request from claiming a pool's whole budget (OpenAI allows 128).
MAX_N = 8
MAX_TOOLS = 128  # OpenAI's cap
_UNSUPPORTED = "unsupported_parameter"
BOOLEAN_FLAGS = ("logprobs", "parallel_tool_calls")
# Refused whatever their value (null aside): deprecated by OpenAI for tools.
UNSUPPORTED_FIELDS = ("functions", "function_call")
_METASCHEMA = jsonschema.Draft202012Validator(
    jsonschema.Draft202012Validator.META_SCHEMA
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
    n: int = 1
    # The tool definitions (``[{"type": "function", "function": {...}}]``), None
    # without tools: they are part of the prompt the engine renders.
    tools: list[dict[str, Any]] | None = None


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
    model = check_model(body)
    messages = check_messages(body.get("messages"))
    max_tokens = _max_tokens(body)
    check_sampling(body)
    n = check_n(body)
    for name in BOOLEAN_FLAGS:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BodyError(f"{name} must be a boolean", param=name)
    stream, include_usage = check_stream(body)
    _check_logprobs(body)
    _check_response_format(body.get("response_format"))
    tools = _check_tools(body)
    return ChatBody(
        model=model,
        messages=messages,
        stream=stream,
        max_tokens=max_tokens,
        include_usage=include_usage,
        n=n,
        tools=tools,
    )


def check_sampling(body: Mapping[str, Any]) -> None:
    """Check the fields chat and completions share: the sampling numbers,
    ``stop``, ``seed``, ``logit_bias`` and ``user``.

    Raises:
        BodyError: naming the first bad field.
    """
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
    _check_logit_bias(body.get("logit_bias"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BodyError("user must be a string", param="user")


def check_n(body: Mapping[str, Any]) -> int:
    """Return ``n`` (1 when absent), an integer from 1 to ``MAX_N``.

    Raises:
        BodyError: anything else.
    """
    n = body.get("n")
    if n is None:
        return 1
    if not (_is_int(n) and 1 <= n <= MAX_N):
        raise BodyError(
            f"n must be an integer from 1 to {MAX_N} (each choice is charged "
            "max_tokens up front)",
            param="n",
            code=None if _is_int(n) else "invalid_type",
        )
    return int(n)


def check_stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """Return ``stream`` and whether the stream ends with usage
    (``stream_options.include_usage``, true when absent).

    Raises:
        BodyError: ``stream`` not a boolean, ``stream_options`` malformed or sent
            without a stream.
    """
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BodyError("stream must be a boolean", param="stream")
    return bool(stream), _include_usage(body.get("stream_options"), stream=bool(stream))


def check_tokenize_body(body: Mapping[str, Any]) -> TokenizeBody:
    """Return a valid ``/tokenize`` body (vLLM's two forms).

    Raises:
        BodyError: no model, neither or both of ``prompt`` and ``messages``, or a
            field of the wrong type.
    """
    model = check_model(body)
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
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise BodyError(
                    "only an assistant message may carry tool_calls",
                    param=f"{where}.tool_calls",
                )
            _check_tool_calls(calls, f"{where}.tool_calls")
    return messages


def check_json_schema(schema: Any, *, param: str, of_object: bool = False) -> None:
    """Check that ``schema`` is a JSON Schema (Draft 2020-12's metaschema), and
    with ``of_object`` one whose instances are objects (OpenAI asks that of a
    function's parameters).

    Raises:
        BodyError: naming ``param``; the message quotes the metaschema's rule,
            never the client's values.
    """
    if not isinstance(schema, dict):
        raise BodyError("a schema must be an object", param=param)
    if of_object and schema.get("type", "object") != "object":
        raise BodyError(
            'a function\'s parameters must be a JSON Schema of "type": "object"',
            param=param,
        )
    problem = _schema_problem(json.dumps(schema, sort_keys=True))
    if problem is not None:
        raise BodyError(f"not a valid JSON Schema: {problem}", param=param)


@functools.lru_cache(maxsize=1024)
def _schema_problem(schema_json: str) -> str | None:
    """Return why a schema breaks the metaschema (its rule and where), else None.

    Cached by the schema's text: clients send the same tools with every turn."""
    schema = json.loads(schema_json)
    error = jsonschema.exceptions.best_match(_METASCHEMA.iter_errors(schema))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the root"
    return f"at {where}, the rule {error.validator!r} fails"


# -- one field at a time ------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_model(body: Mapping[str, Any]) -> str:
    """Return the body's ``model``: a non-empty string.

    Raises:
        BodyError: absent, not a string, or empty.
    """
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
    if schema.get("schema") is not None:
        check_json_schema(schema["schema"], param=f"{param}.json_schema.schema")


def _check_name(name: Any, *, param: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BodyError(
            "a name must be 1 to 64 letters, digits, underscores or dashes",
            param=param,
        )


def _check_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Check the tool fields as OpenAI does; return the tools (None: none)."""
    _refuse_functions(body)
    tools = body.get("tools")
    choice = body.get("tool_choice")
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
    names: set[str] = set()
    for index, tool in enumerate(tools):
        _check_tool(tool, f"tools.{index}")
        name = tool["function"]["name"]
        if name in names:
            raise BodyError(
                "tool names must be unique", param=f"tools.{index}.function.name"
            )
        names.add(name)
    if choice is not None:
        _check_tool_choice(choice, "tool_choice")
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise BodyError(
                "tool_choice names a function that is not in tools",
                param="tool_choice.function.name",
            )
    return tools


def _refuse_functions(body: Mapping[str, Any]) -> None:
    """Check the deprecated ``functions`` and ``function_call`` for shape, then
    refuse them clearly."""
    functions = body.get("functions")
    if functions is not None:
        if not isinstance(functions, list) or not functions:
            raise BodyError("functions must be a non-empty list", param="functions")
        for index, function in enumerate(functions):
            _check_function(function, f"functions.{index}")
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) is not None:
            if name == "function_call":
                _check_tool_choice(body[name], name)
            raise BodyError(
                f"{name} is deprecated and not served here: send tools and "
                "tool_choice instead",
                param=name,
                code=_UNSUPPORTED,
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
    if function.get("parameters") is not None:
        check_json_schema(
            function["parameters"], param=f"{param}.parameters", of_object=True
        )


def _check_tool_calls(calls: Any, param: str) -> None:
    """An assistant message's ``tool_calls``: functions with an id, a name and
    their arguments (a string, as the model wrote them)."""
    if not isinstance(calls, list):
        raise BodyError("tool_calls must be a list", param=param)
    for index, call in enumerate(calls):
        at = f"{param}.{index}"
        if not isinstance(call, dict):
            raise BodyError("each tool call must be an object", param=at)
        if not isinstance(call.get("id"), str):
            raise BodyError("a tool call needs id (a string)", param=f"{at}.id")
        if call.get("type") != "function":
            raise BodyError("a tool call's type must be function", param=f"{at}.type")
        function = call.get("function")
        if not isinstance(function, dict):
            raise BodyError(
                "a tool call needs function (an object)", param=f"{at}.function"
            )
        if not isinstance(function.get("name"), str):
            raise BodyError(
                "a tool call's function needs name (a string)",
                param=f"{at}.function.name",
            )
        if not isinstance(function.get("arguments"), str):
            raise BodyError(
                "a tool call's function needs arguments (a JSON string)",
                param=f"{at}.function.arguments",
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

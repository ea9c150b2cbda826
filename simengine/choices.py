"""What each choice of a request says when it asks for tools or structured output.

Public surface: ``RequestError``, ``ToolCallSpan``, ``ChoiceOutput``,
``check_tool_choice``, ``check_n``, ``choose_tools``, ``plan_tool_calls``,
``plan_json``, ``plan_text``, ``output_schema``, ``MAX_N``.

The checks copy vLLM 0.32's messages (``chat_completion/protocol.py``
``check_tool_usage``, ``renderers/online_renderer.py``). Which tool a choice
calls is decided from the prompt, deterministically:

- ``tool_choice`` ``"none"`` (or no tools): text;
- a named function: that function;
- ``"required"``: the tools the last user message names, else the first tool;
- ``"auto"`` (needs ``--enable-auto-tool-choice``): the tools whose name appears
  in the last user message (as a word, any case); none named means text.

With ``parallel_tool_calls`` false only the first of several is called. The
arguments are ``make_instance`` of the function's ``parameters``; a choice's
pieces are the arguments' tokens (``tokens.split_pieces``), calls one after
another, so ``completion_tokens`` counts them and ``max_tokens`` cuts them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simengine.domain import tokens
from simengine.domain.json_instance import make_instance

__all__ = [
    "MAX_N",
    "ChoiceOutput",
    "RequestError",
    "ToolCallSpan",
    "check_n",
    "check_tool_choice",
    "choose_tools",
    "output_schema",
    "plan_json",
    "plan_text",
    "plan_tool_calls",
]

# vLLM's VLLM_MAX_N_SEQUENCES default is larger; the platform's replicas allow 8.
MAX_N = 8


class RequestError(Exception):
    """A request vLLM refuses with a 400: its message and parameter."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolCallSpan:
    """One tool call of a choice: its id, function and pieces ``start:stop``."""

    call_id: str
    name: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """One choice's pieces, why the engine stops (``stop``/``length``) and, for a
    tool-calling choice, where each call's arguments lie among the pieces."""

    pieces: list[str]
    finish_reason: str
    tool_calls: tuple[ToolCallSpan, ...] = ()
    # The client's finish reason for a finished call: "tool_calls" ("auto",
    # "required") or "stop" (a named function), as vLLM reports them.
    tool_finish_reason: str = "tool_calls"

    def reported_finish(self) -> str:
        """Return the finish reason the client sees."""
        if self.tool_calls and self.finish_reason == "stop":
            return self.tool_finish_reason
        return self.finish_reason


_CORRECT_USAGE = (
    'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
)


def check_n(n: Any) -> int:
    """Return ``n`` (default 1), or raise ``RequestError`` as vLLM does."""
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RequestError(f"n must be at least 1, got {n}.", "n")
    if n > MAX_N:
        raise RequestError(
            f"n must be at most {MAX_N}, got {n}. "
            "Set VLLM_MAX_N_SEQUENCES to increase this limit.",
            "n",
        )
    return n


def check_tool_choice(
    body: Mapping[str, Any], *, auto_enabled: bool, has_parser: bool
) -> Any:
    """Return the request's effective ``tool_choice`` or raise ``RequestError``.

    No ``tool_choice`` with tools means ``"auto"``, as in vLLM.
    """
    tools = body.get("tools")
    if tools == []:
        raise RequestError(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else None
    if choice is None or choice == "none":
        return choice
    if tools is None:
        raise RequestError(
            "When using `tool_choice`, `tools` must be set.", "tool_choice"
        )
    if choice not in ("auto", "required") and not isinstance(choice, Mapping):
        raise RequestError(
            f"Invalid value for `tool_choice`: {choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    if isinstance(choice, Mapping):
        _check_named_choice(choice, tools)
    if not has_parser:
        _check_parser(choice, auto_enabled=auto_enabled)
    return choice


def _check_named_choice(choice: Mapping[str, Any], tools: Any) -> None:
    function = choice.get("function")
    if not isinstance(function, Mapping):
        raise RequestError(
            f"Invalid value for `function`: `{function}` in `tool_choice`! "
            f"{_CORRECT_USAGE}",
            "tool_choice.function",
        )
    if "name" not in function:
        raise RequestError(
            f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}",
            "tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise RequestError(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
            f"{_CORRECT_USAGE}",
            "tool_choice.function.name",
        )
    if not any(_function(tool).get("name") == name for tool in tools):
        raise RequestError(
            "The tool specified in `tool_choice` does not match any of the "
            "specified `tools`",
            "tool_choice",
        )


def _check_parser(choice: Any, *, auto_enabled: bool) -> None:
    # vLLM without a tool parser: "auto" needs the flag, the others the parser.
    if choice == "auto" and not auto_enabled:
        raise RequestError(
            '"auto" tool choice requires '
            "--enable-auto-tool-choice and --tool-call-parser to be set"
        )
    if choice != "auto":
        described = (
            f'function "{choice["function"]["name"]}"'
            if isinstance(choice, Mapping)
            else f'"{choice}"'
        )
        raise RequestError(
            f"tool_choice={described} requires --tool-call-parser to be set"
        )


def _function(tool: Any) -> Mapping[str, Any]:
    if isinstance(tool, Mapping):
        function = tool.get("function")
        if isinstance(function, Mapping):
            return function
    return {}


def _last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return tokens.message_text(message.get("content"))
    return ""


def choose_tools(
    tools: Sequence[Any],
    tool_choice: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    parallel: bool,
) -> list[Mapping[str, Any]]:
    """Return the functions a choice calls (empty: it answers in text)."""
    functions = [_function(tool) for tool in tools or ()]
    if not functions or tool_choice in (None, "none"):
        return []
    if isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        return [f for f in functions if f.get("name") == name][:1]
    text = _last_user_text(messages).lower()
    named = [
        f
        for f in functions
        if isinstance(f.get("name"), str)
        and re.search(rf"(?<!\w){re.escape(f['name'].lower())}(?!\w)", text)
    ]
    if not named and tool_choice == "required":
        named = functions[:1]
    return named[:1] if not parallel else named


def _cut(pieces: list[str], max_tokens: int) -> tuple[list[str], str]:
    if len(pieces) > max_tokens:
        return pieces[:max_tokens], "length"
    return pieces, "stop"


def plan_tool_calls(
    functions: Sequence[Mapping[str, Any]],
    *,
    seed: int,
    max_tokens: int,
    call_ids: Sequence[str],
    is_named: bool,
) -> ChoiceOutput:
    """Return a choice that calls ``functions`` with schema-valid arguments."""
    pieces: list[str] = []
    spans: list[ToolCallSpan] = []
    for index, function in enumerate(functions):
        arguments = json.dumps(
            make_instance(function.get("parameters") or {}, seed + index),
            ensure_ascii=False,
        )
        start = len(pieces)
        pieces += tokens.split_pieces(arguments)
        spans.append(
            ToolCallSpan(call_ids[index], str(function.get("name")), start, len(pieces))
        )
    kept, reason = _cut(pieces, max_tokens)
    spans = [
        ToolCallSpan(s.call_id, s.name, s.start, min(s.stop, len(kept)))
        for s in spans
        if s.start < len(kept)
    ]
    return ChoiceOutput(
        kept,
        reason,
        tuple(spans),
        tool_finish_reason="stop" if is_named else "tool_calls",
    )


def output_schema(response_format: Any) -> Mapping[str, Any] | None:
    """Return the JSON Schema a ``response_format`` asks for (``{}`` for
    ``json_object``), or None for text; raise ``RequestError`` on a bad one."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise RequestError("response_format must be an object", "response_format")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise RequestError(
                "json_schema must be provided when response_format type is json_schema",
                "response_format",
            )
        schema = spec.get("schema", spec.get("json_schema"))
        return schema if isinstance(schema, Mapping) else {"type": "object"}
    raise RequestError(f"Unsupported response_format type: {kind}", "response_format")


def plan_json(schema: Mapping[str, Any], *, seed: int, max_tokens: int) -> ChoiceOutput:
    """Return a choice whose text is a JSON value valid against ``schema``
    (cut, and invalid, past ``max_tokens``: ``length``)."""
    text = json.dumps(make_instance(schema, seed), ensure_ascii=False)
    pieces, reason = _cut(tokens.split_pieces(text), max_tokens)
    return ChoiceOutput(pieces, reason)


def plan_text(pieces: list[str], finish_reason: str) -> ChoiceOutput:
    """Return a plain text choice."""
    return ChoiceOutput(pieces, finish_reason)

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
    """One tool call of a choice: its id, function, the pieces ``start:stop`` of
    its arguments as generated and the arguments a plain answer reports."""

    call_id: str
    name: str
    start: int
    stop: int
    arguments: str


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """One choice: its pieces (every generated token's text, the end-of-sequence
    token's ``""`` last when it stopped by itself), why the engine stops
    (``stop``/``length``), and for tool calls how they were asked for
    (``tool_mode``: ``named``, ``required`` or ``auto``) and where they lie."""

    pieces: list[str]
    finish_reason: str
    tool_calls: tuple[ToolCallSpan, ...] = ()
    tool_mode: str | None = None
    has_eos: bool = False

    @property
    def is_complete(self) -> bool:
        """Whether the whole planned output was generated (not cut)."""
        return self.finish_reason == "stop"

    def reported_finish(self) -> str:
        """Return the finish reason the client sees: vLLM reports "tool_calls"
        for "auto" and "required" calls and "stop" for a named function."""
        if self.tool_calls and self.is_complete and self.tool_mode != "named":
            return "tool_calls"
        return self.finish_reason

    def reported_calls(self) -> tuple[ToolCallSpan, ...]:
        """Return the calls a plain answer lists: a cut "required" array or
        "auto" call does not parse, so vLLM lists none; a named one keeps its
        raw (cut) arguments."""
        if self.tool_mode == "named" or self.is_complete:
            return self.tool_calls
        return ()

    def text(self) -> str:
        """Return the generated text."""
        return "".join(self.pieces)


_CORRECT_USAGE = (
    'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
)


def check_n(n: Any, temperature: Any = None) -> int:
    """Return ``n`` (default 1), or raise ``RequestError`` as vLLM does (several
    choices need sampling: not at temperature 0)."""
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
    if n > 1 and temperature == 0:
        raise RequestError(f"n must be 1 when using greedy sampling, got {n}.")
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


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def plan_tool_calls(
    functions: Sequence[Mapping[str, Any]],
    *,
    seed: int,
    max_tokens: int,
    call_ids: Sequence[str],
    mode: str,
) -> ChoiceOutput:
    """Return a choice that calls ``functions`` with schema-valid arguments.

    The generated text is what vLLM's model writes for ``mode``: ``named``, the
    arguments as compact JSON (guided decoding); ``required``, the compact
    array ``[{"name":...,"parameters":{...}}]``; ``auto``, hermes's
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. A plain
    answer reports ``required`` and ``auto`` arguments re-serialized by vLLM
    (``json.dumps``: with spaces), named ones as generated.
    """
    segments: list[tuple[str, int]] = []  # (text, index of the call or -1)
    values = [
        make_instance(function.get("parameters") or {}, seed + index)
        for index, function in enumerate(functions)
    ]
    names = [str(function.get("name")) for function in functions]
    if mode == "named":
        segments.append((_compact(values[0]), 0))
    elif mode == "required":
        segments.append(("[", -1))
        for index, value in enumerate(values):
            opening = "," if index else ""
            segments.append((f'{opening}{{"name":{_compact(names[index])},', -1))
            segments.append(('"parameters":', -1))
            segments.append((_compact(value), index))
            segments.append(("}", -1))
        segments.append(("]", -1))
    else:
        for index, value in enumerate(values):
            opening = "\n" if index else ""
            segments.append(
                (f'{opening}<tool_call>\n{{"name": {json.dumps(names[index])}, ', -1)
            )
            segments.append(('"arguments": ', -1))
            segments.append((json.dumps(value, ensure_ascii=False), index))
            segments.append(("}\n</tool_call>", -1))
    pieces: list[str] = []
    bounds = [(0, 0)] * len(functions)
    for text, owner in segments:
        start = len(pieces)
        pieces += tokens.split_pieces(text)
        if owner >= 0:
            bounds[owner] = (start, len(pieces))
    kept, reason, has_eos = _cut_with_eos(pieces, max_tokens)
    spans = tuple(
        ToolCallSpan(
            call_ids[index],
            names[index],
            start,
            min(stop, len(kept)),
            "".join(kept[start:stop])
            if mode == "named"
            else json.dumps(values[index], ensure_ascii=False),
        )
        for index, (start, stop) in enumerate(bounds)
        if start < len(kept)
    )
    return ChoiceOutput(kept, reason, spans, tool_mode=mode, has_eos=has_eos)


def _cut_with_eos(pieces: list[str], max_tokens: int) -> tuple[list[str], str, bool]:
    """Return the pieces a ``max_tokens`` budget lets out, why they end, and
    whether the end-of-sequence token (text ``""``, one token) closes them."""
    if len(pieces) + 1 > max_tokens:
        return pieces[:max_tokens], "length", False
    return [*pieces, ""], "stop", True


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
    """Return a choice whose text is a compact JSON value valid against
    ``schema`` (cut, and invalid, past ``max_tokens``: ``length``)."""
    pieces = tokens.split_pieces(_compact(make_instance(schema, seed)))
    kept, reason, has_eos = _cut_with_eos(pieces, max_tokens)
    return ChoiceOutput(kept, reason, has_eos=has_eos)


def plan_text(pieces: list[str], finish_reason: str) -> ChoiceOutput:
    """Return a plain text choice."""
    return ChoiceOutput(pieces, finish_reason)

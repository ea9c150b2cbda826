"""How a choice is planned: vLLM's tool_choice checks, the tool decision rule and
the generated text of tool calls and JSON answers."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from simengine.choices import (
    RequestError,
    check_n,
    check_tool_choice,
    choose_tools,
    plan_json,
    plan_tool_calls,
)
from simengine.domain import tokens

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]


def test_check_tool_choice_defaults_to_auto_with_tools() -> None:
    body = {"tools": TOOLS}
    assert check_tool_choice(body, auto_enabled=True, has_parser=True) == "auto"
    assert check_tool_choice({}, auto_enabled=False, has_parser=False) is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": []}, "`tools` must not be an empty array."),
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
        (
            {"tools": TOOLS, "tool_choice": "any"},
            "Invalid value for `tool_choice`: any!",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "Expected field `name` in `function` in `tool_choice`!",
        ),
        (
            {"tools": TOOLS},
            '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required"},
            'tool_choice="required" requires --tool-call-parser to be set',
        ),
    ],
)
def test_check_tool_choice_refuses_with_vllms_messages(
    body: dict[str, Any], message: str
) -> None:
    with pytest.raises(RequestError) as raised:
        check_tool_choice(body, auto_enabled=False, has_parser=False)
    assert raised.value.message.startswith(message)


def test_check_n_refuses_greedy_and_too_many() -> None:
    assert check_n(None) == 1
    assert check_n(3, 1.0) == 3
    with pytest.raises(RequestError, match="greedy sampling, got 3"):
        check_n(3, 0)
    with pytest.raises(RequestError, match="at most 8"):
        check_n(9)


def test_choose_tools_calls_what_the_last_user_message_names() -> None:
    messages = [
        {"role": "user", "content": "use get_time"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "now GET_WEATHER and get_time please"},
    ]
    chosen = choose_tools(TOOLS, "auto", messages, parallel=True)
    assert [f["name"] for f in chosen] == ["get_weather", "get_time"]
    assert len(choose_tools(TOOLS, "auto", messages, parallel=False)) == 1
    assert (
        choose_tools(TOOLS, "auto", [{"role": "user", "content": "hi"}], parallel=True)
        == []
    )
    assert choose_tools(TOOLS, "none", messages, parallel=True) == []
    required = choose_tools(
        TOOLS, "required", [{"role": "user", "content": "hi"}], parallel=True
    )
    assert [f["name"] for f in required] == ["get_weather"]
    # A name inside a longer word is not a mention.
    assert (
        choose_tools(
            TOOLS, "auto", [{"role": "user", "content": "get_timex"}], parallel=True
        )
        == []
    )


@pytest.mark.parametrize("mode", ["named", "required", "auto"])
def test_plan_tool_calls_writes_valid_arguments_and_ends_with_eos(mode: str) -> None:
    functions = [TOOLS[0]["function"]]
    output = plan_tool_calls(
        functions, seed=5, max_tokens=200, call_ids=["chatcmpl-tool-1"], mode=mode
    )
    assert output.has_eos and output.pieces[-1] == ""
    span = output.tool_calls[0]
    generated = "".join(output.pieces[span.start : span.stop])
    jsonschema.validate(json.loads(generated), PARAMETERS)
    jsonschema.validate(json.loads(span.arguments), PARAMETERS)
    assert output.reported_finish() == ("stop" if mode == "named" else "tool_calls")
    if mode == "required":
        text = output.text()
        assert json.loads(text)[0]["name"] == "get_weather"


def test_plan_tool_calls_cut_by_max_tokens_reports_length() -> None:
    output = plan_tool_calls(
        [TOOLS[0]["function"]],
        seed=5,
        max_tokens=4,
        call_ids=["chatcmpl-tool-1"],
        mode="required",
    )
    assert output.finish_reason == "length" and len(output.pieces) == 4
    assert output.reported_calls() == ()


def test_plan_json_counts_its_tokens_plus_the_end_token() -> None:
    output = plan_json(PARAMETERS, seed=1, max_tokens=100)
    text = output.text()
    jsonschema.validate(json.loads(text), PARAMETERS)
    assert len(output.pieces) == len(tokens.encode(text)) + 1

"""Responses bodies checked as OpenAI checks them, every 400 naming its param."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config.json_body import BodyError
from routing.domain.responses_body import (
    ACCEPTED_FIELDS,
    MAX_METADATA_PAIRS,
    check_responses_body,
)

OBJECT_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"type": "function", "name": "weather", "parameters": OBJECT_SCHEMA}


def request(**fields: Any) -> dict[str, Any]:
    return {"model": "chat-7b", "input": "Hello", **fields}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": "x"}, "model", None),
        (request(input=None), "input", None),
        (request(input=[]), "input", None),
        (request(input=7), "input", None),
        (request(input=["hi"]), "input.0", None),
        (request(input=[{"role": "tool", "content": "x"}]), "input.0.role", None),
        (request(input=[{"role": "user"}]), "input.0.content", None),
        (request(input=[{"role": "user", "content": []}]), "input.0.content", None),
        (
            request(input=[{"role": "user", "content": [{"type": "output_text"}]}]),
            "input.0.content.0.type",
            None,
        ),
        (
            request(input=[{"role": "assistant", "content": [{"type": "input_text"}]}]),
            "input.0.content.0.type",
            None,
        ),
        (
            request(input=[{"role": "user", "content": [{"type": "input_text"}]}]),
            "input.0.content.0.text",
            None,
        ),
        (
            request(
                input=[
                    {"role": "user", "content": [{"type": "input_image", "url": "x"}]}
                ]
            ),
            "input.0.content.0.type",
            "unsupported_value",
        ),
        (
            request(input=[{"role": "user", "content": ["hi"]}]),
            "input.0.content.0",
            None,
        ),
        (
            request(input=[{"type": "item_reference", "id": "msg_1"}]),
            "input.0.type",
            "unsupported_value",
        ),
        (
            request(input=[{"type": "function_call", "call_id": "c", "name": "f"}]),
            "input.0.arguments",
            None,
        ),
        (
            request(input=[{"type": "function_call_output", "output": "x"}]),
            "input.0.call_id",
            None,
        ),
        (request(instructions=5), "instructions", None),
        (request(max_output_tokens=0), "max_output_tokens", None),
        (request(max_output_tokens=True), "max_output_tokens", None),
        (request(temperature=2.5), "temperature", None),
        (request(top_p=-0.1), "top_p", None),
        (request(stream="yes"), "stream", None),
        (request(user=1), "user", None),
        (request(metadata=[]), "metadata", None),
        (request(metadata={"k": 1}), "metadata", None),
        (
            request(metadata={str(i): "v" for i in range(MAX_METADATA_PAIRS + 1)}),
            "metadata",
            None,
        ),
        (request(store=True), "store", "unsupported_value"),
        (request(store="no"), "store", None),
        (request(background=True), "background", "unsupported_value"),
        (
            request(previous_response_id="resp_1"),
            "previous_response_id",
            "unsupported_parameter",
        ),
        (request(conversation="conv_1"), "conversation", "unsupported_parameter"),
        (request(include="x"), "include", None),
        (
            request(include=["file_search_call.results"]),
            "include.0",
            "unsupported_value",
        ),
        (request(top_logprobs=21), "top_logprobs", None),
        (request(truncation="auto"), "truncation", "unsupported_value"),
        (request(reasoning={"effort": "low"}), "reasoning", "unknown_parameter"),
        (request(text="json"), "text", None),
        (request(text={"verbosity": "low"}), "text.verbosity", None),
        (request(text={"format": {"type": "yaml"}}), "text.format.type", None),
        (
            request(text={"format": {"type": "json_schema", "schema": {}}}),
            "text.format.name",
            None,
        ),
        (
            request(text={"format": {"type": "json_schema", "name": "a"}}),
            "text.format.schema",
            None,
        ),
        (
            request(
                text={"format": {"type": "json_schema", "name": "a", "schema": []}}
            ),
            "text.format.schema",
            None,
        ),
        (request(tools=[]), "tools", None),
        (request(tools=[{"type": "web_search"}]), "tools.0.type", "unsupported_value"),
        (request(tools=[{"type": "function"}]), "tools.0.name", None),
        (request(tools=[TOOL, TOOL]), "tools.1.name", None),
        (
            request(tools=[{**TOOL, "parameters": {"type": "string"}}]),
            "tools.0.parameters",
            None,
        ),
        (request(tools=[{**TOOL, "strict": "yes"}]), "tools.0.strict", None),
        (request(tool_choice="auto"), "tool_choice", None),
        (request(parallel_tool_calls=True), "parallel_tool_calls", None),
        (request(tools=[TOOL], tool_choice="any"), "tool_choice", None),
        (
            request(tools=[TOOL], tool_choice={"type": "function", "name": "other"}),
            "tool_choice.name",
            None,
        ),
        (request(tools=[TOOL], parallel_tool_calls=1), "parallel_tool_calls", None),
    ],
)
def test_responses_body_refusal_names_param(
    body: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(BodyError) as caught:
        check_responses_body(body)
    assert caught.value.param == param
    assert caught.value.code == code


def test_responses_body_store_refusal_says_nothing_is_stored() -> None:
    with pytest.raises(BodyError, match="never stores prompts or answers"):
        check_responses_body(request(store=True))


def test_responses_body_previous_response_id_asks_for_whole_input() -> None:
    with pytest.raises(BodyError, match="whole conversation in input"):
        check_responses_body(request(previous_response_id="resp_1"))


def test_responses_body_string_input_is_one_user_message() -> None:
    checked = check_responses_body(
        request(instructions="Be brief.", store=False, stream=True)
    )
    assert checked.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]
    assert checked.stream is True
    assert checked.max_output_tokens is None
    assert checked.tools is None


def test_responses_body_items_become_chat_messages() -> None:
    checked = check_responses_body(
        request(
            input=[
                {"role": "developer", "content": "Use tools."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Weather?"}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "weather",
                    "arguments": "{}",
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "weather",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sun"},
                {
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Sunny."}],
                },
            ],
            tools=[{**TOOL, "description": "Look it up", "strict": True}],
            tool_choice={"type": "function", "name": "weather"},
            parallel_tool_calls=False,
            max_output_tokens=64,
            text={
                "format": {
                    "type": "json_schema",
                    "name": "w",
                    "schema": OBJECT_SCHEMA,
                    "strict": True,
                }
            },
            include=["message.output_text.logprobs"],
            top_logprobs=2,
            truncation="disabled",
            metadata={"k": "v"},
        )
    )
    call = {"type": "function", "function": {"name": "weather", "arguments": "{}"}}
    assert checked.messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", **call}, {"id": "c2", **call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
    ]
    assert checked.tools == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": OBJECT_SCHEMA,
                "description": "Look it up",
            },
        }
    ]
    assert checked.max_output_tokens == 64


def test_responses_body_empty_instructions_add_no_system_message() -> None:
    """As vLLM renders them: the count must be the engine's."""
    checked = check_responses_body(request(instructions=""))
    assert checked.messages == [{"role": "user", "content": "Hello"}]


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
NEAR_MISSES = st.sampled_from(
    [
        {"type": "function", "name": "f"},
        {"type": "message", "role": "user", "content": [{"type": []}]},
        [{"type": {}}],
        [{"role": "user", "content": [{"type": ["input_text"]}]}],
        {"format": {"type": "json_schema", "name": "a", "schema": {"type": 3}}},
        {"type": "function", "name": {}},
    ]
)


@settings(derandomize=True, database=None, deadline=None, max_examples=300)
@given(
    st.fixed_dictionaries(
        {"model": st.just("chat-7b"), "input": st.just("hi") | JSON_VALUES},
        optional={
            name: JSON_VALUES | NEAR_MISSES
            for name in sorted(ACCEPTED_FIELDS - {"model", "input"})
        },
    )
)
def test_responses_body_is_checked_or_refused_never_crashes(
    body: dict[str, Any],
) -> None:
    """Whatever JSON a client sends: a checked body, or a BodyError naming a param."""
    try:
        check_responses_body(body)
    except BodyError as exc:
        assert exc.param

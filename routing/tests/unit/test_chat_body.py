"""Chat and tokenize bodies checked as OpenAI checks them, naming the param."""

from __future__ import annotations

from typing import Any

import pytest

from config.json_body import BodyError
from routing.domain.chat_body import (
    ChatBody,
    TokenizeBody,
    check_chat_body,
    check_tokenize_body,
)

USER = {"role": "user", "content": "hi"}
FUNCTION = {"type": "function", "function": {"name": "get_weather"}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "chat-7b", "messages": [USER], **fields}


def message(content: Any, role: str = "user") -> dict[str, Any]:
    return chat(messages=[{"role": role, "content": content}])


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (chat(messages=[{"role": ["user"], "content": "x"}]), "messages.0.role", None),
        (chat(messages=[{"role": {"a": 1}, "content": "x"}]), "messages.0.role", None),
        (chat(messages=[{"role": "robot", "content": "x"}]), "messages.0.role", None),
        (chat(messages=["hi"]), "messages.0", None),
        (chat(messages=[USER, {"role": "user"}]), "messages.1.content", None),
        (message(3), "messages.0.content", None),
        (message([]), "messages.0.content", None),
        (message([1, "x"]), "messages.0.content.0", None),
        (message(["x"]), "messages.0.content.0", None),
        (message([{"text": "x"}]), "messages.0.content.0.type", None),
        (message([{"type": 7, "text": "x"}]), "messages.0.content.0.type", None),
        (message([{"type": "video"}]), "messages.0.content.0.type", None),
        (message([{"type": "text"}]), "messages.0.content.0", None),
        (message([{"type": "text", "text": 5}]), "messages.0.content.0", None),
        (
            message([{"type": "refusal", "refusal": "no"}]),
            "messages.0.content.0.type",
            None,
        ),
        (
            message([{"type": "image_url", "image_url": {"url": "http://x"}}]),
            "messages.0.content.0.type",
            "unsupported_value",
        ),
        (
            chat(messages=[{"role": "tool", "content": "42"}]),
            "messages.0.tool_call_id",
            None,
        ),
        (
            chat(messages=[{"role": "user", "content": "x", "name": 3}]),
            "messages.0.name",
            None,
        ),
        (chat(n=1.0), "n", "invalid_type"),
        (chat(n=True), "n", "invalid_type"),
        (chat(n=9), "n", None),
        (chat(n=0), "n", None),
        (chat(n="1"), "n", "invalid_type"),
        (chat(presence_penalty=5), "presence_penalty", None),
        (chat(presence_penalty="high"), "presence_penalty", None),
        (chat(frequency_penalty=-2.5), "frequency_penalty", None),
        (chat(frequency_penalty=True), "frequency_penalty", None),
        (chat(temperature=2.5), "temperature", None),
        (chat(top_p=-0.1), "top_p", None),
        (chat(logprobs="yes"), "logprobs", None),
        (chat(logprobs=1), "logprobs", None),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", None),
        (chat(logprobs=True, top_logprobs=1.5), "top_logprobs", None),
        (chat(top_logprobs=2), "top_logprobs", None),
        (chat(logprobs=False, top_logprobs=2), "top_logprobs", None),
        (chat(response_format="json"), "response_format", None),
        (chat(response_format={"type": "xml"}), "response_format.type", None),
        (chat(response_format={}), "response_format.type", None),
        (
            chat(response_format={"type": "json_schema"}),
            "response_format.json_schema",
            None,
        ),
        (
            chat(
                response_format={"type": "json_schema", "json_schema": {"name": "a b"}}
            ),
            "response_format.json_schema.name",
            None,
        ),
        (
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": []},
                }
            ),
            "response_format.json_schema.schema",
            None,
        ),
        (chat(tools="nope"), "tools", None),
        (chat(tools=[]), "tools", None),
        (chat(tools=[{"type": "function"}]), "tools.0.function", None),
        (chat(tools=[{"type": "retrieval"}]), "tools.0.type", None),
        (chat(tools=[7]), "tools.0", None),
        (
            chat(tools=[{"type": "function", "function": {"name": "x" * 65}}]),
            "tools.0.function.name",
            None,
        ),
        (
            chat(
                tools=[{"type": "function", "function": {"name": "f", "parameters": 1}}]
            ),
            "tools.0.function.parameters",
            None,
        ),
        (chat(tools=[FUNCTION, FUNCTION]), "tools.1.function.name", None),
        (chat(tools=[FUNCTION] * 129), "tools", None),
        (
            chat(
                tools=[
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            ),
            "tools.0.function.parameters",
            None,
        ),
        (
            chat(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": 3},
                        },
                    }
                ]
            ),
            "tools.0.function.parameters",
            None,
        ),
        (
            chat(
                tools=[FUNCTION],
                tool_choice={"type": "function", "function": {"name": "other"}},
            ),
            "tool_choice.function.name",
            None,
        ),
        (chat(tools=[FUNCTION], tool_choice="maybe"), "tool_choice", None),
        (
            chat(
                messages=[
                    USER,
                    {"role": "assistant", "tool_calls": [{"id": "c", "type": "x"}]},
                ]
            ),
            "messages.1.tool_calls.0.type",
            None,
        ),
        (
            chat(
                messages=[
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": {"a": 1}},
                            }
                        ],
                    },
                ]
            ),
            "messages.1.tool_calls.0.function.arguments",
            None,
        ),
        (
            chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
            "messages.0.tool_calls",
            None,
        ),
        (
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": 5}},
                }
            ),
            "response_format.json_schema.schema",
            None,
        ),
        (chat(tool_choice="maybe"), "tool_choice", None),
        (chat(tool_choice={"type": "function"}), "tool_choice", None),
        (chat(tool_choice="auto"), "tool_choice", None),
        (chat(tool_choice=7), "tool_choice", None),
        (chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
        (chat(function_call="auto"), "function_call", "unsupported_parameter"),
        (chat(function_call="never"), "function_call", None),
        (chat(parallel_tool_calls=True), "parallel_tool_calls", None),
        (chat(parallel_tool_calls="yes"), "parallel_tool_calls", None),
        (chat(stream_options=[]), "stream_options", None),
        (chat(stream_options={"include_usage": True}), "stream_options", None),
        (
            chat(stream=True, stream_options={"include_usage": "no"}),
            "stream_options.include_usage",
            None,
        ),
        (chat(stream="yes"), "stream", None),
        (chat(seed=2**63), "seed", None),
        (chat(seed=1.5), "seed", None),
        (chat(stop=["a"] * 5), "stop", None),
        (chat(stop=[1]), "stop", None),
        (chat(max_tokens=0), "max_tokens", None),
        (chat(max_tokens=True), "max_tokens", None),
        (chat(max_completion_tokens=2.0), "max_completion_tokens", None),
        (chat(max_completion_tokens=2, max_tokens=0), "max_tokens", None),
        (chat(logit_bias={"abc": 1}), "logit_bias", None),
        (chat(logit_bias={"12": 101}), "logit_bias", None),
        (chat(logit_bias=[1]), "logit_bias", None),
        (chat(user=7), "user", None),
        (chat(model=""), "model", None),
        ({"messages": [USER]}, "model", None),
        (chat(messages=[]), "messages", None),
        (chat(messages={"role": "user"}), "messages", None),
    ],
)
def test_invalid_chat_bodies_name_the_param(
    body: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(BodyError) as refused:
        check_chat_body(body)
    assert (refused.value.param, refused.value.code) == (param, code)
    assert refused.value.message


def test_a_refused_value_is_not_quoted_back() -> None:
    secret = "my secret prompt"
    for body in (
        message([{"type": secret}]),
        chat(messages=[{"role": secret, "content": "x"}]),
        chat(tool_choice=secret),
        chat(response_format={"type": secret}),
    ):
        with pytest.raises(BodyError) as refused:
            check_chat_body(body)
        assert secret not in refused.value.message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (chat(), ChatBody("chat-7b", [USER], False, None, True)),
        (
            chat(stream=True, stream_options={"include_usage": False}, max_tokens=5),
            ChatBody("chat-7b", [USER], True, 5, False),
        ),
        (
            chat(stream=True, stream_options={}, max_completion_tokens=7, max_tokens=9),
            ChatBody("chat-7b", [USER], True, 7, True),
        ),
        (
            chat(n=1, stream=None, logprobs=True, top_logprobs=20, seed=-(2**63)),
            ChatBody("chat-7b", [USER], False, None, True),
        ),
        (chat(n=8), ChatBody("chat-7b", [USER], False, None, True, n=8)),
        (
            chat(tools=[FUNCTION], tool_choice="required", parallel_tool_calls=False),
            ChatBody("chat-7b", [USER], False, None, True, tools=[FUNCTION]),
        ),
    ],
)
def test_valid_chat_bodies_give_what_the_gateway_needs(
    body: dict[str, Any], expected: ChatBody
) -> None:
    assert check_chat_body(body) == expected


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": -2, "frequency_penalty": 2.0, "temperature": 0},
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": {"type": "object"}},
            }
        },
        {"logit_bias": {"50256": -100}},
        {"stop": "\n", "user": "u-1", "ignore_eos": True},
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                USER,
                {"role": "assistant", "content": None},
                {
                    "role": "assistant",
                    "content": [{"type": "refusal", "refusal": "no"}],
                },
                {"role": "tool", "content": "42", "tool_call_id": "call-1"},
            ]
        },
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "the weather in a city",
                        "strict": True,
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"],
                            "additionalProperties": False,
                        },
                    },
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call-1",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": '{"city": "Oslo"}',
                            },
                        }
                    ],
                },
                {"role": "tool", "content": "3 C", "tool_call_id": "call-1"},
            ],
        },
    ],
)
def test_valid_fields_pass(fields: dict[str, Any]) -> None:
    check_chat_body(chat(**fields))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": "x", "messages": [USER]}, "messages"),
        ({"model": "m", "prompt": ["x"]}, "prompt"),
        ({"model": "m", "messages": [{"role": ["user"]}]}, "messages.0.role"),
        (
            {"model": "m", "prompt": "x", "add_special_tokens": "yes"},
            "add_special_tokens",
        ),
    ],
)
def test_invalid_tokenize_bodies_name_the_param(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BodyError) as refused:
        check_tokenize_body(body)
    assert refused.value.param == param


def test_tokenize_takes_a_prompt_or_messages() -> None:
    assert check_tokenize_body({"model": "m", "prompt": "x"}) == TokenizeBody(
        "m", "x", None
    )
    assert check_tokenize_body({"model": "m", "messages": [USER]}) == TokenizeBody(
        "m", None, [USER]
    )

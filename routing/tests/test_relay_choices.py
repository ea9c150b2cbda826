"""Whole answers gathered from streamed chunks: several choices, tool calls whose
arguments come in pieces, and completions (``text`` chunks, their log
probabilities), however the network splits the engine's bytes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from routing.relay import GatheredChoice
from routing.responses import FinalUsage, whole_answer, whole_completion
from routing.tests.test_relay import Run, cut


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chunk(choice: dict[str, Any], *, kind: str = "chat.completion.chunk") -> bytes:
    return event(
        {"id": "x-1", "object": kind, "created": 1, "model": "m", "choices": [choice]}
    )


def tail(prompt: int, completion: int, *, kind: str) -> bytes:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return (
        event(
            {
                "id": "x-1",
                "object": kind,
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": usage,
            }
        )
        + b"data: [DONE]\n\n"
    )


def role(index: int) -> bytes:
    return chunk({"index": index, "delta": {"role": "assistant", "content": ""}})


def call_piece(index: int, arguments: str, *, first: bool = False) -> bytes:
    call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
    if first:
        call.update(id=f"chatcmpl-tool-{index}", type="function")
        call["function"]["name"] = "get_weather"
    return chunk({"index": index, "delta": {"tool_calls": [call]}})


# Two choices interleaved as vLLM streams them: choice 0 calls a tool in three
# pieces, choice 1 answers in text.
TOOL_STREAM = b"".join(
    [
        role(0),
        role(1),
        call_piece(0, '{"city": ', first=True),
        chunk({"index": 1, "delta": {"content": "It is"}}),
        call_piece(0, '"Oslo"'),
        chunk({"index": 1, "delta": {"content": " cold."}, "finish_reason": "stop"}),
        call_piece(0, "}"),
        chunk({"index": 0, "delta": {"content": ""}, "finish_reason": "tool_calls"}),
        tail(40, 6, kind="chat.completion.chunk"),
    ]
)


def text_chunk(index: int, text: str, offset: int, reason: str | None = None) -> bytes:
    return chunk(
        {
            "index": index,
            "text": text,
            "logprobs": {
                "tokens": [text],
                "token_logprobs": [-0.5],
                "top_logprobs": [{text: -0.5}],
                "text_offset": [offset],
            },
            "finish_reason": reason,
        },
        kind="text_completion",
    )


COMPLETION_STREAM = b"".join(
    [
        text_chunk(0, " once", 0),
        text_chunk(1, " there", 0),
        text_chunk(0, " upon", 5, "length"),
        text_chunk(1, " was", 6, "length"),
        tail(3, 4, kind="text_completion"),
    ]
)
SIZES = [1, 5, 64, 10_000]


def served(run: Run) -> dict[str, Any]:
    return {
        "answer_id": run.outcome.answer_id,
        "model_ref": "chat-7b",
        "version": "v1",
        "region": "r1",
        "replica_id": "rep-1",
        "outcome": run.outcome,
        "usage": FinalUsage.of(run.outcome, prompt_tokens=1),
    }


@pytest.mark.parametrize("size", SIZES)
def test_a_whole_answer_has_every_choice_and_its_tool_call_in_one_piece(
    size: int,
) -> None:
    run = Run(cut(TOOL_STREAM, size), stream=False)

    assert run.is_done is True
    assert run.outcome.choices == (
        GatheredChoice(
            index=0,
            tool_calls=(
                {
                    "id": "chatcmpl-tool-0",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo"}',
                    },
                },
            ),
            finish_reason="tool_calls",
        ),
        GatheredChoice(index=1, content="It is cold.", finish_reason="stop"),
    )
    answer = json.loads(whole_answer(**served(run)))
    first, second = answer["choices"]
    assert first["message"]["content"] is None
    call = first["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert first["finish_reason"] == "tool_calls"
    assert second["message"] == {"role": "assistant", "content": "It is cold."}
    assert answer["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("size", SIZES)
def test_a_streamed_tool_call_reaches_the_client_unchanged(size: int) -> None:
    run = Run(cut(TOOL_STREAM, size))

    token_events = [e + b"\n\n" for e in TOOL_STREAM.split(b"\n\n")[:8]]
    assert run.body == b"".join(token_events)
    assert run.outcome.events == 8


@pytest.mark.parametrize("size", SIZES)
def test_a_whole_completion_joins_each_choices_text_and_log_probabilities(
    size: int,
) -> None:
    run = Run(cut(COMPLETION_STREAM, size), stream=False)

    answer = json.loads(whole_completion(**served(run)))
    assert answer["object"] == "text_completion"
    assert [c["text"] for c in answer["choices"]] == [" once upon", " there was"]
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "length"]
    assert answer["choices"][1]["logprobs"] == {
        "tokens": [" there", " was"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{" there": -0.5}, {" was": -0.5}],
        "text_offset": [0, 6],
    }
    assert answer["usage"]["prompt_tokens"] == 3


def test_without_the_engines_usage_role_chunks_are_not_counted_as_tokens() -> None:
    broken = TOOL_STREAM[: TOOL_STREAM.index(b'"usage"')]
    run = Run([broken[: broken.rindex(b"data: ")]], stream=False)

    assert run.is_done is False
    # Eight content events, two of them role chunks: six tokens.
    usage = FinalUsage.of(run.outcome, prompt_tokens=40, role_chunks=2)
    assert usage.completion_tokens == 6
    completion = Run([COMPLETION_STREAM[: COMPLETION_STREAM.index(b'"usage"') - 80]])
    counted = FinalUsage.of(completion.outcome, prompt_tokens=3, role_chunks=0)
    assert counted.completion_tokens == completion.outcome.events

"""Real vLLM on tools, structured output, n, completions and responses.

``simengine/tests/data/vllm_surfaces/`` is a capture of real vLLM 0.32.0 (CPU
build, tiny Llama) on the OpenAI surfaces beyond plain chat
(``simengine.surface_capture``); the simulated replica is held to it. This module
starts one real vLLM with the same flags (``SURFACE_ENGINE_CONFIG`` over the
fidelity capture's, ``SURFACE_ENV``), re-captures every case and diffs the
shapes against the committed files, so a vLLM upgrade that changes a surface
fails here. ``UPDATE_VLLM_SURFACES=1`` writes the live capture over the committed
one (review the diff, then commit it). Then the ``openai`` SDK, as clients use
it, against the same server: forced tool calls whose arguments satisfy the
schema, ``chat.completions.parse``, ``n=3``, ``completions`` and a streamed
``responses.create``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionNamedToolChoiceParam,
)

from localrun.vllm_cpu import MODEL, vllm_server
from simengine.conformance import diff_json_shapes
from simengine.surface_capture import (
    SURFACE_ENGINE_CONFIG,
    SURFACE_ENV,
    SURFACES_DIR,
    Answer,
    capture_surfaces,
    read_surfaces,
    surface_shape,
    write_surfaces,
)
from tests.test_vllm_fidelity import CAPTURE_ENGINE_CONFIG

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]

_NAMED: ChatCompletionNamedToolChoiceParam = {
    "type": "function",
    "function": {"name": "get_weather"},
}
_ASK: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris?"}
]


class Weather(pydantic.BaseModel):
    """The capture's weather schema (``WEATHER_SCHEMA``) as a pydantic model:
    validating against it is validating against the schema."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome"]
    days: int = pydantic.Field(ge=1, le=3)


# The tool as the SDK builds it from the model (strict, like TOOLS).
_TOOL = openai.pydantic_function_tool(Weather, name="get_weather")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[str]:
    with vllm_server(
        tmp_path_factory.mktemp("vllm-surfaces"),
        engine_config={**CAPTURE_ENGINE_CONFIG, **SURFACE_ENGINE_CONFIG},
        model_dir=tiny_model,
        env=SURFACE_ENV,
        name="vllm-surfaces",
    ) as served:
        yield served


@pytest.fixture(scope="module")
def live(url: str) -> dict[str, Answer]:
    answers = capture_surfaces(url, MODEL)
    if os.environ.get("UPDATE_VLLM_SURFACES", "") == "1":
        write_surfaces(answers, SURFACES_DIR)
    return answers


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_every_surface_matches_the_committed_capture(live: dict[str, Answer]) -> None:
    reference = read_surfaces()
    assert sorted(live) == sorted(reference)
    problems = {
        name: diff
        for name, answer in reference.items()
        if (diff := diff_json_shapes(surface_shape(answer), surface_shape(live[name])))
    }
    assert problems == {}


def test_the_forced_tool_call_satisfies_the_schema(live: dict[str, Answer]) -> None:
    """Named and required: the capture itself, parsed (not only its shape)."""
    for name in ("chat_tool_named", "chat_tool_required"):
        (call,) = json.loads(live[name].raw)["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        Weather.model_validate_json(call["function"]["arguments"])


def test_sdk_named_tool_call(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=_ASK,
        tools=[_TOOL],
        tool_choice=_NAMED,
        temperature=0,
        max_tokens=48,
    )
    (call,) = answer.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)


def test_sdk_named_tool_call_streamed(client: openai.OpenAI) -> None:
    names: list[str] = []
    arguments = ""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_ASK,
        tools=[_TOOL],
        tool_choice=_NAMED,
        temperature=0,
        max_tokens=48,
        stream=True,
    )
    for chunk in stream:
        for delta in (choice.delta for choice in chunk.choices):
            for call in delta.tool_calls or []:
                if call.function and call.function.name:
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    arguments += call.function.arguments
    assert names == ["get_weather"]
    Weather.model_validate_json(arguments)


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """20 of 20 answers parse into the model (guided decoding, not luck)."""
    parsed = [
        client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Weather, day {i}?"}],
            response_format=Weather,
            temperature=0,
            max_tokens=48,
        )
        .choices[0]
        .message.parsed
        for i in range(20)
    ]
    assert all(isinstance(item, Weather) for item in parsed)


def test_sdk_n3_gives_three_choices(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=_ASK,
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=4,
    )
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert answer.usage is not None and answer.usage.completion_tokens == 12


def test_sdk_completions(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=MODEL, prompt=["def hello():", "import os"], max_tokens=3, temperature=0
    )
    assert [choice.index for choice in answer.choices] == [0, 1]
    assert answer.usage is not None and answer.usage.completion_tokens == 6


def test_sdk_responses_stream(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input="Say hello",
            max_output_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))

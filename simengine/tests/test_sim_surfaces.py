"""The simulated replica's newer surfaces as clients see them, through the openai SDK:
tool calls, structured output, n > 1, /v1/completions and /v1/responses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionToolParam

from localrun.processes import Process, sim_replica
from simengine.domain import tokens
from simengine.domain.responses_input import count_response_tokens

pytestmark = pytest.mark.e2e

MODEL = "chat-7b"
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    tmp = tmp_path_factory.mktemp("sim-surfaces")
    with sim_replica(
        tmp,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--max-model-len",
        "4096",
        "--sim-output-mean",
        "12",
        model=MODEL,
    ) as process:
        yield process


@pytest.fixture(scope="module")
def plain_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    tmp = tmp_path_factory.mktemp("sim-no-tools")
    with sim_replica(tmp, "--sim-output-mean", "12", model=MODEL) as process:
        yield process


@pytest.fixture(scope="module")
def client(replica: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0)


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


# -- tool calls ---------------------------------------------------------------------------


def test_auto_tool_choice_calls_the_tool_the_user_names(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=ask("What does get_weather say for Oslo?"), tools=TOOLS
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [call.function.name for call in calls if call.type == "function"] == [
        "get_weather"
    ]
    call = calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    usage = answer.usage
    assert usage is not None
    # The hermes syntax around the arguments and the end token count too.
    assert usage.completion_tokens > len(tokens.encode(call.function.arguments))
    assert usage.prompt_tokens == tokens.count_chat_tokens(
        ask("What does get_weather say for Oslo?"), TOOLS
    )


def test_auto_tool_choice_answers_in_text_when_no_tool_is_named(
    client: openai.OpenAI,
) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=ask("Tell me a story"), tools=TOOLS
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_parallel_tool_calls_call_every_named_tool_unless_off(
    client: openai.OpenAI,
) -> None:
    prompt = ask("use get_time and get_weather")
    both = client.chat.completions.create(model=MODEL, messages=prompt, tools=TOOLS)
    one = client.chat.completions.create(
        model=MODEL, messages=prompt, tools=TOOLS, parallel_tool_calls=False
    )
    assert len(both.choices[0].message.tool_calls or []) == 2
    assert len(one.choices[0].message.tool_calls or []) == 1


def test_named_tool_choice_streams_vllms_tool_call_chunks(
    client: openai.OpenAI,
) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("hello"),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices][1:]
    first = (deltas[0].tool_calls or [])[0]
    assert first.index == 0 and first.type == "function"
    assert first.id is not None and first.id.startswith("chatcmpl-tool-")
    assert first.function is not None and first.function.name == "get_weather"
    arguments = ""
    for delta in deltas:
        function = (delta.tool_calls or [])[0].function
        assert function is not None
        arguments += function.arguments or ""
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    assert len(deltas) > 3, "arguments come in token-sized pieces"
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] == "stop"  # vLLM: "stop" for a named function
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == len(deltas)


def test_required_tool_choice_calls_a_tool_and_finishes_with_tool_calls(
    client: openai.OpenAI,
) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=ask("anything"), tools=TOOLS, tool_choice="required"
    )
    assert answer.choices[0].finish_reason == "tool_calls"
    assert answer.choices[0].message.content == ""
    assert answer.choices[0].message.tool_calls


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=ask("get_weather please"), tools=TOOLS, tool_choice="none"
    )
    assert answer.choices[0].message.tool_calls is None


def test_auto_tool_choice_needs_the_flags_as_in_vllm(plain_replica: Process) -> None:
    response = httpx.post(
        f"{plain_replica.url}/v1/chat/completions",
        json={"model": MODEL, "messages": ask("get_weather"), "tools": TOOLS},
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        '"auto" tool choice requires '
        "--enable-auto-tool-choice and --tool-call-parser to be set"
    )


def test_tool_choice_naming_an_unknown_tool_is_refused(replica: Process) -> None:
    response = httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": ask("x"),
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice"


def test_a_tool_call_turn_counts_in_the_next_prompt(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ask("get_weather for Rome"), tools=TOOLS
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    assert call.type == "function"
    history: list[Any] = [
        *ask("get_weather for Rome"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": call.function.arguments,
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert second.usage is not None
    assert second.usage.prompt_tokens == tokens.count_chat_tokens(history, TOOLS)


# -- structured output --------------------------------------------------------------------


class Forecast(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    city: str
    high_c: int = pydantic.Field(ge=-40, le=50)
    sky: Literal["sunny", "cloudy", "rain"]
    hours: list[float] = pydantic.Field(min_length=2, max_length=4)
    alerts: list[str] | None = None


def test_parse_with_a_pydantic_model_validates_every_time(
    client: openai.OpenAI,
) -> None:
    for index in range(20):
        answer = client.chat.completions.parse(
            model=MODEL,
            messages=ask(f"forecast number {index}"),
            response_format=Forecast,
        )
        assert answer.choices[0].finish_reason == "stop"
        assert isinstance(answer.choices[0].message.parsed, Forecast)


def test_json_object_answers_a_json_object_streamed_in_pieces(
    client: openai.OpenAI,
) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("json please"),
        response_format={"type": "json_object"},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    usage = chunks[-1].usage
    # The JSON's tokens and the end-of-sequence token, as vLLM counts them.
    assert usage is not None
    assert usage.completion_tokens == len(tokens.encode(text)) + 1


def test_max_tokens_cuts_structured_output_with_length(
    client: openai.OpenAI,
) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ask("forecast"),
        max_tokens=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "f", "schema": Forecast.model_json_schema()},
        },
    )
    assert answer.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer.choices[0].message.content or "")


# -- n > 1 --------------------------------------------------------------------------------


def test_n_choices_are_distinct_and_usage_sums_them(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=ask("say something"), n=3, max_tokens=20
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    texts = [c.message.content or "" for c in answer.choices]
    assert len(set(texts)) == 3
    usage = answer.usage
    assert usage is not None
    assert usage.completion_tokens == sum(len(tokens.encode(t)) for t in texts)
    assert usage.prompt_tokens == tokens.count_chat_tokens(ask("say something"))


def test_n_choices_stream_interleaved_with_a_role_chunk_each(
    client: openai.OpenAI,
) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("say something"),
        n=3,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    roles = [
        c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role
    ]
    assert roles == [0, 1, 2]
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == sum(len(tokens.encode(t)) for t in texts.values())


def test_n_above_the_limit_is_refused(replica: Process) -> None:
    response = httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={"model": MODEL, "messages": ask("x"), "n": 9},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"


# -- /v1/completions ----------------------------------------------------------------------


def test_completion_answers_text_completion_with_16_tokens_by_default(
    client: openai.OpenAI,
) -> None:
    answer = client.completions.create(
        model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True}
    )
    assert answer.object == "text_completion"
    assert answer.id.startswith("cmpl-")
    choice = answer.choices[0]
    assert choice.finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 16 == len(tokens.encode(choice.text))
    assert answer.usage.prompt_tokens == len(tokens.encode("Once upon a time"))


def test_completion_streams_with_a_usage_chunk(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=["first prompt", "second one"],
        n=2,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    indexes = {c.choices[0].index for c in chunks if c.choices}
    assert indexes == {0, 1, 2, 3}
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert final.usage.completion_tokens == sum(
        len(tokens.encode(t)) for t in texts.values()
    )
    assert final.usage.prompt_tokens == len(tokens.encode("first prompt")) + len(
        tokens.encode("second one")
    )


def test_completion_token_id_prompts_count_their_ids(client: openai.OpenAI) -> None:
    ids = tokens.output_token_ids(7, 0, 9)
    answer = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True)
    assert answer.usage is not None and answer.usage.prompt_tokens == 9
    assert answer.choices[0].text.startswith("".join(tokens.output_text(7, 9)))
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=2)
    assert batch.usage is not None and batch.usage.prompt_tokens == 13


def test_completion_logprobs_have_vllms_shape(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=4, logprobs=2
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 4
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)
    ]
    assert logprobs.top_logprobs is not None
    assert all(top is not None and len(top) == 2 for top in logprobs.top_logprobs)


def test_completion_suffix_is_refused_as_by_vllm(replica: Process) -> None:
    response = httpx.post(
        f"{replica.url}/v1/completions",
        json={"model": MODEL, "prompt": "def f(", "suffix": "return x"},
    )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "suffix is only supported for models with FIM completion rendering",
        "type": "BadRequestError",
        "param": "suffix",
        "code": 400,
    }


# -- /v1/responses ------------------------------------------------------------------------

RESPONSES_TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER_PARAMETERS,
        "strict": True,
    }
]


def test_response_answers_text_with_usage_counted_as_the_gateway_counts(
    client: openai.OpenAI,
) -> None:
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Say hello", max_output_tokens=64
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message"
    assert response.usage is not None
    assert response.usage.input_tokens == count_response_tokens(
        "Be brief.", "Say hello"
    )
    assert response.usage.output_tokens == len(tokens.encode(response.output_text))
    assert response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens
    )


def test_response_stream_sends_typed_events_through_completed(
    client: openai.OpenAI,
) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input="Say hello", max_output_tokens=8, stream=True
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(
        event.delta for event in events if event.type == "response.output_text.delta"
    )
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == deltas
    assert completed.response.usage is not None


def test_response_calls_a_named_function_with_valid_arguments(
    client: openai.OpenAI,
) -> None:
    response = client.responses.create(
        model=MODEL,
        input="weather?",
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert response.status == "completed"
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


def test_response_streams_a_function_call(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input=[
                {"role": "developer", "content": "Use tools."},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "get_weather in Oslo"}],
                },
            ],
            tools=RESPONSES_TOOLS,
            stream=True,
        )
    )
    arguments = "".join(
        event.delta
        for event in events
        if event.type == "response.function_call_arguments.delta"
    )
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == arguments


def test_response_follows_a_function_call_output(client: openai.OpenAI) -> None:
    items: list[Any] = [
        {"role": "user", "content": "get_weather in Oslo"},
        {
            "type": "function_call",
            "call_id": "call-1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo", "unit": "celsius"}',
        },
        {"type": "function_call_output", "call_id": "call-1", "output": "cold"},
    ]
    response = client.responses.create(
        model=MODEL, input=items, tools=RESPONSES_TOOLS, tool_choice="none"
    )
    assert response.output[0].type == "message"
    assert response.usage is not None
    assert response.usage.input_tokens == count_response_tokens(
        None, items, RESPONSES_TOOLS
    )


def test_response_with_a_json_schema_format_validates(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="forecast",
        text={
            "format": {
                "type": "json_schema",
                "name": "forecast",
                "schema": Forecast.model_json_schema(),
                "strict": True,
            }
        },
    )
    Forecast.model_validate_json(response.output_text)


def test_response_previous_id_is_unknown_as_in_vllm(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(
            model=MODEL, input="again", previous_response_id="resp_0123456789abcdef"
        )
    assert "resp_0123456789abcdef" in str(raised.value)

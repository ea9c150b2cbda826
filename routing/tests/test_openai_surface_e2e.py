"""The OpenAI surface product code uses, end to end: tool calls, structured outputs,
several choices and completions, through a real gateway to simulated replicas, with
the ``openai`` SDK unchanged.

Version v1 of chat-7b names a tool-call parser and v2 does not: a request with
tools pinned to v2 is a 400 that is never charged. Every answer the team ``beta``
is told of is added up and held to the usage rows the platform wrote.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from django.utils import timezone

from localrun.processes import wait_until
from metering.models import Usage
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from openai.types import CompletionUsage
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast for a city.",
            "parameters": WEATHER,
            "strict": True,
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
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Forecast(pydantic.BaseModel):
    """What a structured answer must hold."""

    city: str
    days: int
    sunny: bool
    hours: list[int]


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("surface")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 1, "v2": 1},
            version_configs={"v1": {"tool_call_parser": "hermes"}},
        ) as live,
    ):
        yield live


class Told:
    """The usage the team ``beta`` was told of, answer by answer."""

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0
        self.output_tokens = 0

    def add(self, usage: CompletionUsage | None) -> None:
        assert usage is not None
        self.requests += 1
        self.prompt_tokens += usage.prompt_tokens
        self.output_tokens += usage.completion_tokens


@pytest.fixture(scope="module")
def told() -> Told:
    return Told()


def beta(platform: LivePlatform) -> openai.OpenAI:
    return platform.client("beta")


def test_a_named_tool_call_has_arguments_that_satisfy_the_schema(
    platform: LivePlatform, told: Told
) -> None:
    answer = beta(platform).chat.completions.create(
        model="chat-7b", messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=200
    )
    told.add(answer.usage)
    (call,) = answer.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert answer.model_extra and answer.model_extra["model_version"] == "v1"


def test_a_streamed_tool_call_accumulates_to_valid_arguments(
    platform: LivePlatform, told: Told
) -> None:
    stream = beta(platform).chat.completions.create(
        model="chat-7b",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    told.add(chunks[-1].usage)
    assert calls, "no tool call streamed"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_tool_results_in_the_history_are_accepted_and_charged(
    platform: LivePlatform, told: Told
) -> None:
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "celsius", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "3 C, snow"},
    ]
    without_tools = beta(platform).chat.completions.create(
        model="chat-7b", messages=history, max_tokens=5
    )
    told.add(without_tools.usage)
    with_tools = beta(platform).chat.completions.create(
        model="chat-7b", messages=history, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    told.add(with_tools.usage)
    assert without_tools.usage and with_tools.usage
    # The definitions are part of the prompt the engine renders, and counted.
    assert with_tools.usage.prompt_tokens > without_tools.usage.prompt_tokens + 20


def test_structured_outputs_validate_twenty_times_out_of_twenty(
    platform: LivePlatform, told: Told
) -> None:
    client = beta(platform)
    for index in range(20):
        parsed = client.chat.completions.parse(
            model="chat-7b",
            messages=[{"role": "user", "content": f"Forecast number {index}"}],
            response_format=Forecast,
            max_tokens=300,
        )
        told.add(parsed.usage)
        assert isinstance(parsed.choices[0].message.parsed, Forecast)
    answer = client.chat.completions.create(
        model="chat-7b",
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=300,
    )
    told.add(answer.usage)
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


def test_n_choices_come_whole_and_streamed(platform: LivePlatform, told: Told) -> None:
    client = beta(platform)
    answer = client.chat.completions.create(
        model="chat-7b", messages=ASK, n=3, max_tokens=6
    )
    told.add(answer.usage)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.message.content for c in answer.choices)
    chunks = list(
        client.chat.completions.create(
            model="chat-7b", messages=ASK, n=3, max_tokens=6, stream=True
        )
    )
    told.add(chunks[-1].usage)
    indices = {c.index for chunk in chunks for c in chunk.choices}
    assert indices == {0, 1, 2}


def test_completions_answer_strings_lists_and_token_ids(
    platform: LivePlatform, told: Told
) -> None:
    client = beta(platform)
    one = client.completions.create(model="chat-7b", prompt="Once upon a", max_tokens=5)
    told.add(one.usage)
    assert one.object == "text_completion"
    assert one.choices[0].text
    many = client.completions.create(
        model="chat-7b", prompt=["Once upon a", "In a land far"], max_tokens=4, n=2
    )
    told.add(many.usage)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    ids = client.completions.create(
        model="chat-7b", prompt=[1001, 1002, 1003], max_tokens=4
    )
    told.add(ids.usage)
    assert ids.usage and ids.usage.prompt_tokens == 3
    chunks = list(
        client.completions.create(
            model="chat-7b",
            prompt="Once upon a",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    told.add(chunks[-1].usage)
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def _straight(platform: LivePlatform, path: str, body: dict[str, Any]) -> Any:
    """Send ``body`` to a v1 replica itself (no gateway), as the engine's client."""
    (replica,) = platform.serving("v1")
    response = httpx.post(
        f"{replica.url}{path}",
        json={**body, "model": "chat-7b"},
        headers={"Authorization": f"Bearer {platform.env['PLATFORM_ENGINE_API_KEY']}"},
        timeout=30,
    )
    response.raise_for_status()
    return response.json()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 80},
        ),
        ("/v1/chat/completions", {"messages": ASK, "max_tokens": 12}),
        ("/v1/completions", {"prompt": "Once upon a", "max_tokens": 12}),
    ],
)
def test_greedy_answers_through_the_gateway_are_the_replicas_own(
    platform: LivePlatform, path: str, body: dict[str, Any], told: Told
) -> None:
    greedy = {**body, "temperature": 0, "seed": 7}
    direct = _straight(platform, path, greedy)
    via = httpx.post(
        f"{platform.url}{path}",
        json={**greedy, "model": "chat-7b@v1"},
        headers={"Authorization": f"Bearer {platform.keys['beta']}"},
        timeout=30,
    )
    via.raise_for_status()
    answer = via.json()
    told.add(
        openai.types.CompletionUsage(
            **{
                k: answer["usage"][k]
                for k in ("prompt_tokens", "completion_tokens", "total_tokens")
            }
        )
    )

    def essence(doc: dict[str, Any]) -> list[Any]:
        out = []
        for choice in doc["choices"]:
            message = choice.get("message") or {}
            calls = [
                (c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in message.get("tool_calls") or ()
            ]
            # vLLM's content beside tool calls is "", OpenAI's (and ours) null.
            out.append(
                (
                    choice.get("text"),
                    message.get("content") or None,
                    calls,
                    choice["finish_reason"],
                )
            )
        return out

    assert essence(answer) == essence(direct)
    assert answer["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "chat-7b@v2", "tools": TOOLS}, "tools"),
        (
            {
                "model": "chat-7b",
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "strin"}},
                    }
                ],
            },
            "tools.0.function.parameters",
        ),
        ({"model": "chat-7b", "n": 9}, "n"),
    ],
)
def test_refused_surface_requests_are_clear_400s(
    platform: LivePlatform, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        beta(platform).chat.completions.create(messages=ASK, max_tokens=5, **body)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert refused.value.status_code == 400


def test_usage_rows_equal_what_the_team_was_told(
    platform: LivePlatform, told: Told, django_db_blocker: DjangoDbBlocker
) -> None:
    """Last in the module: every answer above was told and metered once; the
    refused ones were never charged."""
    assert told.requests >= 25

    def rows() -> tuple[int, int, int]:
        _flush(platform)
        with django_db_blocker.unblock():
            found = Usage.objects.filter(team_id="beta", model_id="chat-7b")
            return (
                sum(r.requests for r in found),
                sum(r.prompt_tokens for r in found),
                sum(r.output_tokens for r in found),
            )

    expected = (told.requests, told.prompt_tokens, told.output_tokens)
    wait_until(
        lambda: rows() == expected,
        timeout_s=30,
        message=f"usage rows equal to what beta was told {expected}",
    )


def _flush(platform: LivePlatform) -> None:
    if not os.environ.get("REDIS_URL"):
        return
    import redis

    from metering.services import flush_redis_usage

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    flush_redis_usage(
        client=client, prefix=platform.prefix, now=timezone.now() + timedelta(minutes=2)
    )

"""``POST /v1/responses`` end to end: real gateway, agent and simulated replica
processes, PostgreSQL and Redis, and the openai SDK's ``client.responses``.

What the client is told (the response's usage) is what the team's usage rows say;
what the platform never does (store a response, continue a stored one) is a 400
that never reaches admission, so it is never charged nor metered. The version
parses tool calls (``tool_call_parser``), so function tools are served too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest
from django.db.models import Sum
from django.utils import timezone

from localrun.processes import wait_until
from metering.models import Usage
from tests.live import LivePlatform, extra_of, start_platform

if TYPE_CHECKING:
    from openai.types.responses import FunctionToolParam, Response
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "chat-7b"


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    tmp: Path = tmp_path_factory.mktemp("responses")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 1},
            version_configs={"v1": {"tool_call_parser": "hermes"}},
        ) as live,
    ):
        yield live


def flush_usage(platform: LivePlatform) -> None:
    """Flush closed and open minutes (Redis mode); the embedded gateway flushes itself."""
    if not os.environ.get("REDIS_URL"):
        return
    import redis

    from metering.services import flush_redis_usage

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    flush_redis_usage(
        client=client, prefix=platform.prefix, now=timezone.now() + timedelta(minutes=2)
    )


def usage_totals(team: str) -> dict[str, int]:
    totals = Usage.objects.filter(team_id=team).aggregate(
        requests=Sum("requests"),
        prompt_tokens=Sum("prompt_tokens"),
        cached_tokens=Sum("cached_tokens"),
        output_tokens=Sum("output_tokens"),
    )
    return {name: int(value or 0) for name, value in totals.items()}


def told(response: Response) -> dict[str, int]:
    """Return what the response told the client it used."""
    usage = response.usage
    assert usage is not None, response
    return {
        "requests": 1,
        "prompt_tokens": usage.input_tokens,
        "cached_tokens": usage.input_tokens_details.cached_tokens,
        "output_tokens": usage.output_tokens,
    }


def test_responses_whole_and_streamed_are_metered_as_told(
    platform: LivePlatform, unblocked: None
) -> None:
    """GIVEN team beta's usage so far
    WHEN it asks for one whole response and one streamed response
    THEN each says its usage and who served it, the stream its text deltas, and
    the team's usage rows grow by exactly what the two responses said.
    """
    flush_usage(platform)
    before = usage_totals("beta")
    client = platform.client("beta")

    whole = client.responses.create(
        model=MODEL,
        input="hello",
        instructions="Answer briefly.",
        max_output_tokens=6,
        extra_headers={"x-conversation-id": "resp-whole"},
    )
    assert whole.status in ("completed", "incomplete")
    assert whole.output_text
    assert whole.model == MODEL
    served_by = extra_of(whole)
    assert served_by["model_version"] == "v1"
    assert served_by["region"] == "e2e"
    assert served_by["replica_id"].startswith("chat-7b-v1-e2e-")

    deltas: list[str] = []
    completed: Response | None = None
    with client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": whole.output_text},
            {"role": "user", "content": [{"type": "input_text", "text": "more"}]},
        ],
        max_output_tokens=5,
        stream=True,
        store=False,
    ) as stream:
        kinds: list[str] = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                completed = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert completed is not None
    assert "".join(deltas) == completed.output_text
    assert extra_of(completed)["replica_id"].startswith("chat-7b-v1-e2e-")

    expected = {
        name: before[name] + told(whole)[name] + told(completed)[name]
        for name in before
    }

    def metered() -> dict[str, int] | None:
        flush_usage(platform)
        totals = usage_totals("beta")
        return totals if totals["requests"] >= expected["requests"] else None

    assert wait_until(metered, timeout_s=20, message="beta's usage rows") == expected


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"store": True}, "store", "unsupported_value"),
        (
            {"previous_response_id": "resp_0123456789abcdef"},
            "previous_response_id",
            "unsupported_parameter",
        ),
    ],
)
def test_stored_state_is_a_400_never_charged(
    platform: LivePlatform,
    unblocked: None,
    extra: dict[str, Any],
    param: str,
    code: str,
) -> None:
    flush_usage(platform)
    before = usage_totals("alpha")
    with pytest.raises(openai.BadRequestError) as caught:
        platform.client("alpha").responses.create(
            model=MODEL, input="hello", max_output_tokens=4, **extra
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == (param, code)
    assert "input" in error["message"] or "never stores" in error["message"]
    flush_usage(platform)
    assert usage_totals("alpha") == before


WEATHER: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": True,
}


def test_function_call_streams_and_its_output_comes_back_in_input(
    platform: LivePlatform,
) -> None:
    """GIVEN a function tool the model must call (tool_choice names it)
    WHEN the call streams, and the next turn sends the call and its output back
    THEN the call's arguments arrive as deltas that make up the completed call,
    and the next turn, the whole conversation in input, is answered.
    """
    client = platform.client("alpha")
    arguments: list[str] = []
    completed: Response | None = None
    with client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        stream=True,
    ) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments.append(event.delta)
            elif event.type == "response.completed":
                completed = event.response
    assert completed is not None
    calls = [item for item in completed.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"]
    assert "".join(arguments) == calls[0].arguments

    answer = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {
                "type": "function_call_output",
                "call_id": calls[0].call_id,
                "output": "sunny, 21 C",
            },
        ],
        tools=[WEATHER],
        max_output_tokens=8,
    )
    assert answer.status in ("completed", "incomplete")
    assert answer.usage is not None
    assert answer.usage.input_tokens > 0

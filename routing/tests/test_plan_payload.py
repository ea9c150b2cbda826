"""What the gateway sends the engine: its own fields, never a client's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import pytest

from routing.domain.snapshot import ConfigSnapshot
from routing.domain.tiers import Tier
from routing.plan import (
    ChatPlan,
    GatewaySettings,
    payload_for,
    plan_chat,
    plan_response,
)
from routing.prompt_tokens import VersionCounters
from routing.responses import GatewayError
from routing.tests.embedded_gateway import MODEL, _snapshot


def _plan(tier: str, snapshot: ConfigSnapshot | None = None) -> dict[str, object]:
    plan = asyncio.run(
        plan_chat(
            snapshot=snapshot or _snapshot(None),
            settings=GatewaySettings(region="embedded"),
            counters=VersionCounters(),
            team="alpha",
            headers={b"x-priority": tier.encode()},
            body={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
                "priority": -100,
            },
            started_at=time.monotonic(),
            rng=random.Random(0),
        )
    )
    return dict(json.loads(plan.payload))


def _priority_snapshot() -> ConfigSnapshot:
    snapshot = _snapshot(None)
    version = snapshot.versions[(MODEL, "v1")]
    versions = {(MODEL, "v1"): dataclasses.replace(version, priority_scheduling=True)}
    return dataclasses.replace(snapshot, versions=versions)


def test_a_priority_engine_gets_the_tier_as_its_priority() -> None:
    snapshot = _priority_snapshot()
    assert _plan("interactive", snapshot)["priority"] == 0
    assert _plan("standard", snapshot)["priority"] == 1
    assert _plan("batch", snapshot)["priority"] == 2
    # A default (fcfs) engine refuses a priority other than 0: none is sent.
    assert "priority" not in _plan("batch")


def test_payload_for_another_version_follows_its_engine() -> None:
    fcfs = _snapshot(None).versions[(MODEL, "v1")]
    ranked = dataclasses.replace(fcfs, priority_scheduling=True)
    plain = json.dumps({"model": MODEL, "stream": True}).encode()
    assert payload_for(plain, Tier.BATCH, fcfs) is plain
    moved = payload_for(plain, Tier.BATCH, ranked)
    assert json.loads(moved) == {"model": MODEL, "stream": True, "priority": 2}
    assert json.loads(payload_for(moved, Tier.BATCH, fcfs)) == json.loads(plain)


def test_a_clients_priority_never_reaches_the_engine() -> None:
    plan = asyncio.run(
        plan_chat(
            snapshot=_snapshot(None),
            settings=GatewaySettings(region="embedded"),
            counters=VersionCounters(),
            team="alpha",
            headers={b"x-priority": b"batch"},
            body={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
                "priority": -100,  # vLLM's field: a client would jump every queue
                "temperature": 0.5,
            },
            started_at=time.monotonic(),
            rng=random.Random(0),
        )
    )
    sent = json.loads(plan.payload)
    assert "priority" not in sent
    assert sent["temperature"] == 0.5  # the rest passes through
    assert sent["stream"] is True and sent["max_tokens"] == 8


def _plan_response(body: dict[str, object]) -> ChatPlan:
    return asyncio.run(
        plan_response(
            snapshot=_snapshot(None),
            settings=GatewaySettings(region="embedded"),
            counters=VersionCounters(),
            team="alpha",
            headers={},
            body=body,
            started_at=time.monotonic(),
            rng=random.Random(0),
        )
    )


def test_a_response_goes_to_the_engine_streamed_and_unstored() -> None:
    plan = _plan_response(
        {"model": MODEL, "input": "hello", "store": False, "temperature": 0.5}
    )
    payload = json.loads(plan.payload)
    assert payload["stream"] is True
    assert payload["store"] is False
    assert payload["temperature"] == 0.5
    assert payload["max_output_tokens"] == plan.max_tokens
    assert plan.surface == "responses"
    assert not plan.stream
    # Keyed and counted as the chat of the same messages.
    chat = asyncio.run(
        plan_chat(
            snapshot=_snapshot(None),
            settings=GatewaySettings(region="embedded"),
            counters=VersionCounters(),
            team="alpha",
            headers={},
            body={"model": MODEL, "messages": [{"role": "user", "content": "hello"}]},
            started_at=time.monotonic(),
            rng=random.Random(0),
        )
    )
    assert (plan.routing_key, plan.prompt_tokens) == (
        chat.routing_key,
        chat.prompt_tokens,
    )
    assert plan.max_tokens == chat.max_tokens


def test_a_response_with_tools_needs_a_tool_call_parser() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    with pytest.raises(GatewayError) as caught:
        _plan_response({"model": MODEL, "input": "hello", "tools": [tool]})
    assert (caught.value.status, caught.value.param) == (400, "tools")
    assert caught.value.code == "unsupported_parameter"


def test_a_response_refused_body_is_a_400_naming_its_param() -> None:
    with pytest.raises(GatewayError) as caught:
        _plan_response({"model": MODEL, "input": "hello", "store": True})
    assert (caught.value.status, caught.value.param) == (400, "store")

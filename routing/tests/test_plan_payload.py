"""What the gateway sends the engine: its own fields, never a client's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

from routing.domain.snapshot import ConfigSnapshot
from routing.domain.tiers import Tier
from routing.plan import GatewaySettings, payload_for, plan_chat
from routing.prompt_tokens import VersionCounters
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

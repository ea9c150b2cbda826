"""The fleet replica's engine scheduling policy: ``"priority"`` (vLLM's
``--scheduling-policy priority``, the tier's rank) admits and prefills an
interactive request ahead of batch ones; ``"fcfs"`` (the default) keeps arrival
order."""

from __future__ import annotations

import dataclasses

import pytest

from drills.domain.fleet_config import FleetConfig
from drills.domain.replica import FleetReplica, FleetRequest
from simengine.domain.perf import PROFILES

PROFILE = PROFILES["a100-8b"]  # 2,048 batched tokens a step


def line(rid: int, tier: str, *, prompt: int) -> FleetRequest:
    return FleetRequest(
        rid,
        team="t",
        tier=tier,
        conversation=rid,
        prompt_tokens=prompt,
        output_tokens=50,
        max_tokens=50,
        history_tokens=0,
        stream_tokens=0,
        arrived_at=0.0,
    )


def first_tokens(replica: FleetReplica) -> list[tuple[int, float]]:
    """Run until idle; return (request id, first-token time) in order."""
    order: list[tuple[int, float]] = []
    now = 0.0
    end = replica.plan(now)
    while end is not None:
        first, _ = replica.complete(end)
        order += [(r.request_id, end) for r in first]
        now = end
        end = replica.plan(now)
    return order


def prefill_behind_batch(scheduling: str) -> list[tuple[int, float]]:
    """Three 4,000-token batch prompts prefilling, then an interactive one arrives
    after their first step."""
    replica = FleetReplica("r", PROFILE, jitter_cv=0, scheduling=scheduling)
    for rid in (1, 2, 3):
        replica.add(line(rid, "batch", prompt=4000))
    end = replica.plan(0.0)
    assert end is not None
    replica.complete(end)
    replica.add(line(9, "interactive", prompt=1000))
    order: list[tuple[int, float]] = []
    now = end
    step = replica.plan(now)
    while step is not None:
        first, _ = replica.complete(step)
        order += [(r.request_id, step) for r in first]
        step = replica.plan(step)
    return order


def test_priority_prefills_an_interactive_prompt_before_batch_prefills() -> None:
    order = prefill_behind_batch("priority")
    assert order[0][0] == 9
    fcfs = prefill_behind_batch("fcfs")
    # First come, first served: the interactive prompt waits behind all three.
    assert [rid for rid, _ in fcfs] == [1, 2, 3, 9]
    assert dict(order)[9] < dict(fcfs)[9]
    # The batch prompts still all get their first token.
    assert sorted(rid for rid, _ in order) == [1, 2, 3, 9]


def test_priority_admits_the_waiting_queue_by_rank_then_arrival() -> None:
    profile = dataclasses.replace(PROFILE, max_num_seqs=1)
    tiers = ["batch", "standard", "batch", "interactive", "standard", "interactive"]

    def order(scheduling: str) -> list[int]:
        replica = FleetReplica("r", profile, jitter_cv=0, scheduling=scheduling)
        for rid, tier in enumerate(tiers):
            replica.add(line(rid, tier, prompt=100))
        assert replica.num_waiting == len(tiers)
        return [rid for rid, _ in first_tokens(replica)]

    assert order("priority") == [3, 5, 1, 4, 0, 2]
    assert order("fcfs") == [0, 1, 2, 3, 4, 5]


def test_fcfs_is_the_default_and_unknown_policies_are_refused() -> None:
    assert FleetReplica("r", PROFILE).scheduling == "fcfs"
    assert FleetConfig().engine_scheduling == "fcfs"
    with pytest.raises(ValueError, match="fcfs or priority"):
        FleetReplica("r", PROFILE, scheduling="lifo")
    with pytest.raises(ValueError, match="fcfs or priority"):
        FleetConfig(engine_scheduling="lifo")


def test_a_lost_replica_returns_its_waiting_requests_of_every_rank() -> None:
    profile = dataclasses.replace(PROFILE, max_num_seqs=1)
    replica = FleetReplica("r", profile, jitter_cv=0, scheduling="priority")
    for rid, tier in enumerate(["batch", "interactive", "standard"]):
        replica.add(line(rid, tier, prompt=100))
    replica.plan(0.0)  # admits the interactive one
    assert [r.request_id for r in replica.waiting] == [2, 0]
    lost = replica.fail(0.01)
    assert sorted(r.request_id for r in lost) == [0, 1, 2]
    assert replica.num_waiting == 0 and replica.waiting == []

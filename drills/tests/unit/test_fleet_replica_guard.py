"""The fleet replica under the batch guard (``batches.domain.guard``): batch's
prefill tokens per step and KV share are bounded, interactive requests preempt
running batch ones, and batch KV is recycled before cached prefixes."""

from __future__ import annotations

import dataclasses

import pytest

from batches.domain.guard import BatchGuard
from drills.domain.replica import FleetReplica, FleetRequest
from simengine.domain.perf import PROFILES

PROFILE = PROFILES["a100-8b"]  # 2,048 batched tokens a step


def line(
    rid: int, tier: str, *, prompt: int, output: int = 50, at: float = 0.0
) -> FleetRequest:
    return FleetRequest(
        rid,
        team="t",
        tier=tier,
        conversation=rid,
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=output,
        history_tokens=0,
        stream_tokens=0,
        arrived_at=at,
    )


def guarded(
    guard: BatchGuard, *, max_num_seqs: int = 256, num_gpu_blocks: int | None = None
) -> FleetReplica:
    return FleetReplica(
        "r",
        dataclasses.replace(PROFILE, max_num_seqs=max_num_seqs),
        num_gpu_blocks=num_gpu_blocks,
        jitter_cv=0,
        scheduling="priority",
        batch_guard=guard,
    )


def chunks(replica: FleetReplica, now: float) -> list[tuple[int, int]]:
    end = replica.plan(now)
    assert end is not None and replica.segment is not None
    return [(r.request_id, n) for r, n in replica.segment.chunks]


def run_to_idle(replica: FleetReplica, now: float = 0.0) -> list[FleetRequest]:
    """Complete the planned segment (if any) and run until nothing is left."""
    done: list[FleetRequest] = []
    segment = replica.segment
    end = segment.ends_at() if segment is not None else replica.plan(now)
    while end is not None:
        done += replica.complete(end)[1]
        end = replica.plan(end)
    return done


def test_guard_caps_batch_prefill_per_step_and_beside_interactive() -> None:
    replica = guarded(BatchGuard(prefill_tokens=256, prefill_beside_interactive=64))
    replica.add(line(1, "batch", prompt=1000))
    replica.add(line(2, "batch", prompt=1000))
    assert chunks(replica, 0.0) == [(1, 256)]
    replica.complete(replica.segment.ends_at())  # type: ignore[union-attr]
    replica.add(line(9, "interactive", prompt=500))
    # The interactive prompt whole, and batch only what is left beside it.
    assert chunks(replica, 1.0) == [(9, 500), (1, 64)]
    # Without the guard the step's whole budget goes to prefill.
    plain = FleetReplica("p", PROFILE, jitter_cv=0, scheduling="priority")
    plain.add(line(1, "batch", prompt=1000))
    plain.add(line(2, "batch", prompt=1000))
    assert chunks(plain, 0.0) == [(1, 1000), (2, 1000)]


def test_guard_holds_batch_under_its_kv_share_and_never_interactive() -> None:
    capacity = guarded(BatchGuard()).kv_capacity_tokens
    # Room for two 1,050-token lines, not three.
    replica = guarded(BatchGuard(kv_share=2.5 * 1050 / capacity))
    for rid in range(1, 6):
        replica.add(line(rid, "batch", prompt=1000))
    # Standard is in the guarded lane too (ahead of batch in the queue).
    replica.add(line(7, "standard", prompt=1000))
    replica.plan(0.0)
    assert sorted(r.request_id for r in replica.prefilling) == [1, 7]
    assert replica.num_waiting == 4
    replica.complete(replica.segment.ends_at())  # type: ignore[union-attr]
    for rid in (8, 9, 10):
        replica.add(line(rid, "interactive", prompt=1000))
    replica.plan(1.0)
    running = {r.request_id for r in (*replica.prefilling, *replica.decoding.values())}
    assert {8, 9, 10} <= running and not running & {2, 3, 4, 5}
    done = run_to_idle(replica)
    assert sorted(r.request_id for r in done) == [1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert replica.tokens_in_flight() == 0


@pytest.mark.parametrize("prompt", [3000, 100])
def test_interactive_preempts_the_latest_batch_request(prompt: int) -> None:
    """GIVEN two batch lines filling the replica's two sequence slots (3,000-token
    prompts: the latest still prefilling; 100-token ones: both decoding, cut
    mid-segment) WHEN an interactive request arrives THEN the latest batch line is
    preempted, and later recomputed to its full answer."""
    replica = guarded(BatchGuard(kv_share=1.0), max_num_seqs=2)
    replica.add(line(1, "batch", prompt=prompt, output=40))
    replica.add(line(2, "batch", prompt=prompt, output=40, at=1.0))
    end = replica.plan(0.0)
    assert end is not None
    replica.complete(end)
    now = end
    if prompt == 100:
        end = replica.plan(now)
        assert end is not None
        cut = replica.interrupt(now + (end - now) / 2)
        assert cut is not None
        replica.complete(cut)
        now = cut
        assert replica.generated_by(replica.decoding[2]) > 1
    first_token_at = replica.holds()[-1].first_token_at
    replica.add(line(9, "interactive", prompt=100, output=40, at=now))
    replica.plan(now)
    assert replica.preemptions == 1
    assert [r.request_id for r in replica.waiting] == [2]  # its queue's head
    assert 9 in {r.request_id for r in replica.prefilling}
    done = run_to_idle(replica)
    by_id = {r.request_id: r for r in done}
    assert sorted(by_id) == [1, 2, 9]
    # Recomputed, not restarted: a first token that came out stands.
    assert by_id[2].first_token_at == (first_token_at or by_id[2].first_token_at)
    assert by_id[2].finished_at > by_id[9].first_token_at  # type: ignore[operator]
    # Every request made exactly its answer (recomputed tokens are not new ones).
    assert replica.generated_tokens == 3 * 40
    assert replica.tokens_in_flight() == 0


def test_batch_blocks_are_recycled_before_cached_prefixes() -> None:
    replica = guarded(BatchGuard(kv_share=1.0), num_gpu_blocks=40)
    chat = FleetRequest(
        1,
        team="t",
        tier="interactive",
        conversation=1,
        prompt_tokens=16 * 8,
        output_tokens=16,
        max_tokens=16,
        history_tokens=0,
        stream_tokens=16 * 9,
        arrived_at=0.0,
    )
    replica.add(chat)
    run_to_idle(replica, 0.0)
    cached = replica.pool.num_cached_blocks
    assert cached > 0
    # Batch lines churn through more blocks than are free beside the cache.
    now = 10.0
    for rid in range(2, 12):
        replica.add(line(rid, "batch", prompt=16 * 10, output=16, at=now))
        now = 10.0 + rid
        run_to_idle(replica, now)
    assert replica.pool.num_cached_blocks == cached

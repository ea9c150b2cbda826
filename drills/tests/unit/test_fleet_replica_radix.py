"""The fleet replica with SGLang's radix cache (``cache="radix"``): hits to the
token where the block pool rounds down to whole blocks, off-stream tokens that
take space but never hit, locked prefixes that survive eviction, a reservation
that never over-commits the KV memory, and a fleet whose hit rate is the block
pool's or a little better on the same replay."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.replica import FleetReplica, FleetRequest, stream_token_base
from drills.domain.routing_ab import generate_arrivals, history_hit_rate
from drills.domain.workload import ChatWorkload
from drills.tests.unit.test_fleet_replica import request, run_alone
from simengine.domain.perf import PROFILES

PROFILE = PROFILES["a100-8b"]  # 16-token blocks


def radix(num_gpu_blocks: int | None = None) -> FleetReplica:
    return FleetReplica(
        "r",
        PROFILE,
        block_size=16,
        num_gpu_blocks=num_gpu_blocks,
        jitter_cv=0,
        cache="radix",
    )


def block() -> FleetReplica:
    return FleetReplica("r", PROFILE, block_size=16, jitter_cv=0)


def test_a_100_token_stream_hits_99_tokens_with_radix_and_96_with_blocks() -> None:
    """GIVEN a 100-token prompt, all on its conversation's stream, served once
    WHEN the same prompt comes again
    THEN the radix replica serves 99 tokens from cache (all but the last, which is
    recomputed for its logits) and the 16-token block pool 96 (six whole blocks)."""
    cached = {}
    for name, replica in (("radix", radix()), ("block", block())):
        replica.add(request(1, conversation=3, prompt=100, output=4, stream=100))
        run_alone(replica)
        again = request(
            2, conversation=3, prompt=100, output=4, history=100, stream=100
        )
        replica.add(again)
        run_alone(replica, now=10.0)
        cached[name] = again.cached_tokens
    assert cached == {"radix": 99, "block": 96}


def test_a_turns_own_text_fills_the_tree_but_never_hits() -> None:
    """GIVEN a seed-style turn: 1,200 prompt tokens of which 800 are the
    conversation's history, and a 300-token answer off the stream
    WHEN it finishes and the next turn comes
    THEN the tree holds all 1,499 computed tokens (800 on the stream, 699 its own),
    the next turn hits exactly the 800, and the idle replica reads 0% usage."""
    replica = radix()
    first = request(1, conversation=5, prompt=1200, output=300, stream=800)
    replica.add(first)
    run_alone(replica)
    tree = replica.radix
    assert tree is not None
    assert tree.total_size == 1499
    assert (
        tree.match_prefix(
            range(stream_token_base(5), stream_token_base(5) + 1200)
        ).length
        == 800
    )
    assert replica.kv_cache_usage_perc == 0.0
    second = request(2, conversation=5, prompt=1200, output=300, history=800)
    replica.add(second)
    run_alone(replica, now=50.0)
    assert second.cached_tokens == 800
    # The second turn's own 699 tokens are new: they add to the tree.
    assert tree.total_size == 1499 + 699


def test_a_running_requests_prefix_is_never_evicted() -> None:
    """GIVEN a 1,600-token cache holding conversation 1's stream, and a turn of
    conversation 1 running on it (its 500-token hit locked)
    WHEN a 1,000-token prompt of another conversation needs more than the free and
    evictable space
    THEN it waits (the locked prefix stays, only the unlocked tail could go), and
    is admitted once the turn ends, evicting what it needs."""
    replica = radix(num_gpu_blocks=101)  # (101 - 1) * 16 = 1,600 tokens
    assert replica.kv_capacity_tokens == 1600
    replica.add(request(1, conversation=1, prompt=500, output=100, stream=500))
    run_alone(replica)
    tree = replica.radix
    assert tree is not None
    assert tree.total_size == 599  # 500 on the stream, a 99-token tail
    running = request(
        2, conversation=1, prompt=600, output=400, history=500, stream=500
    )
    replica.add(running)
    end = replica.plan(10.0)
    assert end is not None and running.cached_tokens == 500
    assert tree.protected_size == 500
    other = request(3, conversation=2, prompt=1000, output=100, stream=1000)
    replica.add(other)
    replica.complete(end)
    end = replica.plan(end)
    # 1,600 - 599 in the tree - 499 reserved = 502 free, + 99 evictable < 1,099.
    assert replica.num_waiting == 1 and replica.num_running == 1
    base = stream_token_base(1)
    assert tree.protected_size >= 500
    assert tree.match_prefix(range(base, base + 500)).length == 500
    while end is not None and other.first_token_at is None:
        replica.complete(end)
        end = replica.plan(end)
    assert running.finished_at is not None
    assert (
        other.first_token_at is not None and other.first_token_at >= running.finished_at
    )
    assert tree.evicted_tokens > 0


def test_the_cache_never_over_commits_and_ends_unlocked() -> None:
    """GIVEN a small radix cache and a random mix of conversations, prompts and
    answers arriving over time
    WHEN the replica runs them all
    THEN after every segment the tree plus the reservations fit the capacity, the
    tree's counters add up, and at the end nothing is locked or reserved."""
    rng = random.Random(4)
    replica = radix(num_gpu_blocks=301)  # 4,800 tokens
    capacity = replica.kv_capacity_tokens
    tree = replica.radix
    assert tree is not None
    pending: list[FleetRequest] = []
    at = 0.0
    for rid in range(200):
        at += rng.expovariate(20.0)
        stream = rng.randrange(0, 1500)
        req = request(
            rid,
            conversation=rng.randrange(12),
            prompt=rng.randrange(1, 1500),
            output=rng.randrange(1, 300),
            history=stream,
            stream=stream,
        )
        req.arrived_at = at
        pending.append(req)
    end: float | None = None
    now = 0.0
    peak = 0
    while pending or end is not None:
        if end is None or (pending and pending[0].arrived_at < end):
            req = pending.pop(0)
            now = req.arrived_at
            replica.add(req)
            # An arrival starts an idle replica or cuts its running segment.
            end = replica.plan(now) if end is None else replica.interrupt(now) or end
            continue
        replica.complete(end)
        used = tree.total_size + replica.kv_reserved_tokens
        peak = max(peak, used)
        assert used <= capacity
        assert tree.total_size == tree.evictable_size + tree.protected_size
        assert 0.0 <= replica.kv_cache_usage_perc <= 1.0
        end = replica.plan(end)
    assert peak > capacity // 2  # the test did press on the capacity
    assert tree.evicted_tokens > 0
    assert tree.protected_size == 0 and replica.kv_reserved_tokens == 0
    assert replica.tokens_in_flight() == 0


def test_a_request_that_can_never_fit_is_refused() -> None:
    """GIVEN an idle 1,600-token radix cache
    WHEN a request needs 2,000 tokens
    THEN planning raises, as the block pool does, instead of stalling."""
    replica = radix(num_gpu_blocks=101)
    replica.add(request(1, prompt=1500, output=501, stream=0))
    with pytest.raises(ValueError, match="KV tokens"):
        replica.plan(0.0)


def test_radix_refuses_the_host_tier_and_the_config_checks_the_engine() -> None:
    """GIVEN the radix cache or an SGLang pool
    WHEN a host offload tier or an unknown engine is asked for
    THEN each is a ValueError naming the problem."""
    with pytest.raises(ValueError, match="HiCache"):
        FleetReplica("r", PROFILE, cache="radix", host_blocks=10)
    with pytest.raises(ValueError, match="cache is"):
        FleetReplica("r", PROFILE, cache="paged")
    with pytest.raises(ValueError, match="engine is"):
        FleetConfig(engine="tgi")
    with pytest.raises(ValueError, match="hierarchical"):
        FleetConfig(engine="sglang", host_offload_gib=8)
    assert FleetConfig(engine="sglang").replica_cache == "radix"
    assert FleetConfig().replica_cache == "block"


def test_a_radix_fleet_hits_at_least_as_much_as_a_block_fleet() -> None:
    """GIVEN one small growing-chat replay (histories of any length, not whole
    blocks) through four replicas with prefix affinity
    WHEN it runs once on vLLM's 16-token blocks and once on SGLang's radix cache
    THEN the radix fleet serves at least the block fleet's share of the history
    (counted to the token for both) and within a few points of it, and computes
    no more uncached prefill."""
    workload = ChatWorkload(
        arrival_rate=8.0,
        message_interval_s=10.0,
        mode="growing",
        prompt_tokens=300,
        history_tokens=250,
        answer_tokens=30,
        max_tokens=30,
    )
    arrivals = generate_arrivals(workload, 90.0, seed=2)
    config = FleetConfig(replicas=4, block_size=16, seed=2)
    results = {
        engine: FleetSim(replace(config, engine=engine), arrivals=arrivals).run(
            60.0, warmup_s=30.0
        )
        for engine in ("vllm", "sglang")
    }
    block_rate = history_hit_rate(results["vllm"])
    radix_rate = history_hit_rate(results["sglang"])
    assert block_rate is not None and radix_rate is not None
    assert block_rate > 0.5
    assert block_rate <= radix_rate <= block_rate + 0.05
    assert results["sglang"].prefill_tokens <= results["vllm"].prefill_tokens
    # The SGLang pool counts its own hit rate to the token too.
    assert results["sglang"].summary()["prefix_hit_rate"] == pytest.approx(radix_rate)

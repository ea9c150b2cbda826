"""The fleet replica's KV events (``kv_events=True``): off, nothing is recorded; on,
a prefix index built from them alone predicts the replica's own hit, GPU pool and
host tier, for every next request, through evictions; the fleet's gateway keeps the
index and its prefill count consistent."""

from __future__ import annotations

import random

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.replica import FleetReplica, FleetRequest
from drills.domain.routing_ab import generate_arrivals
from drills.domain.workload import ChatWorkload
from routing.domain.kv_index import PrefixIndex
from simengine.domain.kv_events import BlockRemoved, BlockStored, EventBatch
from simengine.domain.perf import PROFILES

PROFILE = PROFILES["a100-8b"]
BS = 16


def make_request(
    rid: int, conversation: int, *, turn: int, group: int = -1, prefix: int = 0
) -> FleetRequest:
    """A seed-shaped turn (1,200 + prefix tokens, 800 of history) of a conversation."""
    return FleetRequest(
        rid,
        team="t",
        tier="standard",
        conversation=conversation,
        prompt_tokens=prefix + 1200,
        output_tokens=50,
        max_tokens=50,
        history_tokens=prefix + (800 if turn else 0),
        stream_tokens=prefix + 800,
        arrived_at=0.0,
        prefix_group=group,
        prefix_tokens=prefix,
    )


def run_until_idle(rep: FleetReplica, now: float) -> float:
    end = rep.plan(now)
    while end is not None:
        rep.complete(end)
        now = end
        end = rep.plan(now)
    return now


def replica_hit(rep: FleetReplica, req: FleetRequest) -> int:
    """What the replica's admission will find: the GPU pool's run, then the host's."""
    blocks = min(req.stream_tokens, req.prompt_tokens - 1) // BS
    hashes = req.block_hashes(blocks, BS)
    gpu = len(rep.pool.cached_block_ids(hashes))
    host = rep.host.lookup(hashes, gpu, blocks) if rep.host is not None else 0
    return (gpu + host) * BS


def test_no_events_are_recorded_unless_asked() -> None:
    rep = FleetReplica("r", PROFILE, block_size=BS, jitter_cv=0, host_blocks=100)
    rep.add(make_request(1, 0, turn=0))
    run_until_idle(rep, 0.0)
    assert rep.take_kv_events() == ()
    assert rep.pool.take_events() == []
    assert rep.host is not None and rep.host.evicted_log is None


def test_events_name_the_blocks_cached_then_the_evicted() -> None:
    # 95 blocks hold one 1,250-token request: the second evicts the first's.
    rep = FleetReplica(
        "r", PROFILE, block_size=BS, num_gpu_blocks=95, jitter_cv=0, kv_events=True
    )
    rep.add(make_request(1, 0, turn=0))
    now = run_until_idle(rep, 0.0)
    stored = rep.take_kv_events()
    assert stored and all(isinstance(e, BlockStored) for e in stored)
    first = stored[0]
    assert isinstance(first, BlockStored)
    assert first.parent_block_hash is None and first.token_ids == ()
    assert first.block_hashes[:2] == tuple(
        make_request(9, 0, turn=1).block_hashes(2, BS)
    )
    rep.add(make_request(2, 1, turn=0))
    run_until_idle(rep, now)
    events = rep.take_kv_events()
    assert isinstance(events[0], BlockRemoved)
    assert events[0].medium == "GPU" and events[0].block_hashes
    assert rep.take_kv_events() == ()


def test_index_from_events_predicts_the_replicas_own_hit() -> None:
    """GIVEN a small GPU pool and host tier, shared prefixes and conversations
    WHEN each request runs alone and only the replica's events feed the index
    THEN the index's match equals the replica's hit for every next request."""
    rng = random.Random(7)
    rep = FleetReplica(
        "r",
        PROFILE,
        block_size=BS,
        num_gpu_blocks=250,
        jitter_cv=0,
        host_blocks=1200,
        kv_events=True,
    )
    index = PrefixIndex()
    turns: dict[int, int] = {}
    now, seq, hits = 0.0, 0, 0
    for rid in range(1, 121):
        conversation = rng.randrange(12)
        group = conversation % 3
        req = make_request(
            rid,
            conversation,
            turn=turns.get(conversation, 0),
            group=group,
            prefix=500 + 300 * group,
        )
        turns[conversation] = turns.get(conversation, 0) + 1
        keys = req.block_hashes(min(req.stream_tokens, req.prompt_tokens - 1) // BS, BS)
        predicted = index.match(keys, req.prompt_tokens).get("r", 0)
        assert predicted == replica_hit(rep, req), rid
        hits += predicted > 0
        rep.add(req)
        now = run_until_idle(rep, now)
        assert req.cached_tokens == predicted
        events = rep.take_kv_events()
        if events:
            seq += 1
            index.apply("r", seq, EventBatch(now, events), now)
    assert hits > 60  # the test saw hits, GPU and host
    assert rep.host is not None and rep.host.evictions > 0
    assert rep.pool.evictions > 0 and rep.host_hit_tokens > 0


def test_fleet_gateway_index_tracks_replicas_and_settles_prefill() -> None:
    workload = ChatWorkload(arrival_rate=8, shared_prefixes=4)
    arrivals = generate_arrivals(workload, 60, seed=3)
    sim = FleetSim(
        FleetConfig(replicas=3, policy="cache_aware", jitter_cv=0),
        arrivals=arrivals,
    )
    result = sim.run(40, warmup_s=20)
    assert sim.kv_index is not None
    assert sim.kv_index.replicas == {"r00", "r01", "r02"}
    assert all(sim.kv_index.blocks(r) > 0 for r in ("r00", "r01", "r02"))
    # Every request got its first token: nothing is owed any more.
    assert all(r.outcome == "ok" for r in result.requests)
    assert set(sim._prefill_in_flight.values()) == {0}


def test_other_policies_keep_no_index() -> None:
    sim = FleetSim(
        FleetConfig(replicas=2, policy="prefix_affinity"),
        arrivals=generate_arrivals(ChatWorkload(arrival_rate=2), 5, seed=0),
    )
    assert sim.kv_index is None
    assert all(r.take_kv_events() == () for r in sim.serving)


def test_radix_fleet_has_no_index_so_cache_aware_is_affinity() -> None:
    arrivals = generate_arrivals(ChatWorkload(arrival_rate=5), 40, seed=0)
    routed = []
    for policy in ("cache_aware", "prefix_affinity"):
        config = FleetConfig(replicas=2, policy=policy, engine="sglang")
        sim = FleetSim(config, arrivals=arrivals)
        result = sim.run(30, warmup_s=10)
        assert sim.kv_index is None
        routed.append([(r.replica_id, r.cached_tokens) for r in result.requests])
    assert routed[0] == routed[1]


def test_events_count_only_once_they_reach_the_gateway() -> None:
    """Events still in transit are not seen: with a delay past the run the index
    stays empty and cache-aware routing is prefix affinity's, choice for choice."""
    arrivals = generate_arrivals(
        ChatWorkload(arrival_rate=6, shared_prefixes=4), 40, seed=1
    )
    routed = []
    for policy, delay_s in (("cache_aware", 1e6), ("prefix_affinity", 0.05)):
        config = FleetConfig(replicas=3, policy=policy, kv_event_delay_s=delay_s)
        sim = FleetSim(config, arrivals=arrivals)
        result = sim.run(30, warmup_s=10)
        routed.append([(r.replica_id, r.cached_tokens) for r in result.requests])
        if sim.kv_index is not None:
            assert sim.kv_index.replicas == frozenset()
    assert routed[0] == routed[1]

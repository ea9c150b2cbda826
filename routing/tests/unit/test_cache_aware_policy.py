"""Cache-aware routing: warm first, the owner among equals, bounds send it away."""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest

from routing.domain.policies import (
    CacheAwarePolicy,
    PolicyOptions,
    PrefixAffinityPolicy,
    RouteRequest,
)
from routing.domain.snapshot import NodeSnapshot

NOW = 0.0
IDS = [f"r{i}" for i in range(6)]
OPTIONS = PolicyOptions(min_bound_tokens=0, prefill_gap_tokens=4_000)


def nodes(
    loads: Mapping[str, int] | None = None, prefill: Mapping[str, int] | None = None
) -> list[NodeSnapshot]:
    loads = loads or {}
    prefill = prefill or {}
    return [
        NodeSnapshot(
            replica_id=rid,
            url=f"http://{rid}",
            tokens_in_flight=loads.get(rid, 10_000),
            prefill_tokens_in_flight=prefill.get(rid, 0),
        )
        for rid in IDS
    ]


def request(
    cached: Mapping[str, int] | None, key: str = "conv:1", prompt: int = 3_000
) -> RouteRequest:
    return RouteRequest(
        model="m", version="v", routing_key=key, team="t",
        request_tokens=prompt + 300, prompt_tokens=prompt, cached_tokens=cached,
    )  # fmt: skip


def owner(key: str) -> str:
    policy = PrefixAffinityPolicy()
    return policy.choose(request(None, key), nodes(), NOW).candidates[0]


def test_without_an_index_it_is_prefix_affinity() -> None:
    rng = random.Random(3)
    cache_aware = CacheAwarePolicy(OPTIONS)
    affinity = PrefixAffinityPolicy.from_options(OPTIONS)
    for i in range(100):
        pool = nodes({rid: rng.randrange(0, 40_000) for rid in IDS})
        empty: dict[str, int] = {}
        for cached in (None, empty):
            got = cache_aware.choose(request(cached, f"c{i}"), pool, NOW)
            want = affinity.choose(request(None, f"c{i}"), pool, NOW)
            assert got.candidates == want.candidates
            assert got.policy == "cache_aware"


def test_a_prompt_goes_where_its_prefix_is_cached() -> None:
    home = owner("conv:1")
    warm = next(rid for rid in IDS if rid != home)
    decision = CacheAwarePolicy(OPTIONS).choose(request({warm: 2_048}), nodes(), NOW)
    assert decision.chosen == warm
    assert decision.skipped_over_bound == 0


def test_the_owner_keeps_it_when_its_cache_is_as_good() -> None:
    home = owner("conv:1")
    cached = dict.fromkeys(IDS, 2_048)
    # Another replica holds as much and owes less prefill: the owner still wins.
    prefill = {rid: 0 if rid != home else 2_000 for rid in IDS}
    decision = CacheAwarePolicy(OPTIONS).choose(
        request(cached), nodes(prefill=prefill), NOW
    )
    assert decision.chosen == home


def test_a_warm_replica_owing_too_much_prefill_loses_the_request() -> None:
    home = owner("conv:1")
    cold = [rid for rid in IDS if rid != home]
    # The warm owner owes 5,000 tokens; cold ones owe none but must compute 3,000.
    # 5,000 + 1,000 - 3,000 = 3,000 <= 4,000: stays.
    stays = CacheAwarePolicy(OPTIONS).choose(
        request({home: 2_000}), nodes(prefill={home: 5_000}), NOW
    )
    assert stays.chosen == home
    # At 7,000 owed the gap is 5,000 > 4,000: leaves for the fastest cold one.
    leaves = CacheAwarePolicy(OPTIONS).choose(
        request({home: 2_000}), nodes(prefill={home: 7_000, cold[2]: 100}), NOW
    )
    assert leaves.chosen != home
    assert leaves.chosen != cold[2]
    assert leaves.skipped_over_bound == 1
    # Retries go by prefill owed: the warm node owes the most, so it comes last.
    assert leaves.candidates[-1] == home


def test_the_load_ceiling_moves_a_request_off_a_hot_warm_replica() -> None:
    home = owner("conv:1")
    loads = dict.fromkeys(IDS, 10_000)
    loads[home] = 40_000  # average ~15,500: 1.5x is ~23,300
    decision = CacheAwarePolicy(OPTIONS).choose(
        request({home: 2_000}), nodes(loads), NOW
    )
    assert decision.chosen != home


@pytest.mark.parametrize("seed", range(5))
def test_the_choice_never_owes_more_than_the_gap_over_the_fastest(seed: int) -> None:
    rng = random.Random(seed)
    policy = CacheAwarePolicy(PolicyOptions(min_bound_tokens=0, cache_load_factor=50))
    for i in range(300):
        prompt = rng.randrange(100, 6_000)
        cached = {rid: rng.randrange(0, prompt) for rid in IDS if rng.random() < 0.5}
        pool = nodes(prefill={rid: rng.randrange(0, 20_000) for rid in IDS})
        decision = policy.choose(request(cached, f"c{i}", prompt), pool, NOW)
        pending = {
            n.replica_id: n.prefill_tokens_in_flight
            + prompt
            - cached.get(n.replica_id, 0)
            for n in pool
        }
        chosen = decision.chosen
        assert chosen is not None
        if cached and max(cached.values()) > 0:
            gap = pending[chosen] - min(pending.values())
            assert gap <= policy.options.prefill_gap_tokens
            assert sorted(decision.candidates) == sorted(IDS)

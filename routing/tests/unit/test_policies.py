"""Tests for the routing policies and their registry."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import ClassVar

import pytest

from routing.domain.policies import (
    POLICIES,
    LeastTokensPolicy,
    PolicyOptions,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
    RouteDecision,
    RouteRequest,
    make_policy,
    register_policy,
)
from routing.domain.ring import HashRing
from routing.domain.snapshot import NodeSnapshot

NOW = 1_000.0
IDS = [f"r{i:02d}" for i in range(12)]


def make_nodes(loads: dict[str, int]) -> list[NodeSnapshot]:
    return [
        NodeSnapshot(replica_id=rid, url=f"http://{rid}:8000", tokens_in_flight=load)
        for rid, load in loads.items()
    ]


def make_request(key: str = "conv:1", tokens: int = 1_000) -> RouteRequest:
    return RouteRequest(
        model="chat-7b", version="v13", routing_key=key, team="search",
        request_tokens=tokens,
    )  # fmt: skip


def within_bound(load: int, tokens: int, loads: list[int], factor: float) -> bool:
    """The documented bound, written out again independently of the policy."""
    average = (sum(loads) + tokens) / len(loads)
    return load + tokens <= max(factor * average, tokens)


# --- registry -----------------------------------------------------------------


def test_registry_lists_the_four_policies() -> None:
    assert set(POLICIES) == {
        "round_robin",
        "least_tokens",
        "prefix_affinity",
        "cache_aware",
    }
    for name, cls in POLICIES.items():
        assert cls.name == name


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_make_policy_builds_a_fresh_instance_by_name(name: str) -> None:
    first, second = make_policy(name), make_policy(name)
    assert first.name == name
    assert first is not second


def test_make_policy_unknown_name_raises_key_error_listing_known_names() -> None:
    with pytest.raises(KeyError, match="fastest") as excinfo:
        make_policy("fastest")
    assert "least_tokens, prefix_affinity, round_robin" in str(excinfo.value)


def test_register_policy_after_import_raises_because_registry_is_closed() -> None:
    class LatePolicy:
        """A complete policy: only the closed registry refuses it."""

        name: ClassVar[str] = "late"

        @classmethod
        def from_options(cls, options: PolicyOptions) -> LatePolicy:
            return cls()

        def choose(
            self, req: RouteRequest, nodes: Sequence[NodeSnapshot], now: float
        ) -> RouteDecision:
            return RouteDecision(candidates=(), policy=self.name)

        def reset(self) -> None:
            pass

    with pytest.raises(RuntimeError, match="closed"):
        register_policy(LatePolicy)
    assert "late" not in POLICIES


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_with_no_nodes_returns_no_candidates(name: str) -> None:
    decision = make_policy(name).choose(make_request(), [], NOW)
    assert decision == RouteDecision(candidates=(), policy=name, skipped_over_bound=0)
    assert decision.chosen is None


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_candidates_cover_every_node_once(name: str) -> None:
    policy = make_policy(name)
    rng = random.Random(7)
    for i in range(200):
        nodes = make_nodes({rid: rng.randrange(0, 50_000) for rid in IDS})
        decision = policy.choose(make_request(f"conv:{i}"), nodes, NOW)
        assert sorted(decision.candidates) == IDS
        assert decision.policy == name
        assert decision.chosen == decision.candidates[0]


# --- round robin --------------------------------------------------------------


def test_round_robin_spreads_requests_evenly() -> None:
    policy = RoundRobinPolicy()
    nodes = make_nodes(dict.fromkeys(IDS, 0))
    counts = Counter(
        policy.choose(make_request(f"conv:{i}"), nodes, NOW).chosen
        for i in range(1_000)
    )
    assert set(counts) == set(IDS)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_round_robin_rotates_in_replica_id_order_whatever_the_input_order() -> None:
    policy = RoundRobinPolicy()
    nodes = make_nodes(dict.fromkeys(["c", "a", "b"], 0))
    decisions = [policy.choose(make_request(), nodes, NOW) for _ in range(4)]
    assert [d.candidates for d in decisions] == [
        ("a", "b", "c"),
        ("b", "c", "a"),
        ("c", "a", "b"),
        ("a", "b", "c"),
    ]


def test_round_robin_reset_restarts_at_the_lowest_id() -> None:
    policy = RoundRobinPolicy()
    nodes = make_nodes(dict.fromkeys(["a", "b", "c"], 0))
    policy.choose(make_request(), nodes, NOW)
    policy.reset()
    assert policy.choose(make_request(), nodes, NOW).chosen == "a"


# --- least tokens -------------------------------------------------------------


def test_least_tokens_picks_the_minimum_and_orders_by_load() -> None:
    policy = LeastTokensPolicy()
    nodes = make_nodes({"a": 9_000, "b": 300, "c": 4_000, "d": 12_000})
    decision = policy.choose(make_request(), nodes, NOW)
    assert decision.candidates == ("b", "c", "a", "d")


def test_least_tokens_picks_the_minimum_over_random_loads() -> None:
    policy = LeastTokensPolicy()
    rng = random.Random(11)
    for _ in range(500):
        loads = {rid: rng.randrange(0, 20) for rid in IDS}
        decision = policy.choose(make_request(), make_nodes(loads), NOW)
        assert loads[decision.candidates[0]] == min(loads.values())
        ordered = [loads[rid] for rid in decision.candidates]
        assert ordered == sorted(ordered)


def test_least_tokens_rotates_among_idle_nodes() -> None:
    policy = LeastTokensPolicy()
    nodes = make_nodes(dict.fromkeys(IDS, 0))
    counts = Counter(
        policy.choose(make_request(), nodes, NOW).chosen for _ in range(120)
    )
    assert counts == dict.fromkeys(IDS, 10)


def test_least_tokens_reset_restarts_the_tie_break() -> None:
    policy = LeastTokensPolicy()
    nodes = make_nodes(dict.fromkeys(["a", "b"], 0))
    policy.choose(make_request(), nodes, NOW)
    policy.reset()
    assert policy.choose(make_request(), nodes, NOW).chosen == "a"


# --- prefix affinity ----------------------------------------------------------


def test_prefix_affinity_idle_pool_chooses_the_ring_owner() -> None:
    policy = PrefixAffinityPolicy()
    ring = HashRing(IDS)
    nodes = make_nodes(dict.fromkeys(IDS, 0))
    for i in range(300):
        key = f"conv:{i}"
        decision = policy.choose(make_request(key), nodes, NOW)
        assert decision.candidates == ring.order(key)
        assert decision.skipped_over_bound == 0


def test_prefix_affinity_same_key_lands_on_same_node_under_even_load() -> None:
    policy = PrefixAffinityPolicy()
    nodes = make_nodes(dict.fromkeys(IDS, 20_000))
    for i in range(100):
        key = f"conv:{i}"
        chosen = {policy.choose(make_request(key), nodes, NOW).chosen for _ in range(5)}
        assert len(chosen) == 1


def test_prefix_affinity_spreads_different_keys_over_the_pool() -> None:
    policy = PrefixAffinityPolicy()
    nodes = make_nodes(dict.fromkeys(IDS, 20_000))
    chosen = Counter(
        policy.choose(make_request(f"conv:{i}"), nodes, NOW).chosen
        for i in range(1_200)
    )
    assert set(chosen) == set(IDS)


def test_prefix_affinity_skips_a_hot_owner_for_the_next_ring_node() -> None:
    policy = PrefixAffinityPolicy()
    key = "conv:hot"
    order = HashRing(IDS).order(key)
    loads = dict.fromkeys(IDS, 10_000)
    loads[order[0]] = 40_000
    decision = policy.choose(make_request(key), make_nodes(loads), NOW)
    assert decision.chosen == order[1]
    assert decision.skipped_over_bound == 1
    assert decision.candidates == (order[1], order[0], *order[2:])


def test_prefix_affinity_all_over_the_bound_falls_back_to_least_loaded() -> None:
    policy = PrefixAffinityPolicy()
    loads = {"a": 100, "b": 50, "c": 80}
    # avg = (230 + 1000) / 3 = 410; bound = max(512.5, 1000) = 1000 < 1050.
    decision = policy.choose(make_request(tokens=1_000), make_nodes(loads), NOW)
    assert decision.chosen == "b"
    assert decision.skipped_over_bound == 3
    order = HashRing(loads).order("conv:1")
    assert decision.candidates == ("b", *(rid for rid in order if rid != "b"))


def test_prefix_affinity_fallback_ties_go_to_the_earlier_ring_node() -> None:
    policy = PrefixAffinityPolicy()
    loads = dict.fromkeys(["a", "b", "c"], 100)
    decision = policy.choose(make_request(tokens=1_000), make_nodes(loads), NOW)
    assert decision.skipped_over_bound == 3
    assert decision.candidates == HashRing(loads).order("conv:1")


def test_prefix_affinity_never_chooses_over_the_bound_while_a_node_is_within() -> None:
    rng = random.Random(20_240_601)
    factor = 1.25
    branches: Counter[str] = Counter()
    # One policy per pool size, as the gateway holds one per pool: the ring is
    # built once per membership rather than on every trial.
    sizes = range(1, len(IDS) + 1)
    policies = {n: PrefixAffinityPolicy(load_factor=factor) for n in sizes}
    rings = {n: HashRing(IDS[:n]) for n in sizes}
    for trial in range(5_000):
        ids = IDS[: rng.randint(1, len(IDS))]
        shape = rng.choice(["uniform", "skewed", "mostly_idle", "even"])
        if shape == "uniform":
            loads = {rid: rng.randrange(0, 60_000) for rid in ids}
        elif shape == "skewed":
            loads = {rid: int(rng.paretovariate(1.2) * 2_000) for rid in ids}
        elif shape == "mostly_idle":
            loads = {rid: rng.choice([0, 0, 0, rng.randrange(1, 9_000)]) for rid in ids}
        else:
            loads = dict.fromkeys(ids, rng.randrange(0, 30_000))
        tokens = rng.randrange(1, 12_000)
        key = f"conv:{trial}"
        policy = policies[len(ids)]
        decision = policy.choose(make_request(key, tokens), make_nodes(loads), NOW)

        values = list(loads.values())
        ok = {rid for rid in ids if within_bound(loads[rid], tokens, values, factor)}
        order = rings[len(ids)].order(key)
        if ok:
            branches["within"] += 1
            assert decision.chosen in ok
            first_ok = next(rid for rid in order if rid in ok)
            assert decision.chosen == first_ok
            assert decision.skipped_over_bound == order.index(first_ok)
        else:
            branches["fallback"] += 1
            assert decision.chosen is not None
            assert loads[decision.chosen] == min(values)
            assert decision.skipped_over_bound == len(ids)
        assert sorted(decision.candidates) == sorted(ids)
    # Both branches must have been exercised, or the property proves little.
    assert branches["within"] > 1_000
    assert branches["fallback"] > 100
    assert branches["within"] + branches["fallback"] == 5_000


def test_prefix_affinity_rebuilds_the_ring_only_when_membership_changes() -> None:
    policy = PrefixAffinityPolicy()
    policy.choose(make_request(), make_nodes(dict.fromkeys(IDS, 0)), NOW)
    ring = policy.ring
    policy.choose(make_request(), make_nodes(dict.fromkeys(IDS[::-1], 500)), NOW)
    assert policy.ring is ring
    policy.choose(make_request(), make_nodes(dict.fromkeys(IDS[:-1], 0)), NOW)
    assert policy.ring is not ring
    assert policy.ring.nodes == frozenset(IDS[:-1])


def test_prefix_affinity_reset_drops_the_ring() -> None:
    policy = PrefixAffinityPolicy()
    policy.choose(make_request(), make_nodes(dict.fromkeys(IDS, 0)), NOW)
    policy.reset()
    assert policy.ring.nodes == frozenset()


def test_prefix_affinity_rejects_load_factor_below_one() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        PrefixAffinityPolicy(load_factor=0.9)


def test_prefix_affinity_min_bound_keeps_a_lightly_loaded_owner() -> None:
    from routing.domain.policies.prefix_affinity import PrefixAffinityPolicy
    from routing.domain.snapshot import NodeSnapshot

    nodes = [
        NodeSnapshot(replica_id=f"r{i}", url="", tokens_in_flight=0) for i in range(6)
    ]
    policy = PrefixAffinityPolicy()
    req = RouteRequest(
        model="m", version="v1", routing_key="conv:abc", team="t", request_tokens=1000
    )
    owner = policy.choose(req, nodes, 0.0).candidates[0]
    loaded = [
        NodeSnapshot(
            replica_id=n.replica_id,
            url="",
            tokens_in_flight=3000 if n.replica_id == owner else 0,
        )
        for n in nodes
    ]
    # 125% of the average is exceeded: without a floor the owner is skipped ...
    assert policy.choose(req, loaded, 0.0).candidates[0] != owner
    # ... with a floor above its load it keeps the conversation.
    floored = PrefixAffinityPolicy(min_bound_tokens=8000)
    assert floored.choose(req, loaded, 0.0).candidates[0] == owner
    hot = [
        NodeSnapshot(
            replica_id=n.replica_id,
            url="",
            tokens_in_flight=9000 if n.replica_id == owner else 0,
        )
        for n in nodes
    ]
    assert floored.choose(req, hot, 0.0).candidates[0] != owner

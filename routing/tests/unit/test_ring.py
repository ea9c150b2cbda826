"""Tests for the consistent-hash ring."""

from __future__ import annotations

from collections import Counter

import pytest

from routing.domain.ring import DEFAULT_VNODES, HashRing, hash_point

TWELVE = [f"chat-7b-v13-eu-{i}" for i in range(12)]
KEYS = [f"conv:{i}" for i in range(20_000)]


def owners(ring: HashRing) -> dict[str, str | None]:
    return {key: ring.owner(key) for key in KEYS}


def test_hash_point_is_stable_across_releases() -> None:
    # Pinned: every gateway process and release must place a key identically.
    assert hash_point("conv:abc") == 3579680137058371656


def test_hash_ring_is_deterministic_whatever_the_input_order() -> None:
    forward = HashRing(TWELVE)
    backward = HashRing(reversed(TWELVE))
    assert forward.nodes == frozenset(TWELVE)
    assert forward.vnodes == DEFAULT_VNODES
    for key in KEYS[:2_000]:
        assert forward.order(key) == backward.order(key)


def test_hash_ring_walk_yields_every_node_once_starting_at_owner() -> None:
    ring = HashRing(TWELVE)
    for key in KEYS[:500]:
        walked = list(ring.walk(key))
        assert sorted(walked) == sorted(TWELVE)
        assert walked[0] == ring.owner(key)
        assert tuple(walked) == ring.order(key)


def test_hash_ring_walk_is_not_the_same_for_every_key() -> None:
    ring = HashRing(TWELVE)
    assert len({ring.order(key) for key in KEYS[:500]}) > 100


def test_hash_ring_empty_has_no_owner_and_walks_nothing() -> None:
    ring = HashRing([])
    assert ring.owner("conv:1") is None
    assert list(ring.walk("conv:1")) == []
    assert ring.order("conv:1") == ()


def test_hash_ring_single_node_owns_everything() -> None:
    ring = HashRing(["only"])
    assert {ring.owner(key) for key in KEYS[:100]} == {"only"}


def test_hash_ring_rejects_zero_vnodes() -> None:
    with pytest.raises(ValueError, match="vnodes"):
        HashRing(TWELVE, vnodes=0)


def test_hash_ring_adding_thirteenth_replica_moves_about_one_key_in_thirteen() -> None:
    before = owners(HashRing(TWELVE))
    after = owners(HashRing([*TWELVE, "chat-7b-v13-eu-12"]))
    moved = [key for key in KEYS if before[key] != after[key]]
    assert 0.05 <= len(moved) / len(KEYS) <= 0.11
    assert {after[key] for key in moved} == {"chat-7b-v13-eu-12"}


def test_hash_ring_removing_a_replica_moves_only_its_keys() -> None:
    before = owners(HashRing(TWELVE))
    gone = TWELVE[5]
    after = owners(HashRing([node for node in TWELVE if node != gone]))
    for key in KEYS:
        if before[key] == gone:
            assert after[key] != gone
        else:
            assert after[key] == before[key]
    assert any(before[key] == gone for key in KEYS)


def test_hash_ring_spreads_keys_within_a_quarter_of_a_fair_share() -> None:
    counts = Counter(owners(HashRing(TWELVE)).values())
    assert set(counts) == set(TWELVE)
    fair = len(KEYS) / 12
    for node in TWELVE:
        assert 0.75 * fair <= counts[node] <= 1.25 * fair, node


def test_hash_ring_with_nodes_returns_self_when_membership_is_unchanged() -> None:
    ring = HashRing(TWELVE)
    assert ring.with_nodes(reversed(TWELVE)) is ring
    assert ring.with_nodes(frozenset(TWELVE)) is ring


def test_hash_ring_with_nodes_matches_a_fresh_ring() -> None:
    ring = HashRing(TWELVE)
    ring.order("conv:warm-the-memo")
    changed = [*TWELVE[1:], "chat-7b-v13-eu-99"]
    derived = ring.with_nodes(changed)
    fresh = HashRing(changed)
    assert derived is not ring
    assert derived.nodes == frozenset(changed)
    for key in KEYS[:2_000]:
        assert derived.order(key) == fresh.order(key)

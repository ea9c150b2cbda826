"""SGLang's radix prefix cache: matches to the token, splits, locks, LRU leaves."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.domain.radix_cache import RadixCache


def check_sizes(cache: RadixCache) -> None:
    nodes = list(cache.nodes())
    assert cache.total_size == sum(len(node.key) for node in nodes)
    assert cache.total_size == cache.evictable_size + cache.protected_size
    assert cache.protected_size == sum(len(n.key) for n in nodes if n.lock_ref > 0)
    for node in nodes:
        assert node.parent is not None
        assert node.parent.children[node.key[0]] is node
        assert all(child.lock_ref <= node.lock_ref for child in node.children.values())


def test_a_match_reaches_the_token_and_splits_the_edge_it_ends_in() -> None:
    """GIVEN a cached 10-token sequence
    WHEN a request shares its first 7 tokens
    THEN 7 match (a block cache of 16 would match none), the edge is split at 7,
    and the tree still holds 10 tokens."""
    cache = RadixCache()
    assert cache.insert(list(range(10))) == 0
    match = cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99])
    assert match.length == 7
    assert match.node.key == (0, 1, 2, 3, 4, 5, 6)
    assert [len(n.key) for n in cache.nodes()] == [7, 3]
    assert cache.total_size == 10
    check_sizes(cache)


def test_insert_returns_the_part_already_cached() -> None:
    cache = RadixCache()
    cache.insert((1, 2, 3, 4))
    assert cache.insert((1, 2, 3, 4, 5, 6)) == 4
    assert cache.insert((1, 2, 9)) == 2
    assert cache.total_size == 7  # 1 2 | 3 4 | 5 6, and 9
    assert cache.match_prefix((1, 2, 9, 9)).length == 3
    check_sizes(cache)


def test_locked_tokens_are_never_evicted_and_leaves_go_least_recent_first() -> None:
    """GIVEN three conversations cached, the oldest in use by a request
    WHEN the cache must free tokens
    THEN the least recently used unlocked leaf goes first, the locked one stays,
    and a parent left childless is evicted after its children."""
    cache = RadixCache()
    cache.insert(range(0, 100))  # a
    cache.insert(range(1000, 1100))  # b
    cache.insert(range(2000, 2100))  # c
    held = cache.match_prefix(range(0, 100))
    cache.lock(held.node)
    cache.match_prefix(range(2000, 2050))  # c used again: splits at 50
    assert cache.protected_size == 100 and cache.evictable_size == 200
    assert cache.evict(1) == 100  # b, the least recent, whole
    assert cache.match_prefix(range(1000, 1100)).length == 0
    # c's lower half was touched with its upper half; the leaf goes before its parent.
    assert cache.evict(1) == 50
    assert cache.match_prefix(range(2000, 2100)).length == 50
    assert cache.evict(1000) == 50  # c's upper half; a is locked
    assert cache.match_prefix(range(0, 100)).length == 100
    cache.unlock(held.node)
    assert cache.evict(1000) == 100
    assert cache.total_size == 0
    check_sizes(cache)


def test_unlock_without_lock_is_refused() -> None:
    cache = RadixCache()
    cache.insert((1, 2))
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(cache.match_prefix((1, 2)).node)


def test_reset_refuses_while_a_request_holds_the_tree() -> None:
    cache = RadixCache()
    cache.insert((1, 2, 3))
    node = cache.match_prefix((1, 2, 3)).node
    cache.lock(node)
    assert cache.reset() is False
    cache.unlock(node)
    assert cache.reset() is True
    assert cache.total_size == 0


sequences = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=25
)


@settings(max_examples=200, deadline=None)
@given(sequences, sequences)
def test_a_match_is_the_longest_prefix_shared_with_anything_inserted(
    inserted: list[list[int]], asked: list[list[int]]
) -> None:
    """Against brute force: with nothing evicted, the match is the longest common
    prefix with any inserted sequence, and sizes stay consistent through splits."""
    cache = RadixCache()
    for tokens in inserted:
        cache.insert(tokens)
        check_sizes(cache)
    for tokens in asked:
        expected = max(
            next(
                (
                    i
                    for i, (x, y) in enumerate(zip(tokens, seq, strict=False))
                    if x != y
                ),
                min(len(tokens), len(seq)),
            )
            for seq in inserted
        )
        assert cache.match_prefix(tokens).length == expected
    # The tree holds each distinct prefix once: its size is the trie's node count.
    prefixes = {tuple(seq[:i]) for seq in inserted for i in range(1, len(seq) + 1)}
    assert cache.total_size == len(prefixes)
    check_sizes(cache)


@settings(max_examples=100, deadline=None)
@given(sequences, st.lists(st.integers(0, 24), max_size=10), st.integers(1, 40))
def test_eviction_frees_only_unlocked_tokens(
    inserted: list[list[int]], locked: list[int], amount: int
) -> None:
    """However the tree is locked, eviction removes at least what is asked (or all
    that is evictable) and never a locked token."""
    cache = RadixCache()
    for tokens in inserted:
        cache.insert(tokens)
    held = [cache.match_prefix(inserted[i % len(inserted)]) for i in locked]
    for match in held:
        cache.lock(match.node)
    evictable, protected = cache.evictable_size, cache.protected_size
    evicted = cache.evict(amount)
    assert evicted >= min(amount, evictable) or evicted == evictable
    assert cache.protected_size == protected
    for i, match in zip(locked, held, strict=True):
        assert cache.match_prefix(inserted[i % len(inserted)]).length >= match.length
    check_sizes(cache)
    for match in held:
        cache.unlock(match.node)
    cache.evict(cache.total_size)
    assert cache.total_size == 0

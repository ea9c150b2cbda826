"""The radix cache's KV events: blocks of its tree, stored and removed once each."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from simengine.domain.engine import Engine, EngineConfig, SimRequest
from simengine.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from simengine.domain.perf import PROFILES
from simengine.domain.prefix_cache import hash_full_blocks
from simengine.domain.radix_cache import RadixCache, RadixNode


def test_insert_announces_the_full_blocks_it_completes() -> None:
    tree = RadixCache(kv_block_size=4)
    a = tuple(range(1, 11))
    tree.insert(a)
    ha = hash_full_blocks(a, 4)
    assert tree.take_events() == [BlockStored(tuple(ha), None, a[:8], 4)]
    b = (*a[:6], 70, 71, 72)  # diverges inside the second block
    tree.insert(b)
    hb = hash_full_blocks(b, 4)
    assert hb[0] == ha[0] and hb[1] != ha[1]
    assert tree.take_events() == [BlockStored((hb[1],), hb[0], b[4:8], 4)]
    tree.insert(a[:3])  # nothing new
    assert tree.take_events() == []


def test_reset_records_one_clear() -> None:
    tree = RadixCache(kv_block_size=4)
    tree.insert(tuple(range(9)))
    tree.take_events()
    assert tree.reset()
    assert tree.take_events() == [AllBlocksCleared()]


def test_no_events_without_a_block_size() -> None:
    tree = RadixCache()
    tree.insert(tuple(range(9)))
    tree.evict(9)
    assert tree.take_events() == []


def live_blocks(tree: RadixCache, size: int) -> Counter[int]:
    """The full blocks of every root-to-node path, once each."""
    blocks: set[int] = set()

    def path(node: RadixNode) -> tuple[int, ...]:
        keys = []
        walk: RadixNode | None = node
        while walk is not None and walk is not tree.root:
            keys.append(walk.key)
            walk = walk.parent
        return tuple(itertools.chain.from_iterable(reversed(keys)))

    for node in tree.nodes():
        tokens = path(node)
        blocks.update(hash_full_blocks(tokens, size))
    return Counter(blocks)


def replay(events: list[KVEvent], live: Counter[int]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            live.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            live.subtract(event.block_hashes)
        else:
            live.clear()


@given(
    st.lists(
        st.one_of(
            st.lists(st.integers(0, 2), min_size=1, max_size=14).map(tuple),
            st.integers(1, 12),
        ),
        max_size=25,
    )
)
def test_events_track_the_trees_blocks_exactly(
    ops: list[tuple[int, ...] | int],
) -> None:
    """Replaying the events gives each full block of the tree exactly once, and
    nothing else, after any inserts and evictions."""
    size = 3
    tree = RadixCache(kv_block_size=size)
    announced: Counter[int] = Counter()
    for op in ops:
        if isinstance(op, tuple):
            tree.insert(op)
        else:
            tree.evict(op)
        replay(tree.take_events(), announced)
        assert +announced == live_blocks(tree, size)
        assert all(count >= 0 for count in announced.values())


def test_sglang_engine_publishes_its_prompt_blocks() -> None:
    profile = PROFILES["a100-8b"]
    config = EngineConfig.from_profile(
        profile, block_size=4, num_gpu_blocks=16, cache="radix", enable_kv_events=True
    )
    eng = Engine(profile, config, jitter_cv=0.0)
    prompt = list(range(100, 110))
    eng.add_request(SimRequest("r", prompt, 1), 0.0)
    now = 0.0
    events: list[KVEvent] = []
    while (duration := eng.begin_step(now)) is not None:
        now += duration
        events.extend(eng.end_step(now).kv_events)
    hashes = hash_full_blocks(prompt, 4)
    assert events == [BlockStored(tuple(hashes), None, tuple(prompt[:8]), 4)]
    assert eng.reset_prefix_cache()
    assert eng.take_kv_events() == [AllBlocksCleared()]

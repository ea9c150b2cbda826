"""The pool's prefix index: keys from content, holders per block, lost events."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.domain.kv_index import PrefixIndex, prompt_block_keys
from simengine.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from simengine.domain.prefix_cache import BlockPool, hash_full_blocks

BS = 4


def stored(
    tokens: list[int], hashes: list[int], parent: int | None = None, medium: str = "GPU"
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=BS,
        medium=medium,
    )


def batch(*events: object) -> EventBatch:
    return EventBatch(ts=0.0, events=tuple(events))  # type: ignore[arg-type]


def test_a_replica_holds_the_prompt_blocks_its_events_announced() -> None:
    index = PrefixIndex()
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    # The engine's own hashes are opaque; the index keys by content.
    index.apply("a", 0, batch(stored(prompt[:8], [901, 902])), now=0)
    index.apply("a", 1, batch(stored(prompt[8:12], [903], parent=902)), now=0)
    keys = prompt_block_keys(prompt, BS)
    assert index.match(keys, len(prompt)) == {"a": 12}
    # The last prompt token is always computed: a 12-token prompt gets 2 blocks.
    assert index.match(keys, 12) == {"a": 8}
    # A prompt that differs in its second block shares only the first.
    other = [*prompt[:4], 0, 0, 0, 0, *prompt[8:]]
    assert index.match(prompt_block_keys(other, BS), len(other)) == {"a": 4}


def test_each_replica_gets_its_own_depth() -> None:
    index = PrefixIndex()
    prompt = list(range(20))
    index.apply("a", 0, batch(stored(prompt[:16], [1, 2, 3, 4])), now=0)
    index.apply("b", 0, batch(stored(prompt[:8], [7, 8])), now=0)
    index.apply("c", 0, batch(stored([9] * 4, [5])), now=0)
    assert index.match(prompt_block_keys(prompt, BS), 20) == {"a": 16, "b": 8}


def test_removal_and_reset_take_blocks_away() -> None:
    index = PrefixIndex()
    prompt = list(range(12))
    index.apply("a", 0, batch(stored(prompt, [1, 2, 3])), now=0)
    index.apply("a", 1, batch(BlockRemoved(block_hashes=(3,))), now=0)
    keys = prompt_block_keys([*prompt, 0], BS)
    assert index.match(keys, 13) == {"a": 8}
    index.apply("a", 2, batch(AllBlocksCleared()), now=0)
    assert index.match(keys, 13) == {}
    assert index.blocks("a") == 0


def test_a_block_on_the_host_tier_still_counts() -> None:
    index = PrefixIndex()
    prompt = list(range(9))
    index.apply("a", 0, batch(stored(prompt[:8], [1, 2])), now=0)
    index.apply("a", 1, batch(stored(prompt[:8], [1, 2], medium="CPU")), now=0)
    index.apply("a", 2, batch(BlockRemoved(block_hashes=(1, 2))), now=0)
    assert index.match(prompt_block_keys(prompt, BS), 9) == {"a": 8}
    index.apply("a", 3, batch(BlockRemoved(block_hashes=(1, 2), medium="CPU")), now=0)
    assert index.match(prompt_block_keys(prompt, BS), 9) == {}


def test_a_gap_or_a_restart_clears_the_replica() -> None:
    index = PrefixIndex()
    prompt = list(range(9))
    keys = prompt_block_keys(prompt, BS)
    index.apply("a", 0, batch(stored(prompt[:8], [1, 2])), now=0)
    index.apply("b", 0, batch(stored(prompt[:8], [1, 2])), now=0)
    # Batch 1 of "a" was lost: what it removed is unknown.
    index.apply("a", 2, batch(), now=1)
    # "b" restarted: its sequence begins again at 0.
    index.apply("b", 0, batch(), now=1)
    assert index.match(keys, 9) == {}
    assert index.cleared == 2


def test_an_unknown_parent_is_not_guessed() -> None:
    index = PrefixIndex()
    index.apply("a", 0, batch(stored([1, 2, 3, 4], [55], parent=54)), now=0)
    assert index.blocks("a") == 0


def test_forget_expire_and_bits_reused() -> None:
    index = PrefixIndex()
    prompt = list(range(5))
    keys = prompt_block_keys(prompt, BS)
    index.apply("a", 0, batch(stored(prompt[:4], [1])), now=0)
    index.apply("b", 0, batch(stored(prompt[:4], [1])), now=10)
    assert index.expire(now=20, silent_s=15) == ["a"]
    assert index.match(keys, 5) == {"b": 4}
    index.retain(())
    assert index.replicas == frozenset()
    index.apply("c", 0, batch(stored(prompt[:4], [1])), now=0)
    assert index.match(keys, 5) == {"c": 4}


def test_the_cap_drops_the_oldest_entries() -> None:
    index = PrefixIndex(max_blocks_per_replica=2)
    tokens = list(range(12))
    index.apply("a", 0, batch(stored(tokens, [1, 2, 3])), now=0)
    assert index.blocks("a") == 2
    # The first block went, so the chain no longer matches from the start.
    assert index.match(prompt_block_keys([*tokens, 0], BS), 13) == {}


def test_engine_hash_keys_when_events_carry_no_tokens() -> None:
    index = PrefixIndex()
    event = BlockStored(
        block_hashes=(11, 12), parent_block_hash=None, token_ids=(), block_size=16
    )
    index.apply("a", 0, batch(event), now=0)
    assert index.match([11, 12, 13], 100) == {"a": 32}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_the_index_agrees_with_vllms_block_pool(seed: int) -> None:
    """Drive a real block pool with random prompts, feed the index the events the
    pool's hashes imply, and compare every lookup with the pool's own."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=24, block_size=BS)
    index = PrefixIndex()
    seen: set[int] = set()
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for seq in range(30):
        prompt = rng.choice(prefixes)[: rng.randrange(4, 13)] + [
            rng.randrange(50) for _ in range(rng.randrange(0, 9))
        ]
        hashes = hash_full_blocks(prompt, BS)
        predicted = index.match(prompt_block_keys(prompt, BS), len(prompt))
        hit = pool.lookup(hashes, len(prompt))
        assert predicted.get("a", 0) == hit * BS
        cached = pool.cached_block_ids(hashes[:hit]) if hit else []
        pool.touch(cached)
        fresh = pool.allocate(len(hashes) - hit) if len(hashes) > hit else []
        now_cached = set(pool._cached)
        removed = sorted(seen - now_cached)
        events: list[object] = []
        if removed:
            events.append(BlockRemoved(block_hashes=tuple(removed)))
        for k, block_id in enumerate(fresh, start=hit):
            if pool.cache_block(block_id, hashes[k]):
                events.append(
                    stored(
                        prompt[k * BS : (k + 1) * BS],
                        [hashes[k]],
                        parent=hashes[k - 1] if k else None,
                    )
                )
        seen = set(pool._cached)
        index.apply("a", seq, batch(*events), now=0)
        pool.free(cached + fresh)

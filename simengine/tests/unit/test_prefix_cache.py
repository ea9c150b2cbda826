"""Tests for the KV block pool and its prefix cache (vLLM V1 semantics)."""

from __future__ import annotations

import random

import pytest

from simengine.domain.engine import Engine, EngineConfig, SimRequest
from simengine.domain.perf import PROFILES
from simengine.domain.prefix_cache import (
    NONE_HASH,
    BlockPool,
    hash_block_tokens,
    hash_full_blocks,
    max_cache_hit_blocks,
)

B = 16


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def compute_and_free(pool: BlockPool, token_ids: list[int]) -> list[int]:
    """Run one request through the pool: allocate, cache its full blocks, free."""
    hashes = hash_full_blocks(token_ids, B)
    hit_ids = pool.cached_block_ids(hashes, max_cache_hit_blocks(len(token_ids), B))
    pool.touch(hit_ids)
    need = -(-len(token_ids) // B) - len(hit_ids)
    block_ids = hit_ids + pool.allocate(need)
    for block_id, block_hash in zip(block_ids, hashes, strict=False):
        pool.cache_block(block_id, block_hash)
    pool.free(block_ids)
    return block_ids


def test_repeated_1000_token_prompt_hits_992_tokens() -> None:
    pool = BlockPool(100, B)
    prompt = tokens(1000)
    compute_and_free(pool, prompt)

    hit_blocks = pool.lookup(hash_full_blocks(prompt, B), num_tokens=1000)

    assert hit_blocks == 62
    assert hit_blocks * B == 992


def test_17_token_prompt_hits_16_after_the_first_run() -> None:
    pool = BlockPool(10, B)
    prompt = tokens(17)
    hashes = hash_full_blocks(prompt, B)

    assert pool.lookup(hashes, num_tokens=17) == 0
    compute_and_free(pool, prompt)
    assert pool.lookup(hashes, num_tokens=17) * B == 16


def test_last_token_is_always_recomputed() -> None:
    """A 32-token prompt has 2 full blocks but may hit only 1 (max (n-1)//B)."""
    pool = BlockPool(10, B)
    prompt = tokens(32)
    compute_and_free(pool, prompt)

    assert pool.lookup(hash_full_blocks(prompt, B), num_tokens=32) == 1
    assert pool.lookup(hash_full_blocks(prompt, B)) == 2  # uncapped walk


def test_partial_blocks_are_never_hashed_or_hit() -> None:
    pool = BlockPool(10, B)
    compute_and_free(pool, tokens(20))  # one full block + 4 tokens
    longer = tokens(40)

    assert len(hash_full_blocks(tokens(20), B)) == 1
    assert pool.num_cached_blocks == 1
    assert pool.lookup(hash_full_blocks(longer, B), num_tokens=40) == 1


def test_hash_chains_the_parent() -> None:
    """The same block content after a different prefix is a different block."""
    shared_block = tokens(B, start=5000)
    first = tokens(B, start=1000) + shared_block
    second = tokens(B, start=2000) + shared_block
    pool = BlockPool(10, B)
    compute_and_free(pool, [*first, 1])

    second_hashes = hash_full_blocks([*second, 1], B)

    assert hash_full_blocks(first, B)[1] != second_hashes[1]
    assert pool.lookup(second_hashes, num_tokens=len(second) + 1) == 0
    assert hash_full_blocks(first, B)[0] == hash_block_tokens(NONE_HASH, first[:B])


def test_free_appends_in_reverse_and_evicts_from_the_head() -> None:
    pool = BlockPool(5, B)  # blocks 1-4 usable
    prompt = tokens(33)  # 3 blocks, 2 full
    block_ids = compute_and_free(pool, prompt)
    hashes = hash_full_blocks(prompt, B)

    assert block_ids == [1, 2, 3]
    assert pool.free_queue() == [4, 3, 2, 1]  # freed last block first

    pool.allocate(3)  # pops 4, then 3 (unhashed), then 2: the prefix's tail

    assert pool.evictions == 1
    assert pool.block_hash(2) is None
    assert pool.lookup(hashes) == 1  # block 1, the prefix's head, survives
    assert pool.free_queue() == [1]


def test_touching_a_cached_block_takes_it_off_the_free_queue() -> None:
    pool = BlockPool(5, B)
    prompt = tokens(17)
    compute_and_free(pool, prompt)
    hit_ids = pool.cached_block_ids(hash_full_blocks(prompt, B))

    assert pool.num_evictable(hit_ids) == 1
    pool.touch(hit_ids)

    assert pool.ref_count(hit_ids[0]) == 1
    assert hit_ids[0] not in pool.free_queue()
    assert pool.num_evictable(hit_ids) == 0
    pool.touch(hit_ids)  # a second request shares it
    pool.free(hit_ids)
    assert hit_ids[0] not in pool.free_queue()
    pool.free(hit_ids)
    assert pool.free_queue()[-1] == hit_ids[0]


def test_usage_excludes_the_null_block_and_counts_cached_blocks_as_free() -> None:
    pool = BlockPool(11, B)  # 10 usable blocks
    block_ids = pool.allocate(4)

    assert pool.usage == pytest.approx(0.4)
    for block_id, block_hash in zip(block_ids, range(4), strict=True):
        pool.cache_block(block_id, block_hash)
    pool.free(block_ids)

    assert pool.usage == 0.0
    assert pool.num_cached_blocks == 4


def test_allocate_refuses_more_than_free() -> None:
    pool = BlockPool(4, B)

    with pytest.raises(ValueError, match="3 free"):
        pool.allocate(4)


def test_duplicate_content_is_cached_once() -> None:
    pool = BlockPool(10, B)
    first, second = pool.allocate(2)

    assert pool.cache_block(first, 123)
    assert not pool.cache_block(second, 123)
    assert pool.cached_block_ids([123]) == [first]


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(10, B, enable_caching=False)
    prompt = tokens(40)
    compute_and_free(pool, prompt)

    assert pool.lookup(hash_full_blocks(prompt, B), num_tokens=40) == 0


def test_engine_hits_never_exceed_queries() -> None:
    """GIVEN prompts that share system prompts of different lengths
    WHEN they run through an engine with a small pool (so blocks get evicted)
    THEN hits are positive and never more than queries."""
    rng = random.Random(0)
    profile = PROFILES["a100-8b"]
    engine = Engine(profile, EngineConfig.from_profile(profile, num_gpu_blocks=300))
    systems = [tokens(rng.randrange(20, 400), start=1000 + 7000 * i) for i in range(4)]
    now = 0.0
    for number in range(60):
        prompt = rng.choice(systems) + tokens(
            rng.randrange(1, 200), start=90_000 + number
        )
        engine.add_request(SimRequest(f"r{number}", prompt, output_len=8), now)
        while engine.has_work():
            now += engine.begin_step(now) or 0.0
            engine.end_step(now)
        assert engine.prefix_cache_hits <= engine.prefix_cache_queries

    assert engine.prefix_cache_hits > 0
    assert engine.block_pool.evictions > 0


def test_evicted_log_gets_each_hash_dropped_from_the_map_when_set() -> None:
    pool = BlockPool(4, 16)
    assert pool.evicted_log is None
    first = pool.allocate(3)
    for block_id, block_hash in zip(first, (101, 102, 103), strict=True):
        pool.cache_block(block_id, block_hash)
    pool.free(first)  # freed last block first: 103 is evicted first
    pool.evicted_log = []
    pool.allocate(2)
    assert pool.evicted_log == [103, 102]
    assert pool.num_cached_blocks == 1


def test_reset_logs_every_cached_hash() -> None:
    pool = BlockPool(4, 16)
    pool.evicted_log = []
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], 7)
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.evicted_log == [7]

"""The engine with SGLang's radix cache (``EngineConfig.cache = "radix"``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

import pytest

from simengine.domain.engine import (
    Engine,
    EngineConfig,
    EngineOverrides,
    FinishedRequest,
    SimRequest,
)
from simengine.domain.perf import PROFILES
from simengine.domain.radix_cache import RadixCache
from simengine.domain.tokens import output_token_ids, request_seed

A100 = PROFILES["a100-8b"]


def engine_with(kind: str, **overrides: Unpack[EngineOverrides]) -> Engine:
    """An a100-8b engine with the ``kind`` of cache, without jitter."""
    options: EngineOverrides = {"cache": kind, **overrides}
    config = EngineConfig.from_profile(A100, **options)
    return Engine(A100, config, seed=0, jitter_cv=0.0)


def run_until_idle(engine: Engine, now: float = 0.0) -> list[FinishedRequest]:
    finished = []
    while (duration := engine.begin_step(now)) is not None:
        now += duration
        finished.extend(engine.end_step(now).finished)
    return finished


def ask(engine: Engine, request_id: str, prompt: Sequence[int], output_len: int) -> int:
    """Run one request alone to its end; return its cached tokens."""
    engine.add_request(SimRequest(request_id, list(prompt), output_len), 0.0)
    [done] = run_until_idle(engine)
    return done.cached_tokens


def cached_prefix(tree: RadixCache, key: Sequence[int]) -> int:
    """How many leading tokens of ``key`` the tree holds (read only: no split, no
    touch, unlike ``match_prefix``)."""
    node, matched = tree.root, 0
    while matched < len(key):
        child = node.children.get(key[matched])
        if child is None:
            return matched
        edge = child.key
        n = 0
        while n < len(edge) and matched + n < len(key) and edge[n] == key[matched + n]:
            n += 1
        matched += n
        if n < len(edge):
            return matched
        node = child
    return matched


def conversations(n: int, turns: int) -> list[tuple[str, list[int], int]]:
    """Chat sessions sharing a long system prompt: each turn sends the previous
    prompt, the previous reply (the ids the engine generated) and a new question."""
    system = list(range(5000, 5000 + 733))  # not a multiple of 16
    requests = []
    for c in range(n):
        prompt = [*system, *range(9000 + 100 * c, 9000 + 100 * c + 5 + c)]
        for t in range(turns):
            request_id = f"c{c}-t{t}"
            output_len = 7 + 3 * t + c
            requests.append((request_id, list(prompt), output_len))
            reply = output_token_ids(request_seed(request_id), 0, output_len)
            question = range(20000 + 1000 * c + 50 * t, 20000 + 1000 * c + 50 * t + 9)
            prompt = [*prompt, *reply, *question]
    return requests


def test_radix_reuses_at_least_the_block_cache_and_less_than_a_block_more() -> None:
    """GIVEN conversations sharing a 733-token system prompt, turn after turn
    WHEN the block engine and the radix engine answer the same requests in turn
    THEN per request the radix hit is at least the block hit, by less than a
    block (16 tokens), and strictly more over the workload."""
    block, radix = engine_with("block"), engine_with("radix")
    more = 0
    for request_id, prompt, output_len in conversations(4, 4):
        got_block = ask(block, request_id, prompt, output_len)
        got_radix = ask(radix, request_id, prompt, output_len)
        assert got_block <= got_radix < got_block + 16, request_id
        more += got_radix - got_block
    assert more > 0
    assert radix.prefix_cache_hits - block.prefix_cache_hits == more


def test_a_request_never_reuses_its_last_prompt_token() -> None:
    """GIVEN a prompt already answered (so the tree holds it all, and its reply)
    WHEN the same prompt, then a prefix of it, is asked again
    THEN each reuses all of its prompt but the last token, which is recomputed."""
    engine = engine_with("radix")
    prompt = list(range(100, 400))
    assert ask(engine, "first", prompt, 5) == 0
    assert ask(engine, "again", prompt, 5) == len(prompt) - 1
    assert ask(engine, "prefix", prompt[:37], 5) == 36
    assert engine.prefix_cache_hits == len(prompt) - 1 + 36


def test_locked_tokens_are_never_evicted() -> None:
    """GIVEN a pool of 256 tokens, a 100-token prompt cached, and a request running
    on it (its match locked)
    WHEN unrelated requests fill the pool, forcing evictions
    THEN the running request's 100 tokens stay in the tree at every step while
    other tokens are evicted."""
    engine = engine_with("radix", num_gpu_blocks=17, max_model_len=256)
    assert engine.max_total_num_tokens == 256
    shared = list(range(1000, 1100))
    assert ask(engine, "warm", shared, 2) == 0
    engine.add_request(SimRequest("held", [*shared, *range(7000, 7010)], 60), 0.0)
    now = 0.0
    others = 0
    tree = engine.radix_cache
    assert tree is not None
    held_cached = None
    while (duration := engine.begin_step(now)) is not None:
        if held_cached is None:
            held_cached = engine.cached_tokens("held")
        assert cached_prefix(tree, shared) == 100
        assert tree.total_size == tree.evictable_size + tree.protected_size
        now += duration
        output = engine.end_step(now)
        if others < 6 and engine.num_waiting == 0:
            start = 30000 + 1000 * others
            engine.add_request(
                SimRequest(f"other-{others}", list(range(start, start + 90)), 3), now
            )
            others += 1
        if any(done.request_id == "held" for done in output.finished):
            break
    assert held_cached == 100
    assert tree.evicted_tokens > 0
    assert engine.num_preemptions == 0


def test_token_usage_counts_cached_idle_tokens_as_free() -> None:
    """GIVEN a radix engine
    WHEN a request runs, then finishes and leaves its tokens in the tree
    THEN usage is the running request's tokens over the pool, then 0 with the
    tokens still cached (SGLang: max_total - available - evictable)."""
    engine = engine_with("radix")
    engine.add_request(SimRequest("r", list(range(500)), 50), 0.0)
    now = engine.begin_step(0.0) or 0.0
    engine.end_step(now)
    assert engine.num_used_tokens == 500
    assert engine.kv_cache_usage_perc == pytest.approx(
        500 / engine.max_total_num_tokens
    )
    run_until_idle(engine, now)
    tree = engine.radix_cache
    assert tree is not None and tree.total_size == 500 + 49
    assert engine.num_used_tokens == 0
    assert engine.kv_cache_usage_perc == 0.0


def test_without_radix_caching_nothing_is_reused_or_kept() -> None:
    """GIVEN the radix engine with prefix caching off (--disable-radix-cache)
    WHEN one prompt is asked twice
    THEN neither reuses anything and no tree is kept."""
    engine = engine_with("radix", enable_prefix_caching=False)
    prompt = list(range(300))
    assert ask(engine, "a", prompt, 4) == ask(engine, "b", prompt, 4) == 0
    assert engine.radix_cache is None
    assert engine.num_used_tokens == 0


def test_an_aborted_request_gives_back_its_tokens_and_lock() -> None:
    """GIVEN a running request on a cached prefix
    WHEN it is aborted
    THEN no token stays in use and the prefix is evictable again."""
    engine = engine_with("radix")
    prompt = list(range(200))
    ask(engine, "warm", prompt, 2)
    engine.add_request(SimRequest("x", [*prompt, 9, 9, 9], 100), 0.0)
    now = engine.begin_step(0.0) or 0.0
    engine.end_step(now)
    tree = engine.radix_cache
    assert tree is not None and tree.protected_size > 0
    assert engine.abort("x", now) is not None
    assert engine.num_used_tokens == 0
    assert tree.protected_size == 0


def test_radix_cache_refuses_the_host_tier_and_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="cache='block'"):
        EngineConfig.from_profile(A100, cache="radix", kv_offloading_size=1.0)
    with pytest.raises(ValueError, match="cache must be one of"):
        EngineConfig.from_profile(A100, cache="paged")

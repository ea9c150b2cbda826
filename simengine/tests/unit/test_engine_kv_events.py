"""The engine's KV events: what vLLM's block pool would publish, step by step."""

from __future__ import annotations

from simengine.domain.engine import Engine, EngineConfig, SimRequest, StepOutput
from simengine.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from simengine.domain.perf import PROFILES
from simengine.domain.prefix_cache import hash_full_blocks
from simengine.domain.tokens import output_token_ids, request_seed

A100 = PROFILES["a100-8b"]


def engine(*, events: bool = True, num_gpu_blocks: int = 5) -> Engine:
    config = EngineConfig.from_profile(
        A100, block_size=4, num_gpu_blocks=num_gpu_blocks, enable_kv_events=events
    )
    return Engine(A100, config, jitter_cv=0.0)


def serve(eng: Engine, request: SimRequest) -> list[list[KVEvent]]:
    """Run ``request`` alone to its end; return each step's events."""
    eng.add_request(request, 0.0)
    batches = []
    now = 0.0
    while (duration := eng.begin_step(now)) is not None:
        now += duration
        output: StepOutput = eng.end_step(now)
        batches.append(output.kv_events)
    return batches


def test_engine_emits_stores_hits_evictions_and_a_clear() -> None:
    """GIVEN a 4-block pool of 4-token blocks
    WHEN A runs, B shares A's first two blocks, C (all new) needs every block,
    and the cache is reset
    THEN A stores 2 blocks, B only its third (chained to A's second), C evicts
    B's and A's hashed blocks (head of the free queue first) before storing, and
    the reset clears all."""
    eng = engine()
    a = list(range(100, 110))
    b = [*a[:8], 7, 7, 7, 7, 7]
    c = list(range(200, 213))
    ha, hb, hc = (hash_full_blocks(p, 4) for p in (a, b, c))
    assert ha == hb[:2]

    assert serve(eng, SimRequest("a", a, 1)) == [
        [BlockStored(tuple(ha), None, tuple(a[:8]), 4)]
    ]
    assert serve(eng, SimRequest("b", b, 1)) == [
        [BlockStored((hb[2],), hb[1], tuple(b[8:12]), 4)]
    ]
    assert serve(eng, SimRequest("c", c, 1)) == [
        [
            BlockRemoved((hb[2],)),
            BlockRemoved((ha[1],)),
            BlockRemoved((ha[0],)),
            BlockStored(tuple(hc), None, tuple(c[:12]), 4),
        ]
    ]
    assert eng.reset_prefix_cache()
    assert eng.take_kv_events() == [AllBlocksCleared()]
    assert eng.take_kv_events() == []


def test_engine_stores_output_blocks_with_the_generated_tokens() -> None:
    eng = engine(num_gpu_blocks=8)
    prompt = [5, 6, 7, 8, 9]
    batches = serve(eng, SimRequest("r", prompt, 8))
    stored = [e for batch in batches for e in batch]
    tokens = prompt + output_token_ids(request_seed("r"), 0, 8)
    hashes = hash_full_blocks(tokens[:12], 4)
    # The prompt's block at prefill, then one block per 4 computed tokens.
    assert stored == [
        BlockStored((hashes[0],), None, tuple(tokens[:4]), 4),
        BlockStored((hashes[1],), hashes[0], tuple(tokens[4:8]), 4),
        BlockStored((hashes[2],), hashes[1], tuple(tokens[8:12]), 4),
    ]


def test_engine_records_nothing_with_events_off() -> None:
    eng = engine(events=False)
    batches = serve(eng, SimRequest("a", list(range(100, 110)), 1))
    assert batches == [[]]
    assert eng.reset_prefix_cache()
    assert eng.take_kv_events() == []

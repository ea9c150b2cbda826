"""Tests for the engine's CPU offload tier (``EngineConfig.kv_offloading_size``)."""

from __future__ import annotations

import math

import pytest

from simengine.domain.engine import Engine, EngineConfig, SimRequest, StepOutput
from simengine.domain.perf import PROFILES, step_time_ms

A100 = PROFILES["a100-8b"]


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def engine(offload_gib: float | None, *, caching: bool = True) -> Engine:
    """A quiet a100-8b engine with 39 usable GPU blocks of 16 tokens."""
    config = EngineConfig.from_profile(
        A100,
        num_gpu_blocks=40,
        kv_offloading_size=offload_gib,
        enable_prefix_caching=caching,
    )
    return Engine(A100, config, seed=0, jitter_cv=0.0)


def run(eng: Engine, now: float = 0.0) -> tuple[float, list[StepOutput]]:
    outputs = []
    while (duration := eng.begin_step(now)) is not None:
        now += duration
        outputs.append(eng.end_step(now))
    return now, outputs


def evict_then_resend(eng: Engine) -> tuple[float, int]:
    """Run a 320-token prompt, a 480-token one that evicts its tail from the GPU,
    then the first prompt again; return the last one's first step (s) and its
    cached tokens."""
    eng.add_request(SimRequest("a", prompt(320), output_len=1), 0.0)
    now, _ = run(eng)
    eng.add_request(SimRequest("b", prompt(480, start=50_000), output_len=1), now)
    now, _ = run(eng, now)
    eng.add_request(SimRequest("a2", prompt(320), output_len=1), now)
    duration = eng.begin_step(now)
    assert duration is not None
    cached = eng.cached_tokens("a2")
    assert cached is not None
    out = eng.end_step(now + duration)
    assert [f.cached_tokens for f in out.finished] == [cached]
    return duration, cached


def test_without_offload_the_evicted_tail_is_prefilled_again() -> None:
    eng = engine(None)
    _, cached = evict_then_resend(eng)

    # b took the 19 never-used blocks, then a's blocks 20..10 (its tail first).
    assert cached == 9 * 16
    assert eng.host_cache is None
    assert (eng.host_cache_queries, eng.host_cache_hits) == (0, 0)
    assert eng.prompt_tokens_cached_host == 0


def test_the_host_tier_gives_back_what_the_gpu_evicted() -> None:
    eng = engine(1.0)
    host = eng.host_cache
    assert host is not None and host.num_blocks == 512  # 1 GiB / (16 * 128 KiB)
    duration, cached = evict_then_resend(eng)

    # GPU: blocks 1-9; host: 10-19 (the 20th holds the last token: recomputed).
    assert cached == 19 * 16
    assert (eng.prefix_cache_queries, eng.prefix_cache_hits) == (1120, 144)
    # vLLM's connector stats: queries = tokens past the GPU hit, hits = loaded.
    assert (eng.host_cache_queries, eng.host_cache_hits) == (320 + 480 + 176, 160)
    assert (eng.prompt_tokens_cached, eng.prompt_tokens_cached_host) == (304, 160)
    assert host.blocks_loaded == 10
    # The step prefills 16 tokens over 304 and pays the load as device time.
    load_ms = 160 * A100.host_load_us_per_token / 1000
    expected_ms = (
        step_time_ms(A100, decode_seqs=0, kv_tokens=0, prefill_chunks=[(16, 304)])
        + load_ms
    )
    assert math.isclose(duration * 1000, expected_ms, rel_tol=1e-12)
    # The loaded blocks are back in the GPU prefix cache for the next request.
    eng.add_request(SimRequest("a3", prompt(320), output_len=1), 10.0)
    assert eng.begin_step(10.0) is not None
    assert eng.cached_tokens("a3") == 304
    assert eng.host_cache_hits == 160  # nothing more came from the host


def test_off_and_unused_offload_give_the_same_steps() -> None:
    """A host tier nothing hits (distinct prompts, no preemption) changes neither
    the schedule nor the step times."""

    def trace(offload: float | None) -> list[tuple[float, int]]:
        config = EngineConfig.from_profile(A100, kv_offloading_size=offload)
        eng = Engine(A100, config, seed=0, jitter_cv=0.0)
        for k in range(6):
            eng.add_request(
                SimRequest(
                    f"r{k}", prompt(100 + 30 * k, start=10_000 * (k + 1)), output_len=20
                ),
                0.0,
            )
        _, outputs = run(eng)
        return [(o.finished_at, o.num_tokens) for o in outputs]

    assert trace(None) == trace(1.0)


def test_answer_blocks_are_stored_once_computed() -> None:
    eng = engine(1.0)
    eng.add_request(SimRequest("a", prompt(32), output_len=33), 0.0)
    run(eng)

    # 32 prompt tokens + 32 computed answer tokens (the last one never is).
    host = eng.host_cache
    assert host is not None
    assert (len(host), host.blocks_stored) == (4, 4)


def test_the_host_tier_works_with_prefix_caching_off() -> None:
    eng = engine(1.0, caching=False)
    eng.add_request(SimRequest("a", prompt(320), output_len=1), 0.0)
    now, _ = run(eng)
    eng.add_request(SimRequest("a2", prompt(320), output_len=1), now)
    run(eng, now)

    assert (eng.prefix_cache_queries, eng.prefix_cache_hits) == (0, 0)
    assert (eng.host_cache_queries, eng.host_cache_hits) == (640, 304)
    assert eng.prompt_tokens_cached == 304


def test_a_small_host_tier_keeps_the_most_recent_blocks() -> None:
    # 3 blocks of 16 tokens * 128 KiB.
    eng = engine(3 * 16 * 131_072 / (1 << 30))
    eng.add_request(SimRequest("a", prompt(320), output_len=1), 0.0)
    now, _ = run(eng)
    host = eng.host_cache
    assert host is not None and len(host) == 3
    assert host.evictions == 17
    # Only a's last three blocks are left: the run from block 0 misses.
    eng.add_request(SimRequest("b", prompt(480, start=50_000), output_len=1), now)
    now, _ = run(eng, now)
    eng.add_request(SimRequest("a2", prompt(320), output_len=1), now)
    run(eng, now)
    assert eng.host_cache_hits == 0


def test_tensor_parallel_ranks_split_the_offload_size() -> None:
    tp4 = PROFILES["h100-70b-tp4"]
    eng = Engine(tp4, EngineConfig.from_profile(tp4, kv_offloading_size=1.0))

    host = eng.host_cache
    assert host is not None
    assert host.num_blocks == (1 << 30) // (16 * 81_920 * 4)


@pytest.mark.parametrize("size", [0, 0.0, -1.0, math.nan, math.inf, True, "1"])
def test_offload_size_must_be_a_positive_number(size: object) -> None:
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig.from_profile(A100, kv_offloading_size=size)  # type: ignore[arg-type]


def test_an_offload_size_below_one_block_is_refused() -> None:
    config = EngineConfig.from_profile(A100, kv_offloading_size=1e-6)
    with pytest.raises(ValueError, match="holds no KV block"):
        Engine(A100, config)


def test_a_preempted_request_reloads_from_the_host_tier_uncounted() -> None:
    # Two long requests in a 39-block pool: one is preempted while both decode.
    eng = engine(1.0)
    eng.add_request(SimRequest("a", prompt(288), output_len=60), 0.0)
    eng.add_request(SimRequest("b", prompt(288, start=50_000), output_len=60), 0.0)
    _, outputs = run(eng)

    assert eng.num_preemptions > 0
    host = eng.host_cache
    assert host is not None and host.blocks_loaded > 0
    # First admissions only: both prompts were queried in full and missed.
    assert (eng.host_cache_queries, eng.host_cache_hits) == (576, 0)
    assert sum(len(o.finished) for o in outputs) == 2

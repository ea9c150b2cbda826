"""Tests for the vLLM V1 step loop of a simulated replica."""

from __future__ import annotations

from collections import defaultdict
from typing import Unpack

import pytest

from simengine.domain.engine import (
    Engine,
    EngineConfig,
    EngineOverrides,
    FinishedRequest,
    SimRequest,
    StepOutput,
)
from simengine.domain.perf import PROFILES, step_time_ms
from simengine.domain.tokens import output_token_ids, request_seed

A100 = PROFILES["a100-8b"]


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def quiet_engine(**overrides: Unpack[EngineOverrides]) -> Engine:
    """An a100-8b engine without jitter, so step times are exact."""
    config = EngineConfig.from_profile(A100, **overrides)
    return Engine(A100, config, seed=0, jitter_cv=0.0)


def run(engine: Engine, now: float = 0.0) -> tuple[float, list[StepOutput]]:
    """Step the engine until idle; return the end time and every step's output."""
    outputs = []
    while (duration := engine.begin_step(now)) is not None:
        now += duration
        outputs.append(engine.end_step(now))
    return now, outputs


def run_steps(engine: Engine, now: float, n: int) -> tuple[float, list[StepOutput]]:
    """Run exactly ``n`` steps from ``now``."""
    outputs = []
    for _ in range(n):
        now += begin(engine, now)
        outputs.append(engine.end_step(now))
    return now, outputs


def begin(engine: Engine, now: float) -> float:
    """Begin a step of an engine that has work; return the step's duration."""
    duration = engine.begin_step(now)
    assert duration is not None, "the engine had no work"
    return duration


def first_token_at(done: FinishedRequest) -> float:
    assert done.first_token_at is not None, f"{done.request_id} never emitted"
    return done.first_token_at


def finished(outputs: list[StepOutput]) -> dict[str, FinishedRequest]:
    return {f.request_id: f for out in outputs for f in out.finished}


def test_config_from_profile_takes_limits_and_overrides() -> None:
    config = EngineConfig.from_profile(A100, max_num_seqs=4)

    assert (config.max_num_seqs, config.max_num_batched_tokens) == (4, 2048)
    assert (config.num_gpu_blocks, config.block_size) == (26_000, 16)
    with pytest.raises(TypeError, match="bogus"):
        # No such field: the checker refuses it, and so must the run-time check.
        EngineConfig.from_profile(A100, bogus=1)  # type: ignore[call-arg]


def test_single_stream_decodes_at_10_6_ms_per_token() -> None:
    engine = quiet_engine()
    engine.add_request(SimRequest("a", prompt(1000), output_len=21), 0.0)
    _, outputs = run(engine)

    done = finished(outputs)["a"]
    tpot_ms = (done.finished_at - first_token_at(done)) * 1000 / 20
    decode_steps_ms = [(o.finished_at - o.started_at) * 1000 for o in outputs[1:]]
    assert tpot_ms == pytest.approx(10.6, abs=0.05)
    assert all(s == pytest.approx(10.61, abs=0.01) for s in decode_steps_ms)


def test_ttft_of_a_650_token_prompt_is_48_ms() -> None:
    engine = quiet_engine()
    engine.add_request(SimRequest("a", prompt(650), output_len=2), 1.0)
    _, outputs = run(engine, now=1.0)

    done = finished(outputs)["a"]
    assert done.scheduled_at == 1.0
    assert (first_token_at(done) - done.arrived_at) * 1000 == pytest.approx(47.946425)
    assert outputs[0].num_tokens == 650
    assert [t.index for t in outputs[0].tokens] == [0]


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    engine = quiet_engine()
    engine.add_request(SimRequest("a", prompt(5000), output_len=2), 0.0)
    _, outputs = run(engine)

    assert [o.num_tokens for o in outputs] == [2048, 2048, 904, 1]
    assert [len(o.tokens) for o in outputs] == [0, 0, 1, 1]
    chunks = [(2048, 0), (2048, 2048), (904, 4096)]
    for out, chunk in zip(outputs, chunks, strict=False):
        expected_ms = step_time_ms(
            A100, decode_seqs=0, kv_tokens=0, prefill_chunks=[chunk]
        )
        assert (out.finished_at - out.started_at) * 1000 == pytest.approx(expected_ms)
    assert engine.prompt_tokens_computed == 5000


def test_decodes_share_a_step_with_a_prefill_chunk() -> None:
    engine = quiet_engine()
    engine.add_request(SimRequest("a", prompt(100), output_len=50), 0.0)
    now, _ = run_steps(engine, 0.0, 3)
    engine.add_request(SimRequest("b", prompt(3000, start=9000), output_len=5), now)

    duration = begin(engine, now)
    out = engine.end_step(now + duration)

    assert out.num_tokens == 2048  # 1 decode + 2047 prompt tokens of b
    assert [t.request_id for t in out.tokens] == ["a"]


def test_max_num_seqs_caps_running_and_the_rest_wait() -> None:
    engine = quiet_engine(max_num_seqs=4)
    for i in range(10):
        engine.add_request(SimRequest(f"r{i}", prompt(50, 1000 + 100 * i), 3), 0.0)

    engine.begin_step(0.0)

    assert (engine.num_running, engine.num_waiting) == (4, 6)
    engine.end_step(0.1)
    _, outputs = run(engine, 0.1)
    assert all(o.num_tokens <= 4 * 50 for o in outputs)
    assert len(finished(outputs)) == 10


def test_preemption_recomputes_and_every_request_finishes() -> None:
    """GIVEN a pool of 19 usable blocks and 4 requests that need 13 blocks each
    WHEN they run to completion
    THEN requests get preempted, yet each emits exactly output_len tokens, in order."""
    engine = quiet_engine(num_gpu_blocks=20)
    for i in range(4):
        engine.add_request(SimRequest(f"r{i}", prompt(100, 1000 + 500 * i), 100), 0.0)
    _, outputs = run(engine)

    indices: dict[str, list[int]] = defaultdict(list)
    for out in outputs:
        for token in out.tokens:
            indices[token.request_id].append(token.index)
    done = finished(outputs)
    assert engine.num_preemptions > 0
    assert sum(o.num_preemptions for o in outputs) == engine.num_preemptions
    assert sum(f.num_preemptions for f in done.values()) == engine.num_preemptions
    assert {r: idx == list(range(100)) for r, idx in indices.items()} == {
        f"r{i}": True for i in range(4)
    }
    assert all(f.output_tokens == 100 for f in done.values())
    assert engine.generation_tokens == 400
    assert engine.prompt_tokens_computed > 400  # recomputation after preemption
    assert engine.kv_cache_usage_perc == 0.0
    assert engine.tokens_in_flight() == 0


def test_preempted_request_goes_to_the_front_of_waiting() -> None:
    engine = quiet_engine(num_gpu_blocks=20)
    for i in range(3):
        engine.add_request(SimRequest(f"r{i}", prompt(100, 1000 + 500 * i), 200), 0.0)
    now = 0.0
    while engine.num_preemptions == 0:
        now += begin(engine, now)
        engine.end_step(now)

    assert engine._waiting[0].request_id == "r1"  # the last runner, not r2


def test_abort_mid_step_frees_blocks_and_emits_nothing_more() -> None:
    engine = quiet_engine()
    engine.add_request(SimRequest("a", prompt(100), output_len=50), 0.0)
    engine.add_request(SimRequest("b", prompt(100, 5000), output_len=50), 0.0)
    now, _ = run_steps(engine, 0.0, 3)
    usage_both = engine.kv_cache_usage_perc

    duration = begin(engine, now)
    aborted = engine.abort("a", now + duration / 2)
    out = engine.end_step(now + duration)

    assert aborted is not None
    assert (aborted.finish_reason, aborted.output_tokens) == ("abort", 3)
    assert [t.request_id for t in out.tokens] == ["b"]
    assert engine.kv_cache_usage_perc == pytest.approx(usage_both / 2)
    _, rest = run(engine, now + duration)
    assert {t.request_id for o in rest for t in o.tokens} == {"b"}
    assert engine.abort("a", 9.0) is None


def test_abort_of_a_waiting_request() -> None:
    engine = quiet_engine()
    engine.add_request(SimRequest("a", prompt(10), output_len=5), 0.0)

    done = engine.abort("a", 0.5)

    assert done is not None
    assert (done.scheduled_at, done.first_token_at, done.finished_at) == (
        None,
        None,
        0.5,
    )
    assert not engine.has_work()
    assert engine.begin_step(1.0) is None


def test_same_seed_gives_the_same_run() -> None:
    def trace(seed: int) -> list[tuple[float, list[tuple[str, int]]]]:
        engine = Engine(A100, seed=seed)
        for i in range(20):
            engine.add_request(SimRequest(f"r{i}", prompt(300, 1000 + 999 * i), 40), 0)
        _, outputs = run(engine)
        return [
            (o.finished_at, [(t.request_id, t.index) for t in o.tokens])
            for o in outputs
        ]

    assert trace(7) == trace(7)
    assert trace(7) != trace(8)


def test_second_identical_prompt_reports_cached_tokens() -> None:
    engine = quiet_engine()
    engine.add_request(SimRequest("a", prompt(1000), output_len=3), 0.0)
    now, first = run(engine)
    engine.add_request(SimRequest("b", prompt(1000), output_len=3), now)

    assert engine.cached_tokens("b") is None  # not scheduled yet
    now += begin(engine, now)
    assert engine.cached_tokens("b") == 992
    engine.end_step(now)
    _, second = run(engine, now)

    assert finished(first)["a"].cached_tokens == 0
    assert finished(second)["b"].cached_tokens == 992
    assert (engine.prefix_cache_queries, engine.prefix_cache_hits) == (2000, 992)


def test_cache_hit_shortens_ttft() -> None:
    engine = quiet_engine()
    engine.add_request(SimRequest("a", prompt(1000), output_len=2), 0.0)
    now, first = run(engine)
    engine.add_request(SimRequest("b", prompt(1000), output_len=2), now)
    _, second = run(engine, now)

    ttft_a = first_token_at(finished(first)["a"]) - 0.0
    ttft_b = first_token_at(finished(second)["b"]) - now
    assert ttft_a * 1000 == pytest.approx(0.5 + 72.0 + 3.06e-6 * 500_000)
    assert ttft_b * 1000 == pytest.approx(10.5 + 3.06e-6 * 8 * (992 + 4))


def test_next_turn_hits_the_previous_reply() -> None:
    """Output blocks are hashed with the ids the streamed text re-encodes to."""
    engine = quiet_engine()
    first_prompt = prompt(100)
    engine.add_request(SimRequest("turn-1", first_prompt, output_len=50), 0.0)
    now, _ = run(engine)
    reply = output_token_ids(request_seed("turn-1"), 0, 50)
    engine.add_request(
        SimRequest("turn-2", first_prompt + reply + prompt(30, 7), 5), now
    )
    run(engine, now)

    # KV of turn 1 = 100 prompt + 49 computed output tokens = 9 full blocks
    assert engine.prefix_cache_hits == 144


def test_caching_can_be_disabled() -> None:
    engine = quiet_engine(enable_prefix_caching=False)
    for name in ("a", "b"):
        engine.add_request(SimRequest(name, prompt(500), output_len=2), 0.0)
        run(engine)

    assert engine.prefix_cache_queries == engine.prefix_cache_hits == 0
    assert engine.block_pool.num_cached_blocks == 0


def test_finish_reason_and_tokens_in_flight() -> None:
    engine = quiet_engine()
    engine.add_request(SimRequest("a", prompt(10), 4, finish_reason="stop"), 0.0)
    engine.add_request(SimRequest("b", prompt(20, 50), 6), 0.0)

    assert engine.tokens_in_flight() == 14 + 26
    run_steps(engine, 0.0, 2)
    assert engine.tokens_in_flight() == 40 - 4
    _, outputs = run(engine, 1.0)
    assert finished(outputs)["a"].finish_reason == "stop"
    assert finished(outputs)["b"].finish_reason == "length"
    assert engine.tokens_in_flight() == 0


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (SimRequest("x", prompt(8000), output_len=200), "max_model_len"),
        (SimRequest("x", [], output_len=2), "at least one token"),
        (SimRequest("x", prompt(5), output_len=0), "output_len"),
        (
            SimRequest("x", prompt(5), output_len=2, finish_reason="eos"),
            "finish_reason",
        ),
    ],
)
def test_add_request_rejects_invalid_requests(
    request_: SimRequest, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        quiet_engine().add_request(request_, 0.0)


def test_add_request_rejects_duplicates_and_requests_larger_than_the_pool() -> None:
    engine = quiet_engine(num_gpu_blocks=5)
    engine.add_request(SimRequest("x", prompt(5), 2), 0.0)

    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request(SimRequest("x", prompt(5), 2), 0.0)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(SimRequest("y", prompt(60), 10), 0.0)


def test_step_calls_must_alternate() -> None:
    engine = quiet_engine()
    with pytest.raises(RuntimeError, match="no step"):
        engine.end_step(0.0)
    engine.add_request(SimRequest("a", prompt(5), 2), 0.0)
    engine.begin_step(0.0)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.begin_step(0.0)


def test_prompt_counters_count_whole_prompts_once_prefilled() -> None:
    engine = quiet_engine(block_size=16)
    engine.add_request(SimRequest("a", prompt(100), output_len=3), 0.0)
    now, _ = run(engine)
    engine.add_request(SimRequest("b", prompt(100), output_len=3), now)
    run(engine, now)

    # b hit the 6 full blocks a left: 96 tokens, counted once with its prompt.
    assert engine.prompt_tokens_total == 200
    assert engine.prompt_tokens_cached == 96
    assert engine.prompt_tokens_computed == 200 - 96


def test_a_step_pays_per_prefill_chunk() -> None:
    profile = PROFILES["cpu-tiny"]
    engine = Engine(profile, EngineConfig.from_profile(profile), jitter_cv=0.0)
    engine.add_request(SimRequest("a", prompt(300), output_len=2), 0.0)
    engine.add_request(SimRequest("b", prompt(200, start=5000), output_len=2), 0.0)

    duration = begin(engine, 0.0)

    expected_ms = step_time_ms(
        profile, decode_seqs=0, kv_tokens=0, prefill_chunks=[(300, 0), (200, 0)]
    )
    assert duration * 1000 == pytest.approx(expected_ms)
    assert expected_ms > 2 * profile.p_ms

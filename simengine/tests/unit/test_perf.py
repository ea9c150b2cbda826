"""Tests for the step-time model and the replica profiles."""

from __future__ import annotations

import random
import statistics

import pytest

from simengine.domain.perf import (
    DEFAULT_PROFILE,
    PROFILES,
    PerfProfile,
    jitter_factor,
    step_time_from_totals_ms,
    step_time_ms,
)

A100 = PROFILES["a100-8b"]


def test_single_decode_at_1k_context_is_10_6_ms() -> None:
    # a + W + b + k_kv·ctx = 0.5 + 10 + 0.02 + 0.094e-3·1024
    t_ms = step_time_ms(A100, decode_seqs=1, kv_tokens=1024)

    assert t_ms == pytest.approx(10.616256)


def test_prefill_of_650_tokens_is_48_ms() -> None:
    # a + c_tok·650 + k_att·650·(0 + 325) = 0.5 + 46.8 + 0.646425
    t_ms = step_time_ms(A100, decode_seqs=0, kv_tokens=0, prefill_chunks=[(650, 0)])

    assert t_ms == pytest.approx(47.946425)


def test_mixed_step_adds_every_term() -> None:
    # 64 decodes at ctx 1000 plus a 512-token chunk over 1,536 cached tokens:
    # N = 576 → 0.072·576 = 41.472 > W; b·64 = 1.28; k_kv·64,000 = 6.016;
    # k_att·512·(1536 + 256) = 3.06e-6·917,504 = 2.80756224
    t_ms = step_time_ms(
        A100, decode_seqs=64, kv_tokens=64_000, prefill_chunks=[(512, 1536)]
    )

    assert t_ms == pytest.approx(0.5 + 41.472 + 1.28 + 6.016 + 2.80756224)


def test_small_batches_pay_the_weight_floor() -> None:
    # 100 tokens · 0.072 = 7.2 ms < W = 10 ms: memory-bound
    t_ms = step_time_ms(A100, decode_seqs=100, kv_tokens=0)

    assert t_ms == pytest.approx(0.5 + 10.0 + 2.0)


def test_totals_form_matches_chunk_form() -> None:
    chunks = [(300, 0), (128, 2000)]
    work = 300 * 150 + 128 * (2000 + 64)

    assert step_time_from_totals_ms(
        A100, decode_seqs=7, kv_tokens=7000, prefill_tokens=428, prefill_work=work
    ) == pytest.approx(
        step_time_ms(A100, decode_seqs=7, kv_tokens=7000, prefill_chunks=chunks)
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a100-8b", (0.5, 10.0, 0.072, 0.02, 0.094, 3.06e-6, 26_000, 2048, 256, 1)),
        ("h100-8b", (0.6, 6.0, 0.022, 0.02, 0.056, 9.6e-7, 26_000, 8192, 1024, 1)),
        (
            "h100-70b-tp4",
            (1.5, 16.4, 0.054, 0.02, 0.034, 1.2e-6, 25_000, 8192, 1024, 4),
        ),
        (
            "h100-70b-int8-tp2",
            (1.4, 15.6, 0.054, 0.02, 0.068, 2.4e-6, 13_542, 8192, 1024, 2),
        ),
    ],
)
def test_profiles_carry_the_spec_constants(
    name: str, expected: tuple[float | int, ...]
) -> None:
    p = PROFILES[name]

    assert (
        p.a_ms,
        p.w_ms,
        p.ctok_ms,
        p.b_ms,
        p.kkv_us,
        p.katt,
        p.num_gpu_blocks,
        p.max_num_batched_tokens,
        p.max_num_seqs,
        p.gpus,
    ) == expected
    assert p.name == name
    assert p.block_size == 16
    assert p.description


def test_each_prefill_chunk_pays_the_per_chunk_cost() -> None:
    profile = PROFILES["cpu-tiny"]
    one = step_time_ms(profile, decode_seqs=4, kv_tokens=0, prefill_chunks=[(64, 0)])
    two = step_time_ms(
        profile, decode_seqs=4, kv_tokens=0, prefill_chunks=[(32, 0), (32, 0)]
    )
    # Same tokens; the second chunk adds p and its smaller attention work.
    work_delta = profile.katt * (32 * 16 * 2 - 64 * 32)

    assert two - one == pytest.approx(profile.p_ms + work_delta)
    assert PROFILES["a100-8b"].p_ms == 0.0


def test_cpu_tiny_is_the_vllm_cpu_server_it_was_fitted_to() -> None:
    profile = PROFILES["cpu-tiny"]

    assert (profile.block_size, profile.num_gpu_blocks) == (128, 1024)
    assert (profile.max_num_seqs, profile.max_num_batched_tokens) == (32, 2048)
    # No weight-read floor on CPU: the step grows from the first token.
    assert profile.w_ms == profile.ctok_ms
    assert "bench/vllm_fidelity.py" in profile.description
    # A decode step of one sequence, as measured: about 2 ms.
    assert 1.5 < step_time_ms(profile, decode_seqs=1, kv_tokens=600) < 2.5


def test_int8_tp2_blocks_follow_the_documented_formula() -> None:
    kv_bytes = 0.9 * 160e9 - 70e9 - 3e9

    assert PROFILES["h100-70b-int8-tp2"].num_gpu_blocks == int(
        kv_bytes // (16 * 320 * 1024)
    )


def test_default_profile_is_a100_8b() -> None:
    assert DEFAULT_PROFILE is A100


def test_profile_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="positive"):
        PerfProfile("x", 0.5, 0.0, 0.07, 0.02, 0.09, 3e-6, 100, 2048, 256)
    with pytest.raises(ValueError, match="KV blocks"):
        PerfProfile("x", 0.5, 10.0, 0.07, 0.02, 0.09, 3e-6, 1, 2048, 256)


def test_jitter_has_mean_one_and_the_requested_cv() -> None:
    rng = random.Random(1)
    draws = [jitter_factor(rng, 0.04) for _ in range(20_000)]

    assert statistics.fmean(draws) == pytest.approx(1.0, abs=0.002)
    assert statistics.pstdev(draws) == pytest.approx(0.04, rel=0.05)
    assert min(draws) > 0


def test_jitter_is_deterministic_for_a_seed() -> None:
    a = [jitter_factor(random.Random(5)) for _ in range(3)]

    assert a == [jitter_factor(random.Random(5)) for _ in range(3)]


def test_zero_cv_means_no_jitter_and_no_draw() -> None:
    rng = random.Random(3)
    state = rng.getstate()

    assert jitter_factor(rng, 0.0) == 1.0
    assert rng.getstate() == state

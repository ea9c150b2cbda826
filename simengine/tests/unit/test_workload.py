"""Calibration tests: the closed-loop driver against the spec's targets (§2.4, §6.4)."""

from __future__ import annotations

import pytest

from simengine.domain.perf import PROFILES
from simengine.domain.workload import LoadResult, run_closed_loop

A100 = PROFILES["a100-8b"]


def chat_load(streams: int, *, duration_s: float = 60.0, **kwargs: int) -> LoadResult:
    return run_closed_loop(
        A100,
        streams=streams,
        prompt_tokens=650,
        output_tokens=250,
        duration_s=duration_s,
        warmup_s=10.0,
        **kwargs,
    )


def test_83_streams_give_2500_tokens_per_second_at_33_ms_tpot() -> None:
    result = chat_load(83)

    assert result.output_tokens_per_s == pytest.approx(2500, rel=0.10)
    assert result.mean_tpot_ms == pytest.approx(33, abs=4)
    assert result.requests_completed > 500
    assert result.num_preemptions == 0


def test_single_stream_tpot_is_10_6_ms() -> None:
    result = chat_load(1)

    assert result.mean_tpot_ms == pytest.approx(10.6, abs=1.0)
    assert result.mean_ttft_ms == pytest.approx(48, abs=3)
    assert result.output_tokens_per_s == pytest.approx(93, rel=0.05)


def test_throughput_rises_with_concurrency_and_saturates() -> None:
    levels = (8, 32, 83, 128)
    rates = [chat_load(s, duration_s=30.0).output_tokens_per_s for s in levels]
    gains_per_stream = [
        (rates[i + 1] - rates[i]) / (levels[i + 1] - levels[i])
        for i in range(len(levels) - 1)
    ]

    assert rates == sorted(rates)
    assert gains_per_stream == sorted(gains_per_stream, reverse=True)
    assert gains_per_stream[-1] < gains_per_stream[0] / 4


def test_shared_prefix_hits_the_cache() -> None:
    result = chat_load(16, duration_s=20.0, shared_prefix_tokens=512)
    unshared = chat_load(16, duration_s=20.0)

    assert result.prefix_hit_rate == pytest.approx(512 / 650, abs=0.01)
    assert unshared.prefix_hit_rate == 0.0
    assert result.mean_ttft_ms < unshared.mean_ttft_ms


def test_same_seed_gives_the_same_result() -> None:
    assert chat_load(16, duration_s=10.0, seed=3) == chat_load(
        16, duration_s=10.0, seed=3
    )


def test_rejects_a_shared_prefix_as_long_as_the_prompt() -> None:
    with pytest.raises(ValueError, match="shared_prefix_tokens"):
        chat_load(1, shared_prefix_tokens=650)

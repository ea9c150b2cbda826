"""A pool's live figures: what the role ``pool`` counts and how it is read."""

from __future__ import annotations

import pytest

from engine_nodes.domain.load_shares import sum_replica_tokens
from metering.domain.figures import (
    GUARD_ROLES,
    Role,
    VersionFigures,
    one_request,
    ttft_bucket,
)
from metering.domain.pool_live import pool_live, usd_per_million_served


def answer(ttft_s: float, *, prompt: int = 100, cached: int = 0) -> VersionFigures:
    return one_request(
        ttft_s=ttft_s,
        output_tokens=10,
        prompt_tokens=prompt,
        cached_tokens=cached,
        tpot_s=0.02,
    )


def test_the_pool_role_is_no_guard_role() -> None:
    assert Role.POOL not in GUARD_ROLES
    assert set(GUARD_ROLES) | {Role.POOL} == set(Role)


def test_pool_figures_survive_the_redis_hash_and_add_up() -> None:
    figures = answer(0.1, cached=40) + answer(0.3, prompt=50, cached=50)

    assert VersionFigures.from_fields(figures.to_fields()) == figures
    assert (figures.prompt_tokens, figures.cached_tokens) == (150, 90)
    assert figures.prefix_hit_rate == pytest.approx(0.6)
    assert sum(figures.tpot.values()) == 2


def test_a_request_without_an_answer_carries_no_tokens() -> None:
    broken = one_request(
        ttft_s=0.1,
        output_tokens=None,
        error_kind="broken",
        prompt_tokens=100,
        cached_tokens=50,
        tpot_s=0.02,
    )

    assert (broken.prompt_tokens, broken.cached_tokens, broken.tpot) == (0, 0, {})
    assert broken.prefix_hit_rate is None


def test_cached_tokens_never_exceed_the_prompt() -> None:
    assert answer(0.1, prompt=10, cached=30).prefix_hit_rate == 1.0


def test_live_figures_read_quantiles_from_the_histograms() -> None:
    figures = VersionFigures()
    for i in range(100):
        figures = figures + answer(0.1 if i < 90 else 1.0)

    live = pool_live(figures, usd_per_hour=0.0, window_s=300)

    assert live.requests == 100
    # p95 and p99 fall among the slow tenth, within a bucket (10%) above 1 s.
    assert live.ttft_p95_ms is not None and 1000 <= live.ttft_p95_ms <= 1100
    assert live.ttft_p99_ms == live.ttft_p95_ms
    assert live.tpot_p50_ms is not None and 20 <= live.tpot_p50_ms <= 22
    assert live.prefix_hit_rate == 0.0


def test_an_idle_pool_has_no_figures_but_a_count_of_zero() -> None:
    live = pool_live(VersionFigures(), usd_per_hour=8.0, window_s=300)

    assert live.requests == 0
    assert live.ttft_p95_ms is live.tpot_p95_ms is live.prefix_hit_rate is None
    assert live.usd_per_million_tokens is None


def test_usd_per_million_is_the_gpus_cost_over_the_tokens_served() -> None:
    # $3.60 an hour for 5 minutes is $0.30; 150k tokens served: $2 a million.
    assert usd_per_million_served(
        usd_per_hour=3.6, window_s=300, tokens=150_000
    ) == pytest.approx(2.0)
    assert usd_per_million_served(usd_per_hour=3.6, window_s=300, tokens=0) is None


def test_quantiles_past_the_last_bound_read_the_overflow() -> None:
    figures = one_request(ttft_s=10_000.0, output_tokens=1)

    assert figures.ttft == {ttft_bucket(10_000.0): 1}
    assert figures.ttft_quantile(0.95) is not None


def test_router_tokens_sum_the_pools_replicas_over_every_gateway() -> None:
    shares = [{"r1": 100, "r2": 50, "p|m|v": 999}, {"r1": 20, "r3": 7}]

    assert sum_replica_tokens(shares, ["r1", "r2"]) == 170
    assert sum_replica_tokens(shares, []) == 0

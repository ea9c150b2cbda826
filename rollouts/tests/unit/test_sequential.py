"""The sequential guards' statistics: valid at every look, and powerful enough."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollouts.domain.sequential import (
    difference_interval,
    mixture_radius,
    rate_scales,
    samples_to_decide,
)

LIMIT = 0.005  # the error-rate guard's 0.5 points
SCALES = rate_scales(LIMIT)
LIVE = 0.004  # the issue's "8 in 2,000"


def _looks(
    rng: np.random.Generator,
    runs: int,
    looks: int,
    per_look: int,
    rate_candidate: float,
    alpha: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Per run: whether any look said worse, and whether any said not worse."""
    k_c = rng.binomial(per_look, rate_candidate, size=(runs, looks)).cumsum(axis=1)
    k_l = rng.binomial(per_look, LIVE, size=(runs, looks)).cumsum(axis=1)
    worse = np.zeros(runs, dtype=bool)
    not_worse = np.zeros(runs, dtype=bool)
    for run in range(runs):
        for look in range(looks):
            n = per_look * (look + 1)
            interval = difference_interval(
                int(k_c[run, look]),
                n,
                int(k_l[run, look]),
                n,
                alpha=alpha,
                scales=SCALES,
            )
            worse[run] |= interval.lower > LIMIT
            not_worse[run] |= interval.upper <= LIMIT
    return worse, not_worse


def test_type_one_error_under_repeated_looks_stays_below_alpha() -> None:
    """A candidate exactly at the threshold, looked at 30 times a run: the share
    of runs that ever call it not worse (the wrong promotion) or worse stays at
    or below alpha. The naive z-test looked at as often does not."""
    rng = np.random.default_rng(38)
    alpha, runs, looks, per_look = 0.05, 300, 30, 400
    worse, not_worse = _looks(rng, runs, looks, per_look, LIVE + LIMIT, alpha)
    assert not_worse.mean() <= alpha, not_worse.mean()
    assert worse.mean() <= alpha, worse.mean()

    # The contrast: a fixed-sample one-sided z-test at the same alpha, repeated.
    z = 1.6449  # one-sided 5%
    k_c = rng.binomial(per_look, LIVE + LIMIT, size=(runs, looks)).cumsum(axis=1)
    k_l = rng.binomial(per_look, LIVE, size=(runs, looks)).cumsum(axis=1)
    n = per_look * np.arange(1, looks + 1)
    p_c, p_l = k_c / n, k_l / n
    se = np.sqrt(p_c * (1 - p_c) / n + p_l * (1 - p_l) / n)
    naive = ((p_c - p_l + z * se) <= LIMIT).any(axis=1)
    assert naive.mean() > alpha


def test_a_version_0_6_points_worse_is_never_called_not_worse() -> None:
    """The issue's case: +0.6 points against a 0.5 threshold, 200 runs of 20
    looks up to 600,000 requests a side: never not worse; with enough traffic,
    worse in most runs (the power: about 240,000 a side are expected)."""
    rng = np.random.default_rng(6)
    alpha = 0.01
    worse, not_worse = _looks(rng, 200, 20, 30_000, LIVE + 0.006, alpha)
    assert not not_worse.any()
    assert worse.mean() >= 0.8, worse.mean()
    expected = samples_to_decide(LIVE + 0.006, LIVE, LIMIT, alpha=alpha, scales=SCALES)
    assert expected is not None and 150_000 < expected < 400_000


def test_a_good_version_is_called_not_worse_at_the_expected_exposure() -> None:
    rng = np.random.default_rng(7)
    alpha = 0.01
    expected = samples_to_decide(LIVE, LIVE, LIMIT, alpha=alpha, scales=SCALES)
    assert expected is not None and 3_000 < expected < 8_000
    decided = 0
    for _ in range(100):
        n = 2 * expected
        k_c, k_l = rng.binomial(n, LIVE), rng.binomial(n, LIVE)
        interval = difference_interval(k_c, n, k_l, n, alpha=alpha, scales=SCALES)
        decided += interval.upper <= LIMIT
    assert decided >= 95


def test_a_total_failure_is_worse_on_a_handful_of_requests() -> None:
    """Every answer a refusal against none: worse by more than 2 points on 4
    requests a side, not on 3 (ten per guard period reach even a quiet canary)."""
    scales = rate_scales(0.02)
    assert samples_to_decide(1.0, 0.0, 0.02, alpha=0.01, scales=scales) == 4
    assert difference_interval(4, 4, 0, 4, alpha=0.01, scales=scales).lower > 0.02
    assert difference_interval(3, 3, 0, 3, alpha=0.01, scales=scales).lower <= 0.02


def test_issue_example_20_in_2000_against_8_in_2000_is_undecided() -> None:
    """Before: +0.6 points at p = 0.018 counted as a pass and the plan advanced."""
    interval = difference_interval(20, 2000, 8, 2000, alpha=0.01, scales=SCALES)
    assert interval.estimate == pytest.approx(0.006)
    assert interval.lower < LIMIT < interval.upper


def test_samples_to_decide_agrees_with_the_interval() -> None:
    n = samples_to_decide(0.0, 0.0, 0.02, alpha=0.01, scales=rate_scales(0.02))
    assert n is not None
    assert (
        difference_interval(0, n, 0, n, alpha=0.01, scales=rate_scales(0.02)).upper
        <= 0.02
    )
    assert (
        difference_interval(
            0, n - 1, 0, n - 1, alpha=0.01, scales=rate_scales(0.02)
        ).upper
        > 0.02
    )
    assert samples_to_decide(0.009, 0.004, LIMIT, alpha=0.01, scales=SCALES) is None


def test_mixture_radius_needs_a_variance() -> None:
    assert math.isinf(mixture_radius(0.0, 0.01, SCALES))
    assert math.isinf(mixture_radius(math.inf, 0.01, SCALES))
    assert mixture_radius(1e-4, 0.01, SCALES) < mixture_radius(1e-4, 0.001, SCALES)

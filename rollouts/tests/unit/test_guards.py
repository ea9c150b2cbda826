"""Tests for the rollout guards: the comparison of a candidate with live."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metering.domain.figures import (
    OUTPUT_BOUNDS,
    TTFT_BOUNDS_S,
    VersionFigures,
    one_request,
    output_value,
)
from rollouts.domain import plan
from rollouts.domain.guards import (
    GUARD_NAMES,
    GuardReport,
    GuardResult,
    GuardThresholds,
    PlanError,
    Verdict,
    compare,
    parse_thresholds,
)

GUARDS = GuardThresholds()
PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
NORMAL = statistics.NormalDist()


# ---------------------------------------------------------------------------
# Building figures


def total(figures: Iterable[VersionFigures]) -> VersionFigures:
    out = VersionFigures()
    for one in figures:
        out = out + one
    return out


def quantiles(n: int) -> list[float]:
    """n evenly spread standard-normal quantiles: a sample with no noise."""
    return [NORMAL.inv_cdf((i + 0.5) / n) for i in range(n)]


def traffic(
    n: int,
    *,
    ttft_s: float = 0.3,
    ttft_spread: float = 0.3,
    tokens: Callable[[float], int] = lambda z: round(200 * math.exp(0.4 * z)),
    refused: Callable[[int], bool] = lambda i: False,
    errors: int = 0,
) -> VersionFigures:
    """n answered requests (log-normal TTFT and length), plus ``errors`` failures."""
    answered = total(
        one_request(
            ttft_s=ttft_s * math.exp(ttft_spread * z),
            output_tokens=tokens(z),
            refused=refused(i),
        )
        for i, z in enumerate(quantiles(n))
    )
    failed = total(
        one_request(ttft_s=None, output_tokens=None, error_kind="upstream")
        for _ in range(errors)
    )
    return answered + failed


def scaled(figures: VersionFigures, k: int) -> VersionFigures:
    """The same window seen k times over: every count multiplied by k."""
    return VersionFigures(
        requests=figures.requests * k,
        answered=figures.answered * k,
        refusals=figures.refusals * k,
        output_tokens=figures.output_tokens * k,
        conversations=figures.conversations * k,
        errors={kind: c * k for kind, c in figures.errors.items()},
        ttft={i: c * k for i, c in figures.ttft.items()},
        output={i: c * k for i, c in figures.output.items()},
    )


def shifted_ttft(figures: VersionFigures, buckets: int) -> VersionFigures:
    """The same figures with every TTFT ``buckets`` buckets (10% each) slower."""
    return VersionFigures(
        requests=figures.requests,
        answered=figures.answered,
        refusals=figures.refusals,
        output_tokens=figures.output_tokens,
        errors=dict(figures.errors),
        ttft={i + buckets: c for i, c in figures.ttft.items()},
        output=dict(figures.output),
    )


def shifted_output(figures: VersionFigures, buckets: int) -> VersionFigures:
    """Every answer ``buckets`` buckets longer (histogram and token sum agree)."""
    output = {i + buckets: c for i, c in figures.output.items()}
    return VersionFigures(
        requests=figures.requests,
        answered=figures.answered,
        refusals=figures.refusals,
        output_tokens=round(sum(output_value(i) * c for i, c in output.items())),
        errors=dict(figures.errors),
        ttft=dict(figures.ttft),
        output=output,
    )


@st.composite
def figures(draw: st.DrawFn, max_count: int = 400) -> VersionFigures:
    """Well-formed figures: answers, refusals and errors consistent."""
    counts = st.integers(0, max_count)
    ttft = draw(st.dictionaries(st.integers(30, 110), counts, max_size=6))
    # Lengths of 16 tokens and up, where buckets are 10% apart.
    output = draw(st.dictionaries(st.integers(16, 90), counts, max_size=6))
    answered = sum(output.values())
    errors = draw(counts)
    return VersionFigures(
        requests=answered + errors,
        answered=answered,
        refusals=draw(st.integers(0, answered)),
        output_tokens=round(sum(output_value(i) * c for i, c in output.items())),
        conversations=draw(counts),
        errors={"upstream": errors} if errors else {},
        ttft=ttft,
        output=output,
    )


@st.composite
def any_figures(draw: st.DrawFn) -> VersionFigures:
    """Figures that need not be consistent: zeros, a refusal count above answers."""
    small = st.integers(0, 60)
    return VersionFigures(
        requests=draw(small),
        answered=draw(small),
        refusals=draw(small),
        output_tokens=draw(st.integers(0, 10_000)),
        conversations=draw(small),
        errors=draw(st.dictionaries(st.sampled_from(["upstream", "broken"]), small)),
        ttft=draw(
            st.dictionaries(st.integers(0, len(TTFT_BOUNDS_S) + 1), small, max_size=4)
        ),
        output=draw(
            st.dictionaries(st.integers(0, len(OUTPUT_BOUNDS) + 1), small, max_size=4)
        ),
    )


def verdicts(report: GuardReport) -> dict[str, Verdict]:
    return {r.name: r.verdict for r in report.results}


def is_past(result: GuardResult, thresholds: GuardThresholds) -> bool:
    """Whether a result's change is past its threshold (the size test alone)."""
    assert result.change is not None
    limits: Mapping[str, float] = {
        "error_rate": thresholds.error_rate_points,
        "refusal_rate": thresholds.refusal_rate_points,
        "p95_ttft": thresholds.p95_ttft_ratio,
        "output_length": thresholds.output_length_ratio,
    }
    change = result.change
    if result.name == "output_length":
        change = abs(change)
    return change > limits[result.name] + 1e-9


# ---------------------------------------------------------------------------
# Thresholds


def test_guard_thresholds_defaults_are_the_brief_values() -> None:
    assert GUARDS.to_json() == {
        "error_rate_points": 0.5,
        "p95_ttft_ratio": 0.20,
        "p95_ttft_min_s": 0.05,
        "output_length_ratio": 0.15,
        "refusal_rate_points": 2.0,
        "alpha": 0.01,
        "min_samples": 20,
    }


def test_guard_thresholds_are_the_same_class_in_plan() -> None:
    assert plan.GuardThresholds is GuardThresholds
    assert plan.PlanError is PlanError


@given(
    error_rate_points=st.floats(0, 100),
    p95_ttft_ratio=st.floats(0, 10),
    output_length_ratio=st.floats(0, 10),
    refusal_rate_points=st.floats(0, 100),
    alpha=st.floats(1e-9, 0.999),
    min_samples=st.integers(1, 10_000),
)
def test_parse_thresholds_reads_back_to_json(
    error_rate_points: float,
    p95_ttft_ratio: float,
    output_length_ratio: float,
    refusal_rate_points: float,
    alpha: float,
    min_samples: int,
) -> None:
    thresholds = GuardThresholds(
        error_rate_points=error_rate_points,
        p95_ttft_ratio=p95_ttft_ratio,
        output_length_ratio=output_length_ratio,
        refusal_rate_points=refusal_rate_points,
        alpha=alpha,
        min_samples=min_samples,
    )
    assert parse_thresholds(thresholds.to_json()) == thresholds


def test_parse_thresholds_missing_keys_take_defaults() -> None:
    assert parse_thresholds({}) == GUARDS
    assert parse_thresholds({"alpha": 0.05}) == GuardThresholds(alpha=0.05)
    assert parse_thresholds({"error_rate_points": 1}).error_rate_points == 1.0


@pytest.mark.parametrize(
    ("data", "problems"),
    [
        ({"bogus": 1}, [("bogus", "unknown key")]),
        ({"alpha": True}, [("alpha", "must be a finite number")]),
        ({"alpha": "0.01"}, [("alpha", "must be a finite number")]),
        ({"alpha": math.nan}, [("alpha", "must be a finite number")]),
        ({"alpha": 10**400}, [("alpha", "must be a finite number")]),
        ({"alpha": 0.0}, [("alpha", "must be greater than 0 and less than 1")]),
        ({"alpha": 1.0}, [("alpha", "must be greater than 0 and less than 1")]),
        (
            {"error_rate_points": -0.1},
            [("error_rate_points", "must be between 0 and 100 points")],
        ),
        (
            {"refusal_rate_points": 101},
            [("refusal_rate_points", "must be between 0 and 100 points")],
        ),
        ({"p95_ttft_ratio": -0.2}, [("p95_ttft_ratio", "must not be negative")]),
        ({"min_samples": 0}, [("min_samples", "must be at least 1")]),
        ({"min_samples": 20.0}, [("min_samples", "must be a whole number")]),
        ({"min_samples": False}, [("min_samples", "must be a whole number")]),
        (
            {"x": 1, "alpha": 2, "min_samples": -1},
            [
                ("x", "unknown key"),
                ("alpha", "must be greater than 0 and less than 1"),
                ("min_samples", "must be at least 1"),
            ],
        ),
    ],
)
def test_parse_thresholds_rejects_bad_values(
    data: dict[str, object], problems: list[tuple[str, str]]
) -> None:
    with pytest.raises(PlanError) as caught:
        parse_thresholds(data)
    assert caught.value.problems == problems


# ---------------------------------------------------------------------------
# Invariants


@PROPERTY
@given(figures())
def test_compare_identical_figures_never_trip(one: VersionFigures) -> None:
    report = compare(one, one, GUARDS)
    assert report.tripped == ()
    assert [r.name for r in report.results] == list(GUARD_NAMES)


@PROPERTY
@given(figures(), figures(), st.integers(2, 12))
def test_compare_scaling_both_sides_keeps_the_verdict_direction(
    candidate: VersionFigures, live: VersionFigures, k: int
) -> None:
    """More of the same evidence never turns a trip into a pass, nor a change
    within its threshold into a trip."""
    small = compare(candidate, live, GUARDS)
    large = compare(scaled(candidate, k), scaled(live, k), GUARDS)
    for before, after in zip(small.results, large.results, strict=True):
        if before.verdict is Verdict.TRIP:
            assert after.verdict is Verdict.TRIP, (before.reason, after.reason)
        if before.verdict is Verdict.PASS and not is_past(before, GUARDS):
            assert after.verdict is Verdict.PASS, (before.reason, after.reason)
        if before.verdict is not Verdict.TOO_FEW:
            assert after.verdict is not Verdict.TOO_FEW
            assert after.p_value is not None and before.p_value is not None
            # Evidence of harm only grows (a better candidate's p rises instead).
            if is_past(before, GUARDS) and before.p_value < 0.5:
                assert after.p_value <= before.p_value + 1e-9


@PROPERTY
@given(
    live_rate=st.floats(0.0, 0.05),
    excess_points=st.floats(0.5, 20.0),
    guard=st.sampled_from(["error_rate", "refusal_rate"]),
)
def test_compare_rate_past_its_threshold_with_large_counts_trips(
    live_rate: float, excess_points: float, guard: str
) -> None:
    n = 100_000
    limit = (
        GUARDS.error_rate_points
        if guard == "error_rate"
        else GUARDS.refusal_rate_points
    )
    k_live = round(live_rate * n)
    k_candidate = k_live + math.ceil((limit + excess_points) / 100 * n)

    def side(k: int) -> VersionFigures:
        if guard == "error_rate":
            return VersionFigures(requests=n, errors={"timeout": k})
        return VersionFigures(requests=n, answered=n, refusals=k)

    result = compare(side(k_candidate), side(k_live), GUARDS).result(guard)
    assert result.verdict is Verdict.TRIP, result.reason
    assert result.change is not None and result.change > limit


@PROPERTY
@given(figures(max_count=60), st.integers(3, 8))
def test_compare_ttft_past_its_threshold_with_large_counts_trips(
    live: VersionFigures, buckets: int
) -> None:
    """3 buckets slower is 33% slower: past the +20% guard (with no absolute
    floor: the ratio is what this checks). Never not worse at 100x the counts;
    worse at 10,000x unless the share past the cutoff is within a point of 5%
    (a p95 moved by a sliver of the tail needs that much more evidence)."""
    no_floor = dataclasses.replace(GUARDS, p95_ttft_min_s=0.0)
    big = scaled(live, 100)
    result = compare(shifted_ttft(big, buckets), big, no_floor).result("p95_ttft")
    if live.ttft_count == 0:
        assert result.verdict is Verdict.TOO_FEW
        return
    assert result.verdict is not Verdict.NOT_WORSE, result.reason
    huge = scaled(live, 10_000)
    result = compare(shifted_ttft(huge, buckets), huge, no_floor).result("p95_ttft")
    assert result.lower is not None and result.upper is not None
    if (result.lower + result.upper) / 2 > 1.0:  # points above 5%
        assert result.verdict is Verdict.WORSE, result.reason
    else:
        assert result.verdict is not Verdict.NOT_WORSE, result.reason


@PROPERTY
@given(figures(max_count=60), st.sampled_from([-6, -3, 3, 6]))
def test_compare_output_length_past_its_threshold_either_way_trips(
    live: VersionFigures, buckets: int
) -> None:
    """Never not worse at 100x the counts; worse at 10,000x unless the change
    is within 5 points of the 15% threshold (that needs more evidence still)."""
    big = scaled(live, 100)
    result = compare(shifted_output(big, buckets), big, GUARDS).result("output_length")
    if live.answered == 0:
        assert result.verdict is Verdict.TOO_FEW
        return
    assert result.verdict is not Verdict.NOT_WORSE, result.reason
    huge = scaled(live, 10_000)
    result = compare(shifted_output(huge, buckets), huge, GUARDS).result(
        "output_length"
    )
    assert result.change is not None
    if abs(result.change) > 0.20:
        assert result.verdict is Verdict.WORSE, result.reason
    else:
        assert result.verdict is not Verdict.NOT_WORSE, result.reason


@PROPERTY
@given(figures(max_count=60))
def test_compare_significant_change_within_the_thresholds_passes(
    live: VersionFigures,
) -> None:
    """One bucket slower and longer (10%), at 100x the counts: real, but harmless."""
    big = shifted_output(scaled(live, 100), 0)  # token sums of the scaled buckets
    candidate = shifted_output(shifted_ttft(big, 1), 1)
    report = compare(candidate, big, GUARDS)
    assert report.tripped == ()
    for name in ("p95_ttft", "output_length"):
        r = report.result(name)
        if r.verdict is Verdict.PASS:
            assert r.change == pytest.approx(0.1, abs=0.01)
            assert "not worse" in r.reason


@PROPERTY
@given(figures(max_count=3), figures(max_count=3))
def test_compare_too_few_samples_never_trips(
    candidate: VersionFigures, live: VersionFigures
) -> None:
    """At most 3 per bucket, 6 buckets: under 50 on every guard's counts. Nothing
    is not worse; only a rate guard may call worse, on overwhelming evidence
    (its interval wholly past the threshold: a few refusals in as many answers
    against none)."""
    thresholds = GuardThresholds(min_samples=50)
    report = compare(candidate, live, thresholds)
    for r in report.results:
        if r.verdict is Verdict.WORSE:
            assert r.name in ("error_rate", "refusal_rate")
            limit = (
                thresholds.error_rate_points
                if r.name == "error_rate"
                else thresholds.refusal_rate_points
            )
            assert r.lower is not None and r.lower > limit
            assert r.change is not None and r.change >= 50.0
        else:
            assert r.verdict is Verdict.TOO_FEW
            assert r.p_value is None


@PROPERTY
@given(figures(), figures(), st.integers(1, 2_000))
def test_compare_guard_below_min_samples_on_either_side_is_too_few(
    candidate: VersionFigures, live: VersionFigures, min_samples: int
) -> None:
    """Below the minimum: too few, except a rate guard's overwhelming worse."""
    report = compare(candidate, live, GuardThresholds(min_samples=min_samples))
    for r in report.results:
        if min(r.candidate_samples, r.live_samples) < min_samples:
            if r.verdict is Verdict.WORSE and r.name in ("error_rate", "refusal_rate"):
                assert r.lower is not None and r.lower > 0.0, r.reason
                continue
            assert r.verdict is Verdict.TOO_FEW, r.reason
            assert "too few" in r.reason


@PROPERTY
@given(any_figures(), any_figures(), st.integers(1, 30))
def test_compare_never_raises_and_reports_every_guard(
    candidate: VersionFigures, live: VersionFigures, min_samples: int
) -> None:
    report = compare(candidate, live, GuardThresholds(min_samples=min_samples))
    assert [r.name for r in report.results] == list(GUARD_NAMES)
    for r in report.results:
        assert r.reason
        assert r.p_value is None or 0.0 <= r.p_value <= 1.0
    assert report.to_json()["summary"] == report.summary()


# ---------------------------------------------------------------------------
# Concrete cases


def test_compare_degraded_canary_trips_refusals_and_output_length() -> None:
    """A broken chat template: every answer a 12-token refusal, 30 canary requests."""
    live = traffic(200)
    canary = traffic(30, tokens=lambda z: 12, refused=lambda i: True)
    report = compare(canary, live, GUARDS)
    assert verdicts(report) == {
        # No error on either side, but 30 requests cannot show the candidate's
        # error rate within 0.5 points of live's: undecided, not a pass.
        "error_rate": Verdict.UNDECIDED,
        # 30 TTFTs cannot show a p95 within 20% of live's either.
        "p95_ttft": Verdict.UNDECIDED,
        "output_length": Verdict.WORSE,
        "refusal_rate": Verdict.WORSE,
    }
    refusal = report.result("refusal_rate")
    assert refusal.candidate == 1.0 and refusal.live == 0.0
    assert refusal.change == pytest.approx(100.0)
    assert refusal.lower is not None and refusal.lower > 50.0
    assert refusal.p_value is not None and refusal.p_value < 1e-6
    assert refusal.reason.startswith(
        "refusal rate 100.0% against 0.0% on live (+100.0 points, 99% sequence "
    )
    assert refusal.reason.endswith(": worse than +2.0)")
    length = report.result("output_length")
    assert length.candidate == 12.0
    assert length.change is not None and length.change < -0.9
    assert report.summary() == (
        "worse: output_length, refusal_rate (30 candidate requests, 200 live)"
    )


def test_compare_30_percent_slower_ttft_trips_with_600_samples() -> None:
    """The sequential p95 guard reads the tail only (the share past live's p95
    times 1.2), so it needs more than the old whole-distribution test's 300:
    300 are undecided, 600 are worse."""
    assert (
        compare(traffic(300, ttft_s=0.3 * 1.3), traffic(300), GUARDS)
        .result("p95_ttft")
        .verdict
        is Verdict.UNDECIDED
    )
    live = traffic(600)
    slow = traffic(600, ttft_s=0.3 * 1.3)
    report = compare(slow, live, GUARDS)
    ttft = report.result("p95_ttft")
    assert ttft.verdict is Verdict.TRIP, ttft.reason
    assert ttft.change is not None and 0.2 < ttft.change < 0.45
    assert ttft.p_value is not None and ttft.p_value < 1e-3
    assert [r.name for r in report.tripped] == ["p95_ttft"]


def test_compare_30_percent_slower_ttft_with_5_samples_is_no_trip() -> None:
    live, slow = traffic(5), traffic(5, ttft_s=0.3 * 1.3)
    assert compare(slow, live, GUARDS).result("p95_ttft").verdict is Verdict.TOO_FEW
    # Even allowed a verdict on 5 samples, the test finds no significance.
    loose = compare(slow, live, GuardThresholds(min_samples=5)).result("p95_ttft")
    assert loose.verdict is Verdict.UNDECIDED, loose.reason
    assert "undecided" in loose.reason


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_compare_good_canary_from_the_same_distributions_is_not_worse(
    seed: int,
) -> None:
    """Enough traffic for every guard to decide (a 0.5-point margin on a 0.4%
    error rate needs thousands of requests a side), and it decides not worse."""
    rng = np.random.default_rng(seed)

    def sample(n: int) -> VersionFigures:
        ttfts = rng.lognormal(math.log(0.3), 0.4, n)
        lengths = rng.lognormal(math.log(200), 0.5, n).round().astype(int)
        refused = rng.random(n) < 0.02
        failed = int((rng.random(n) < 0.004).sum())
        return total(
            one_request(ttft_s=float(t), output_tokens=int(o), refused=bool(r))
            for t, o, r in zip(ttfts, lengths, refused, strict=True)
        ) + total(
            one_request(ttft_s=None, output_tokens=None, error_kind="broken")
            for _ in range(failed)
        )

    report = compare(sample(12_000), sample(24_000), GUARDS)
    assert report.tripped == (), report.summary()
    assert report.undecided == (), report.summary()
    assert report.summary() == (
        f"all guards not worse ({report.candidate_requests} candidate requests, "
        f"{report.live_requests} live)"
    )


def test_compare_good_canary_on_300_requests_is_undecided_not_passed() -> None:
    """Before issue 38 a window that could not show a harm counted as a pass."""
    live, canary = traffic(3000), traffic(300)
    report = compare(canary, live, GUARDS)
    assert report.tripped == ()
    assert report.result("error_rate").verdict is Verdict.UNDECIDED
    needed = report.result("error_rate").samples_needed
    assert needed is not None and needed > 300


@PROPERTY
@given(
    thousands=st.integers(1, 1_000),
    live_per_mille=st.integers(0, 50),
)
def test_compare_error_rate_plus_0_3_points_never_trips(
    thousands: int, live_per_mille: int
) -> None:
    n = thousands * 1_000
    live = VersionFigures(requests=n, errors={"upstream": live_per_mille * thousands})
    candidate = VersionFigures(
        requests=n, errors={"upstream": (live_per_mille + 3) * thousands}
    )
    result = compare(candidate, live, GUARDS).result("error_rate")
    assert result.verdict is not Verdict.WORSE, result.reason
    assert result.change == pytest.approx(0.3)
    # At a million requests a side the evidence says not worse.
    if thousands == 1_000 and live_per_mille <= 20:
        assert result.verdict is Verdict.NOT_WORSE, result.reason


def test_compare_error_rate_past_threshold_but_not_significant_passes() -> None:
    """3 errors in 30 is +10 points, but at 30 requests that can be chance."""
    live = VersionFigures(requests=1000, errors={"upstream": 20})
    candidate = VersionFigures(requests=30, errors={"upstream": 2})
    result = compare(candidate, live, GUARDS).result("error_rate")
    assert result.verdict is Verdict.UNDECIDED
    assert "undecided" in result.reason


def test_compare_live_without_answers_is_too_few_not_an_error() -> None:
    candidate = traffic(100)
    live = VersionFigures(requests=100, errors={"upstream": 100})
    report = compare(candidate, live, GUARDS)
    assert report.result("output_length").verdict is Verdict.TOO_FEW
    assert report.result("refusal_rate").verdict is Verdict.TOO_FEW
    assert report.result("p95_ttft").verdict is Verdict.TOO_FEW
    assert report.result("p95_ttft").live is None


def test_compare_live_answers_of_no_tokens_is_too_few() -> None:
    live = VersionFigures(requests=50, answered=50, output_tokens=0, output={0: 50})
    candidate = traffic(50)
    result = compare(candidate, live, GUARDS).result("output_length")
    assert result.verdict is Verdict.TOO_FEW
    assert "no tokens" in result.reason


def test_compare_caps_huge_histograms_and_keeps_the_verdict() -> None:
    """10^8 samples a side: read from the histograms in time, and the verdicts
    only firmer than on the small window."""
    live = traffic(400)
    slow = shifted_ttft(live, 3)
    k = 250_000
    assert scaled(live, k).ttft_count > 20_000_000
    started = time.monotonic()
    huge = compare(scaled(slow, k), scaled(live, k), GUARDS)
    elapsed_s = time.monotonic() - started
    small = compare(slow, live, GUARDS)
    # The histogram guards' verdicts; the rate guards rightly decide more on
    # 10^8 requests than on 400.
    for name in ("p95_ttft", "output_length"):
        assert huge.result(name).verdict is small.result(name).verdict
    assert huge.result("p95_ttft").verdict is Verdict.TRIP
    assert huge.result("p95_ttft").candidate_samples == slow.ttft_count * k
    assert elapsed_s < 5.0


def test_guard_report_json_and_summary_of_too_few() -> None:
    report = compare(traffic(10), traffic(10), GUARDS)
    assert report.summary() == (
        "too few samples: error_rate, p95_ttft, output_length, refusal_rate "
        "(10 candidate requests, 10 live)"
    )
    data = report.to_json()
    assert data["candidate_requests"] == 10
    results = data["results"]
    assert isinstance(results, list)
    assert results[0] == {
        "name": "error_rate",
        "verdict": "too_few",
        "candidate": 0.0,
        "live": 0.0,
        "change": 0.0,
        "p_value": None,
        "reason": (
            "error rate: too few requests (10 on the candidate, 10 on live; "
            "needs 20 each)"
        ),
        "candidate_samples": 10,
        "live_samples": 10,
        "lower": pytest.approx(-results[0]["upper"]),
        "upper": results[0]["upper"],
        "samples_needed": results[0]["samples_needed"],
    }
    assert results[0]["upper"] > 0.5  # ten requests a side: nothing decided
    assert results[0]["samples_needed"] > 100
    with pytest.raises(KeyError):
        report.result("bogus")


def test_a_few_milliseconds_on_a_fast_model_never_trip_the_ttft_guard() -> None:
    def at(ttft_s: float, n: int) -> VersionFigures:
        total = VersionFigures()
        for _ in range(n):
            total += one_request(ttft_s=ttft_s, output_tokens=10)
        return total

    # +21% but 6 ms: no regression a user feels.
    fast = compare(at(0.035, 500), at(0.029, 500), GUARDS)
    assert fast.result("p95_ttft").verdict == Verdict.PASS
    # The same ratio on a slower model trips.
    slow = compare(at(0.35, 500), at(0.29, 500), GUARDS)
    assert slow.result("p95_ttft").verdict == Verdict.TRIP


def test_compare_a_uniform_slowdown_is_worse_by_its_whole_distribution() -> None:
    """30% slower everywhere on a narrow TTFT: few answers pass live's p95 x 1.2,
    but the whole distribution's log shift is past log(1.2): worse. A shift of
    10% (within the ratio) is not."""
    live = traffic(3000, ttft_spread=0.05)
    slow = traffic(3000, ttft_s=0.3 * 1.3, ttft_spread=0.05)
    ttft = compare(slow, live, GUARDS).result("p95_ttft")
    assert ttft.verdict is Verdict.WORSE, ttft.reason
    assert "every TTFT slower" in ttft.reason
    mild = traffic(3000, ttft_s=0.3 * 1.1, ttft_spread=0.05)
    assert compare(mild, live, GUARDS).result("p95_ttft").verdict is not Verdict.WORSE

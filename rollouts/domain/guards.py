"""The rollout guards: a candidate's figures against the live version's, sequentially.

Public surface: ``GUARD_NAMES``, ``JUDGE_GUARD``, ``JudgeCheck``, ``PlanError``,
``GuardThresholds``, ``parse_thresholds``, ``threshold_problems``,
``is_finite_number``, ``Verdict``, ``GuardResult``, ``GuardReport``, ``compare``,
``baseline_roles``.

Pure: no Django, no I/O, no clock. The live guard task (every minute) and the
fleet-simulator drill both sum ``metering.domain.figures.VersionFigures`` over the
same window for the candidate (canary or shadow) and the live version and hand
both here.

Each guard answers one of three things at every look (issue 38): **worse**
(the evidence says the candidate is worse than live by more than the guard's
threshold: roll back), **not worse** (the evidence says it is within the
threshold: the step may advance) or **undecided** (hold). The evidence is an
anytime-valid confidence sequence (``rollouts.domain.sequential``, the mixture
SPRT Statsig and Optimizely run), so looking every guard period keeps the
error rates at ``alpha``; docs/rollouts.md#sequential-guards says why this one.

- ``error_rate``: errors over requests; the sequence on the difference of the
  two rates against ``error_rate_points``.
- ``refusal_rate``: refusals over answered requests; the same.
- ``p95_ttft``: the candidate's share of TTFTs past live's p95 times
  ``1 + ratio`` (and ``p95_ttft_min_s`` above it) against 5%: the candidate's
  p95 is past that cutoff exactly when more than 5% of its TTFTs are; also worse
  when the whole distribution's mean log TTFT moved past ``log(1 + ratio)``
  (the tail alone has little power on a uniform slowdown).
- ``output_length``: the ratio of the mean output lengths less one, either way
  (a broken chat template gives short answers, a looping one long ones), from
  the histograms' means and variances.
- ``judge_win_rate`` (only with a ``JudgeCheck``: the plan names a judge): the
  candidate's win rate in the live-answer judge's pairwise verdicts against the
  live version's answer to the same request (a win 1, a tie 1/2, a loss 0;
  unreadable replies left out), a confidence sequence on its mean against
  ``min_win_rate``. Two equal versions score 1/2. A judge that people's labels
  do not trust (``trusted`` False) is shown with verdict ``off``: it neither
  holds nor trips (issue 38: a judge below its agreement floor cannot gate).

Each guard needs ``min_samples`` on each side (requests, TTFT samples or answers)
before it says not worse or undecided: below that it is ``too_few``. A rate
guard may still say worse below it when its interval lies wholly past the
threshold (ten refusals in ten answers against none). A guard that cannot be
computed (live has no answers, live's answers average no tokens) is ``too_few``
too, with the reason: a guard never raises on figures. Each result carries the
interval (``lower``, ``upper``, in the change's units) and ``samples_needed``,
the candidate samples at which figures like these would decide (the expected
time to a decision follows from it and the candidate's traffic).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metering.domain.figures import (
    TTFT_BOUNDS_S,
    Role,
    VersionFigures,
    output_value,
    ttft_value,
)
from rollouts.domain import sequential

__all__ = [
    "GUARD_NAMES",
    "JUDGE_GUARD",
    "GuardReport",
    "GuardResult",
    "GuardThresholds",
    "JudgeCheck",
    "PlanError",
    "Verdict",
    "baseline_roles",
    "compare",
    "is_finite_number",
    "parse_thresholds",
    "threshold_problems",
]

GUARD_NAMES: tuple[str, ...] = (
    "error_rate",
    "p95_ttft",
    "output_length",
    "refusal_rate",
)
# The fifth guard, present only when the plan names a live-answer judge.
JUDGE_GUARD = "judge_win_rate"

# The p95 TTFT guard reads the candidate's share of TTFTs past live's p95.
_TTFT_QUANTILE = 0.95


class PlanError(ValueError):
    """A rollout plan or its thresholds are invalid.

    ``problems`` holds (param, message) pairs, every problem found, with params
    such as ``"steps[2].percent"`` or ``"thresholds.alpha"`` (the API's 400 body).
    Defined here, not in ``plan``, because ``plan`` imports this module.
    """

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = list(problems)
        super().__init__(
            "; ".join(f"{param}: {message}" for param, message in problems)
        )


@dataclass(frozen=True, slots=True)
class GuardThresholds:
    """Roll back when, against the live version, a guard moves more than this.

    The seed's values: error rate +0.5 points, p95 TTFT +20% (and at least
    ``p95_ttft_min_s``), average output length shifted by 15% either way; refusal
    rate +2 points. ``alpha``: the
    significance a difference needs to trip (one in a hundred windows of pure
    chance past a threshold would trip). ``min_samples``: per side and per guard,
    the fewest samples for any verdict.
    """

    error_rate_points: float = 0.5
    p95_ttft_ratio: float = 0.20
    # And by at least this much: a few milliseconds on a fast model's TTFT (a
    # shadow copy's own connection, a bucket's 10%) are no regression users feel.
    p95_ttft_min_s: float = 0.05
    output_length_ratio: float = 0.15
    refusal_rate_points: float = 2.0
    alpha: float = 0.01
    min_samples: int = 20

    def to_json(self) -> dict[str, float | int]:
        """Return the thresholds as JSON (``parse_thresholds`` reads it back)."""
        return {
            "error_rate_points": self.error_rate_points,
            "p95_ttft_ratio": self.p95_ttft_ratio,
            "p95_ttft_min_s": self.p95_ttft_min_s,
            "output_length_ratio": self.output_length_ratio,
            "refusal_rate_points": self.refusal_rate_points,
            "alpha": self.alpha,
            "min_samples": self.min_samples,
        }


@dataclass(frozen=True, slots=True)
class JudgeCheck:
    """The judge guard's setting at one evaluation.

    ``min_win_rate``: the candidate's lowest acceptable win rate against live
    (the plan's ``judge.min_win_rate``). ``trusted``: the judge's agreement with
    people is at its floor (or not yet measured); False makes the guard ``off``.
    ``agreement``: one sentence on that agreement, shown with the guard.
    """

    min_win_rate: float
    trusted: bool = True
    agreement: str = ""


_POINTS = ("error_rate_points", "refusal_rate_points")
_RATIOS = ("p95_ttft_ratio", "output_length_ratio", "p95_ttft_min_s")
_THRESHOLD_KEYS = frozenset(GuardThresholds().to_json())


def is_finite_number(value: object) -> bool:
    """Return whether ``value`` is a finite JSON number (a bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float: finite, but no threshold
        return False


def threshold_problems(
    data: object, prefix: str = ""
) -> tuple[GuardThresholds | None, list[tuple[str, str]]]:
    """Return the thresholds in ``data`` and the problems found (params prefixed).

    Missing keys take the defaults. ``plan.parse_plan`` calls it so that a plan's
    problems and its thresholds' come in one ``PlanError``.
    """
    if not isinstance(data, Mapping):
        return None, [(prefix.rstrip(".") or "thresholds", "must be an object")]
    problems: list[tuple[str, str]] = [
        (f"{prefix}{key}", "unknown key") for key in data if key not in _THRESHOLD_KEYS
    ]
    values: dict[str, Any] = {}
    for key in sorted(_THRESHOLD_KEYS & set(data)):
        value = data[key]
        param = f"{prefix}{key}"
        if key == "min_samples":
            if not isinstance(value, int) or isinstance(value, bool):
                problems.append((param, "must be a whole number"))
            elif value < 1:
                problems.append((param, "must be at least 1"))
            else:
                values[key] = value
            continue
        if not is_finite_number(value):
            problems.append((param, "must be a finite number"))
        elif key == "alpha" and not 0.0 < value < 1.0:
            problems.append((param, "must be greater than 0 and less than 1"))
        elif key in _POINTS and not 0.0 <= value <= 100.0:
            problems.append((param, "must be between 0 and 100 points"))
        elif key in _RATIOS and value < 0.0:
            problems.append((param, "must not be negative"))
        else:
            values[key] = float(value)
    if problems:
        return None, problems
    return GuardThresholds(**values), []


def parse_thresholds(data: Mapping[str, Any]) -> GuardThresholds:
    """Return the thresholds in ``data`` (JSON; missing keys take the defaults).

    Raises:
        PlanError: unknown keys, non-numbers (bools included), values out of range.
    """
    thresholds, problems = threshold_problems(data)
    if thresholds is None:
        raise PlanError(problems)
    return thresholds


class Verdict(enum.StrEnum):
    """One guard's verdict on one evaluation: worse, not worse, or undecided."""

    NOT_WORSE = "not_worse"  # the evidence says within the threshold: may advance
    WORSE = "worse"  # the evidence says past the threshold: roll back
    UNDECIDED = "undecided"  # neither yet: hold
    TOO_FEW = "too_few"  # not enough samples (or nothing to compare) for a verdict
    OFF = "off"  # shown, but does not gate (a judge people do not trust)
    # The names before issue 38 (a pass was "not past the threshold, or not
    # significant", a trip "past it and significant").
    PASS = "not_worse"
    TRIP = "worse"


@dataclass(frozen=True, slots=True)
class GuardResult:
    """One guard's verdict, with the figures behind it.

    ``candidate`` and ``live``: rates as fractions (0.02 is 2%), the p95 TTFT in
    seconds, the mean output length in tokens; None when a side has nothing to
    read. ``change``: percentage points for rates (candidate minus live), the
    relative change for TTFT and length (0.3 is 30% above live). ``p_value``:
    None when no test ran. ``reason``: one sentence for the console.
    ``candidate_samples`` and ``live_samples``: what the guard counted on each
    side (requests, TTFT samples or answers), which ``plan.decide_step`` reads
    to tell "nothing observable" from "too little yet".
    """

    name: str
    verdict: Verdict
    candidate: float | None
    live: float | None
    change: float | None
    p_value: float | None
    reason: str
    candidate_samples: int = 0
    live_samples: int = 0
    lower: float | None = None
    upper: float | None = None
    samples_needed: int | None = None

    def to_json(self) -> dict[str, object]:
        """Return the result as JSON."""
        return {
            "name": self.name,
            "verdict": self.verdict.value,
            "candidate": self.candidate,
            "live": self.live,
            "change": self.change,
            "p_value": self.p_value,
            "reason": self.reason,
            "candidate_samples": self.candidate_samples,
            "live_samples": self.live_samples,
            "lower": self.lower,
            "upper": self.upper,
            "samples_needed": self.samples_needed,
        }


@dataclass(frozen=True, slots=True)
class GuardReport:
    """Every guard's result on one window, in ``GUARD_NAMES`` order."""

    results: tuple[GuardResult, ...]
    candidate_requests: int
    live_requests: int

    @property
    def tripped(self) -> tuple[GuardResult, ...]:
        """The results that tripped (a rollback)."""
        return tuple(r for r in self.results if r.verdict is Verdict.TRIP)

    @property
    def undecided(self) -> tuple[GuardResult, ...]:
        """The results neither worse nor not worse yet (``too_few`` included)."""
        return tuple(
            r for r in self.results if r.verdict in (Verdict.UNDECIDED, Verdict.TOO_FEW)
        )

    @property
    def too_few(self) -> tuple[GuardResult, ...]:
        """The results without enough samples for a verdict."""
        return tuple(r for r in self.results if r.verdict is Verdict.TOO_FEW)

    def result(self, name: str) -> GuardResult:
        """Return the result of the guard ``name``; KeyError if there is none."""
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def summary(self) -> str:
        """Return one line: what tripped, else what lacks samples, else a pass."""
        counts = (
            f"({self.candidate_requests} candidate requests, {self.live_requests} live)"
        )
        if tripped := self.tripped:
            return f"worse: {', '.join(r.name for r in tripped)} {counts}"
        if too_few := self.too_few:
            return f"too few samples: {', '.join(r.name for r in too_few)} {counts}"
        if undecided := self.undecided:
            return f"undecided: {', '.join(r.name for r in undecided)} {counts}"
        return f"all guards not worse {counts}"

    def to_json(self) -> dict[str, object]:
        """Return the report as JSON (stored with each guard evaluation)."""
        return {
            "results": [r.to_json() for r in self.results],
            "candidate_requests": self.candidate_requests,
            "live_requests": self.live_requests,
            "summary": self.summary(),
        }


def compare(
    candidate: VersionFigures,
    live: VersionFigures,
    thresholds: GuardThresholds,
    judge: JudgeCheck | None = None,
) -> GuardReport:
    """Return every guard's verdict on ``candidate`` against ``live``.

    Both sides should cover the same window (and, for a canary, the same kind of
    traffic). Never raises on figures: what cannot be judged is ``too_few``.
    With ``judge``, the judge guard follows the four others.
    """
    extra = () if judge is None else (_judge_guard(candidate, judge, thresholds),)
    return GuardReport(
        results=(
            _rate_guard(
                "error_rate",
                "error rate",
                "requests",
                candidate.error_count,
                candidate.requests,
                live.error_count,
                live.requests,
                thresholds.error_rate_points,
                thresholds,
            ),
            _ttft_guard(candidate, live, thresholds),
            _output_guard(candidate, live, thresholds),
            _rate_guard(
                "refusal_rate",
                "refusal rate",
                "answers",
                candidate.refusals,
                candidate.answered,
                live.refusals,
                live.answered,
                thresholds.refusal_rate_points,
                thresholds,
            ),
            *extra,
        ),
        candidate_requests=candidate.requests,
        live_requests=live.requests,
    )


def _too_few(
    name: str, label: str, what: str, n_candidate: int, n_live: int, need: int
) -> str:
    return (
        f"{label}: too few {what} ({n_candidate} on the candidate, {n_live} on "
        f"live; needs {need} each)"
    )


def _rate_guard(
    name: str,
    label: str,
    what: str,
    k_candidate: int,
    n_candidate: int,
    k_live: int,
    n_live: int,
    limit_points: float,
    thresholds: GuardThresholds,
) -> GuardResult:
    """A rate guard, sequential: the difference's confidence sequence against
    ``limit_points`` (``sequential.difference_interval``).

    Worse when the interval's lower end is past the limit, not worse when its
    upper end is within it, else undecided. ``p_value``: the always-valid
    p-value of "no worse than the limit" at this look (``1 / ratio``), for the
    record; the verdict reads the interval.
    """
    # Figures summed from well-formed buckets never have k > n; clamp anyway so a
    # malformed window reads as a rate of at most 100% instead of raising.
    n_c, n_l = max(0, n_candidate), max(0, n_live)
    k_c, k_l = min(max(0, k_candidate), n_c), min(max(0, k_live), n_l)
    rate_c = k_c / n_c if n_c else None
    rate_l = k_l / n_l if n_l else None
    change = (
        (rate_c - rate_l) * 100.0 if rate_c is not None and rate_l is not None else None
    )
    digits = 2 if limit_points < 1.0 else 1
    limit = limit_points / 100.0
    scales = sequential.rate_scales(limit)
    alpha = thresholds.alpha
    needed = sequential.samples_to_decide(
        rate_c if rate_c is not None else (rate_l or 0.0),
        rate_l if rate_l is not None else (rate_c or 0.0),
        limit,
        alpha=alpha,
        scales=scales,
        live_per_candidate=(n_l / n_c) if n_c and n_l else 1.0,
    )
    interval = sequential.difference_interval(
        k_c, n_c, k_l, n_l, alpha=alpha, scales=scales
    )
    lower = interval.lower * 100.0 if math.isfinite(interval.lower) else None
    upper = interval.upper * 100.0 if math.isfinite(interval.upper) else None

    def common(verdict: Verdict, p_value: float | None, reason: str) -> GuardResult:
        return GuardResult(
            name,
            verdict,
            rate_c,
            rate_l,
            change,
            p_value,
            reason,
            n_c,
            n_l,
            lower,
            upper,
            needed,
        )

    need = thresholds.min_samples
    # Below the minimum a rate guard may still call worse: its interval is valid
    # at any count (the half-count smoothing widens it), and ten refusals in ten
    # answers against none must not wait for twenty. It never calls not worse.
    is_overwhelming = lower is not None and lower > limit_points
    if (n_c < need or n_l < need) and not is_overwhelming:
        return common(
            Verdict.TOO_FEW, None, _too_few(name, label, what, n_c, n_l, need)
        )
    assert rate_c is not None and rate_l is not None and change is not None
    assert lower is not None and upper is not None
    p_value = sequential.always_valid_p(
        interval.estimate - limit, interval.variance, scales
    )
    figures = (
        f"{label} {rate_c * 100:.{digits}f}% against {rate_l * 100:.{digits}f}% on "
        f"live ({change:+.{digits}f} points, {1 - alpha:.0%} sequence "
        f"{lower:+.{digits}f}..{upper:+.{digits}f}"
    )
    if lower > limit_points:
        return common(
            Verdict.WORSE,
            p_value,
            f"{figures}: worse than +{limit_points:.{digits}f})",
        )
    if upper <= limit_points:
        return common(
            Verdict.NOT_WORSE,
            p_value,
            f"{figures}: not worse than +{limit_points:.{digits}f})",
        )
    wait = f"; about {needed} {what} decide" if needed is not None else ""
    return common(
        Verdict.UNDECIDED,
        p_value,
        f"{figures} spans +{limit_points:.{digits}f}: undecided{wait})",
    )


def _ttft_guard(
    candidate: VersionFigures, live: VersionFigures, thresholds: GuardThresholds
) -> GuardResult:
    """p95 TTFT above live's by the ratio (and the floor), sequentially.

    The candidate's p95 is past ``cutoff`` (live's p95 times ``1 + ratio``, and
    at least ``p95_ttft_min_s`` above it) exactly when more than 5% of its TTFTs
    are: the guard is a confidence sequence on that share against 5%. Live's
    p95 is taken as known (its side is the larger; docs/rollouts.md).
    """
    name, label = "p95_ttft", "p95 TTFT"
    n_c, n_l = _count(candidate.ttft), _count(live.ttft)
    p95_c = _positive_quantile(candidate, 0.95)
    p95_l = _positive_quantile(live, 0.95)
    change = p95_c / p95_l - 1.0 if p95_c is not None and p95_l else None
    ratio, floor = thresholds.p95_ttft_ratio, thresholds.p95_ttft_min_s
    need = thresholds.min_samples

    def too_few(reason: str) -> GuardResult:
        return GuardResult(
            name, Verdict.TOO_FEW, p95_c, p95_l, change, None, reason, n_c, n_l
        )

    if n_c < need or n_l < need:
        return too_few(_too_few(name, label, "TTFT samples", n_c, n_l, need))
    if p95_c is None or p95_l is None or change is None:
        return too_few(f"{label}: live has no p95 to compare with")
    cutoff = max(p95_l * (1.0 + ratio), p95_l + floor)
    # Read as ``ttft_quantile`` reads a p95: a bucket stands for its upper bound.
    above = sum(
        c for i, c in candidate.ttft.items() if c > 0 and _ttft_upper(i) > cutoff
    )
    tail = 1.0 - _TTFT_QUANTILE
    scales = sequential.rate_scales(tail / 4.0)
    share = above / n_c
    variance = sequential.proportion_variance(above, n_c)
    radius = sequential.mixture_radius(variance, thresholds.alpha, scales)
    needed = sequential.samples_to_decide(
        share, 0.0, tail, alpha=thresholds.alpha, scales=scales, live_per_candidate=1e9
    )
    p_value = sequential.always_valid_p(share - tail, variance, scales)
    figures = (
        f"{label} {p95_c:.3f} s against {p95_l:.3f} s on live ({change * 100:+.1f}%; "
        f"{share:.1%} of TTFTs above {cutoff:.3f} s, {1 - thresholds.alpha:.0%} "
        f"sequence {max(0.0, share - radius):.1%}..{min(1.0, share + radius):.1%} "
        f"against {tail:.0%}"
    )
    shift = _log_shift_interval(candidate, live, thresholds.alpha)
    is_shifted = (
        shift is not None and shift[0] > math.log1p(ratio) and p95_c - p95_l > floor
    )
    if is_shifted and shift is not None:
        figures += (
            f"; every TTFT slower: log shift {shift[0]:+.3f}..{shift[1]:+.3f} "
            f"against {math.log1p(ratio):+.3f}"
        )
    verdict, word = _three_way(
        is_worse=share - radius > tail or is_shifted,
        is_not_worse=share + radius <= tail,
    )
    return GuardResult(
        name,
        verdict,
        p95_c,
        p95_l,
        change,
        p_value,
        f"{figures}: {word})",
        n_c,
        n_l,
        (share - radius - tail) * 100.0,
        (share + radius - tail) * 100.0,
        needed,
    )


def _log_shift_interval(
    candidate: VersionFigures, live: VersionFigures, alpha: float
) -> tuple[float, float] | None:
    """The confidence sequence on the mean log TTFT, candidate minus live.

    The tail share alone has little power on a uniform slowdown (30% slower
    everywhere puts only a few percent past live's p95 x 1.2); a whole
    distribution shifted by more than the ratio has every quantile past it, the
    p95 included. None when a side has no TTFT.
    """
    sides = []
    for figures in (candidate, live):
        items = sorted(
            (math.log(ttft_value(i)), c) for i, c in figures.ttft.items() if c > 0
        )
        n = sum(c for _, c in items)
        if not n:
            return None
        mean = math.fsum(v * c for v, c in items) / n
        var = math.fsum(c * (v - mean) ** 2 for v, c in items) / n
        # A bucket's width (10%) as the least spread: one bucket is no certainty.
        sides.append((mean, max(var, 0.01) / n))
    estimate = sides[0][0] - sides[1][0]
    radius = sequential.mixture_radius(
        sides[0][1] + sides[1][1], alpha, sequential.rate_scales(0.05, top=2.0)
    )
    return estimate - radius, estimate + radius


def _ttft_upper(index: int) -> float:
    return TTFT_BOUNDS_S[index] if index < len(TTFT_BOUNDS_S) else math.inf


def _three_way(*, is_worse: bool, is_not_worse: bool) -> tuple[Verdict, str]:
    if is_worse:
        return Verdict.WORSE, "worse"
    if is_not_worse:
        return Verdict.NOT_WORSE, "not worse"
    return Verdict.UNDECIDED, "undecided"


def _output_guard(
    candidate: VersionFigures, live: VersionFigures, thresholds: GuardThresholds
) -> GuardResult:
    """Mean output length off live's by the ratio either way, sequentially.

    A confidence sequence on the ratio of the means less one (the delta method
    on the histograms' means and variances): worse when it lies wholly beyond
    the ratio on one side, not worse when wholly within, else undecided.
    """
    name, label = "output_length", "average output"
    n_c, n_l = max(0, candidate.answered), max(0, live.answered)
    mean_c = candidate.mean_output_tokens if n_c else None
    mean_l = live.mean_output_tokens if n_l else None
    change = mean_c / mean_l - 1.0 if mean_c is not None and mean_l else None

    def common(
        verdict: Verdict,
        p_value: float | None,
        reason: str,
        bounds: tuple[float | None, float | None, int | None] = (None, None, None),
    ) -> GuardResult:
        return GuardResult(
            name, verdict, mean_c, mean_l, change, p_value, reason, n_c, n_l, *bounds
        )

    need = thresholds.min_samples
    if n_c < need or n_l < need:
        return common(
            Verdict.TOO_FEW, None, _too_few(name, label, "answers", n_c, n_l, need)
        )
    if mean_c is None or mean_l is None or change is None:
        return common(
            Verdict.TOO_FEW,
            None,
            f"{label}: live's answers average no tokens, nothing to compare with",
        )
    var_c, count_c = _histogram_variance(candidate.output)
    var_l, count_l = _histogram_variance(live.output)
    if not count_c or not count_l:
        return common(
            Verdict.TOO_FEW, None, f"{label}: no output-length histogram to test"
        )
    ratio = thresholds.output_length_ratio
    # Delta method for mean_c / mean_l; a floor of one token's spread keeps a
    # side of identical answers (a fixed refusal) from claiming certainty.
    variance = max(var_c, 1.0) / (count_c * mean_l**2) + mean_c**2 * max(var_l, 1.0) / (
        count_l * mean_l**4
    )
    scales = sequential.rate_scales(ratio, top=4.0)
    radius = sequential.mixture_radius(variance, thresholds.alpha, scales)
    lower, upper = change - radius, change + radius
    gap = min(abs(abs(change) - ratio), ratio) or 1e-9
    needed = _samples_for(variance * count_c, gap, thresholds.alpha, scales)
    p_value = sequential.always_valid_p(abs(change) - ratio, variance, scales)
    figures = (
        f"{label} {mean_c:.1f} tokens against {mean_l:.1f} on live "
        f"({change * 100:+.1f}%, {1 - thresholds.alpha:.0%} sequence "
        f"{lower * 100:+.1f}..{upper * 100:+.1f}% against ±{ratio * 100:.1f}%"
    )
    verdict, word = _three_way(
        is_worse=lower > ratio or upper < -ratio,
        is_not_worse=-ratio <= lower and upper <= ratio,
    )
    return common(
        verdict, p_value, f"{figures}: {word})", (lower * 100, upper * 100, needed)
    )


def _histogram_variance(histogram: Mapping[int, int]) -> tuple[float, int]:
    """The variance of the output lengths the histogram's buckets stand for."""
    # Sorted and summed exactly: the same histogram in any order (the live
    # rows' or the drill's buckets) gives the same bits.
    items = sorted((output_value(i), c) for i, c in histogram.items() if c > 0)
    count = sum(c for _, c in items)
    if not count:
        return 0.0, 0
    mean = math.fsum(v * c for v, c in items) / count
    return math.fsum(c * (v - mean) ** 2 for v, c in items) / count, count


def _samples_for(
    unit_variance: float, gap: float, alpha: float, scales: tuple[float, ...]
) -> int | None:
    """The samples at which an estimate of ``unit_variance / n`` clears ``gap``."""
    if not unit_variance > 0 or not math.isfinite(unit_variance):
        return None
    low, high = 1, 1
    while sequential.mixture_radius(unit_variance / high, alpha, scales) >= gap:
        low, high = high, high * 2
        if high > 10_000_000:
            return None
    while low < high:
        mid = (low + high) // 2
        if sequential.mixture_radius(unit_variance / mid, alpha, scales) < gap:
            high = mid
        else:
            low = mid + 1
    return high


def _positive_quantile(figures: VersionFigures, q: float) -> float | None:
    """``ttft_quantile`` over the positive counts only (a malformed bucket ignored)."""
    clean = VersionFigures(ttft={i: c for i, c in figures.ttft.items() if c > 0})
    return clean.ttft_quantile(q)


def _count(histogram: Mapping[int, int]) -> int:
    return sum(c for c in histogram.values() if c > 0)


def baseline_roles(candidate: Role) -> tuple[Role, ...]:
    """Return the live version's roles a candidate is compared with: a canary with
    its baseline band (conversations that began on the live version beside the
    canary's, in a band as wide: ``routing.domain.sticky``), a shadow with all of
    it (its copies sample every request)."""
    if candidate == Role.CANARY:
        return (Role.BASELINE,)
    return (Role.LIVE, Role.BASELINE)


def judge_interval(
    judged: Mapping[str, int], *, alpha: float, scales: tuple[float, ...]
) -> tuple[int, float | None, sequential.Interval, float]:
    """Return the judged pairs, the win rate, its confidence sequence and the
    smoothed per-pair variance of the scores (a win 1, a tie 1/2, a loss 0).

    Half a win and half a loss are added to the variance's counts (as
    ``sequential`` smooths rates), so a run of ties alone still has one.
    """
    wins = max(0, judged.get("win", 0))
    ties = max(0, judged.get("tie", 0))
    losses = max(0, judged.get("loss", 0))
    n = wins + ties + losses
    if n == 0:
        return 0, None, sequential.Interval(0.5, -math.inf, math.inf, math.inf), 0.25
    rate = (wins + ties / 2.0) / n
    w_s, l_s, n_s = wins + 0.5, losses + 0.5, n + 1.0
    mean_s = (w_s + ties / 2.0) / n_s
    per_pair = (
        w_s * (1.0 - mean_s) ** 2 + ties * (0.5 - mean_s) ** 2 + l_s * mean_s**2
    ) / n_s
    radius = sequential.mixture_radius(per_pair / n, alpha, scales)
    return (
        n,
        rate,
        sequential.Interval(rate, rate - radius, rate + radius, per_pair / n),
        per_pair,
    )


def _judge_samples_needed(
    rate: float, floor: float, per_pair: float, alpha: float, scales: tuple[float, ...]
) -> int | None:
    """The judged pairs at which a win rate like ``rate`` would clear ``floor``."""
    most = sequential.largest_variance(abs(rate - floor), alpha=alpha, scales=scales)
    if most <= 0.0 or per_pair <= 0.0:
        return None
    needed = math.ceil(per_pair / most)
    return needed if needed <= 10_000_000 else None


def _judge_guard(
    candidate: VersionFigures, check: JudgeCheck, thresholds: GuardThresholds
) -> GuardResult:
    """The live-answer judge's win rate against ``check.min_win_rate``, sequentially."""
    floor = check.min_win_rate
    alpha = thresholds.alpha
    scales = sequential.rate_scales(max(0.5 - floor, 0.01))
    n, rate, interval, per_pair = judge_interval(
        candidate.judged, alpha=alpha, scales=scales
    )
    unreadable = max(0, candidate.judged.get("unreadable", 0))
    lower = interval.lower if math.isfinite(interval.lower) else None
    upper = interval.upper if math.isfinite(interval.upper) else None
    needed = _judge_samples_needed(
        rate if rate is not None else 0.5, floor, per_pair, alpha, scales
    )
    change = (rate - 0.5) * 100.0 if rate is not None else None
    agreement = f"; {check.agreement}" if check.agreement else ""
    unread = f", {unreadable} unreadable" if unreadable else ""

    def result(verdict: Verdict, reason: str) -> GuardResult:
        p_value = (
            sequential.always_valid_p(
                interval.estimate - floor, interval.variance, scales
            )
            if rate is not None
            else None
        )
        return GuardResult(
            JUDGE_GUARD,
            verdict,
            rate,
            0.5,
            change,
            p_value,
            reason + agreement,
            n,
            n,
            lower,
            upper,
            needed,
        )

    if rate is None or lower is None or upper is None:
        verdict = Verdict.OFF if not check.trusted else Verdict.TOO_FEW
        return result(verdict, f"judge win rate: no judged pairs yet{unread}")
    figures = (
        f"judge win rate {rate:.3f} over {n} pairs{unread} ({1 - alpha:.0%} "
        f"sequence {lower:.3f}..{upper:.3f}, floor {floor:.3f})"
    )
    if not check.trusted:
        return result(Verdict.OFF, f"{figures}: off, the judge may not gate")
    if upper < floor:
        return result(Verdict.WORSE, f"{figures}: worse than the floor")
    if n < thresholds.min_samples:
        return result(
            Verdict.TOO_FEW,
            f"judge win rate: too few judged pairs ({n}; needs "
            f"{thresholds.min_samples})",
        )
    if lower >= floor:
        return result(Verdict.NOT_WORSE, f"{figures}: not worse than the floor")
    wait = f"; about {needed} pairs decide" if needed is not None else ""
    return result(Verdict.UNDECIDED, f"{figures} spans the floor: undecided{wait}")

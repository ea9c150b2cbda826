"""The rollout guards: a candidate's figures against the live version's, Kayenta-style.

Public surface: ``GUARD_NAMES``, ``MWU_MAX_SAMPLES``, ``PlanError``,
``GuardThresholds``, ``parse_thresholds``, ``threshold_problems``,
``is_finite_number``, ``Verdict``, ``GuardResult``, ``GuardReport``, ``compare``,
``baseline_roles``.

Pure: no Django, no I/O, no clock. The live guard task (every minute) and the
fleet-simulator drill both sum ``metering.domain.figures.VersionFigures`` over the
same window for the candidate (canary or shadow) and the live version and hand
both here.

A guard trips only when two things hold at once: the candidate is worse than
live by more than the guard's threshold (the size of the harm), **and** a test
fit for the counts says the difference is not chance (``p < alpha``). Kayenta,
which Argo Rollouts uses, judges canaries the same way with a Mann-Whitney U
test. The threshold alone would trip on noise at a 1% canary (three errors in
thirty requests is +10 points); the test alone would trip on a harmless but
real +0.1 points at scale.

- ``error_rate``: errors over requests; one-sided Fisher exact test (exact at
  any count, so fit for a 1% canary's handful of requests).
- ``refusal_rate``: refusals over answered requests; the same test.
- ``p95_ttft``: the p95 read from the TTFT histograms
  (``VersionFigures.ttft_quantile``) against live's times ``1 + ratio``; a
  one-sided Mann-Whitney U test (candidate slower) on the whole distributions,
  since a p95 alone has no usable small-sample test.
- ``output_length``: the mean output length's ratio to live's, either way (a
  broken chat template gives short answers, a looping one long ones); a
  two-sided Mann-Whitney U test on the output-length histograms.

Each guard needs ``min_samples`` on each side (requests, TTFT samples or answers)
before it gives any verdict: below that it is ``too_few``, never ``pass``, so a
plan waits rather than advancing blind. A guard that cannot be computed (live has
no answers, live's answers average no tokens) is ``too_few`` too, with the reason:
a guard never raises on figures.

Mann-Whitney on histograms: each bucket stands for its representative value
(``ttft_value``, ``output_value``) repeated by its count. Past
``MWU_MAX_SAMPLES`` samples on a side, that side's counts are scaled down in
proportion (rounded) before the expansion: the shape is kept and the p-value is
that of a sample of ``MWU_MAX_SAMPLES``, larger than the full sample's would be,
so the cap can only make a trip rarer, never cause one. At that size any
difference past a threshold is already far beyond ``alpha``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from metering.domain.figures import Role, VersionFigures, output_value, ttft_value

__all__ = [
    "GUARD_NAMES",
    "MWU_MAX_SAMPLES",
    "GuardReport",
    "GuardResult",
    "GuardThresholds",
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

# Per side, the most histogram samples expanded for a Mann-Whitney U test.
MWU_MAX_SAMPLES = 200_000


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
    """One guard's verdict on one window."""

    PASS = "pass"
    TRIP = "trip"
    TOO_FEW = "too_few"  # not enough samples (or nothing to compare) for a verdict


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
            return f"tripped: {', '.join(r.name for r in tripped)} {counts}"
        if too_few := self.too_few:
            return f"too few samples: {', '.join(r.name for r in too_few)} {counts}"
        return f"all guards pass {counts}"

    def to_json(self) -> dict[str, object]:
        """Return the report as JSON (stored with each guard evaluation)."""
        return {
            "results": [r.to_json() for r in self.results],
            "candidate_requests": self.candidate_requests,
            "live_requests": self.live_requests,
            "summary": self.summary(),
        }


def compare(
    candidate: VersionFigures, live: VersionFigures, thresholds: GuardThresholds
) -> GuardReport:
    """Return every guard's verdict on ``candidate`` against ``live``.

    Both sides should cover the same window (and, for a canary, the same kind of
    traffic). Never raises on figures: what cannot be judged is ``too_few``.
    """
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
        ),
        candidate_requests=candidate.requests,
        live_requests=live.requests,
    )


def _p(p_value: float) -> str:
    return f"p={p_value:.2g}"


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
    """A rate guard: trip past ``limit_points`` with a one-sided Fisher exact test."""
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

    def common(verdict: Verdict, p_value: float | None, reason: str) -> GuardResult:
        return GuardResult(
            name, verdict, rate_c, rate_l, change, p_value, reason, n_c, n_l
        )

    need = thresholds.min_samples
    if n_c < need or n_l < need:
        return common(
            Verdict.TOO_FEW, None, _too_few(name, label, what, n_c, n_l, need)
        )
    assert rate_c is not None and rate_l is not None and change is not None
    # Rows: candidate, live; columns: counted, not. "greater": the candidate's
    # odds of an error (a refusal) are higher than live's.
    p_value = _finite_p(
        stats.fisher_exact(
            [[k_c, n_c - k_c], [k_l, n_l - k_l]], alternative="greater"
        ).pvalue
    )
    figures = (
        f"{label} {rate_c * 100:.{digits}f}% against {rate_l * 100:.{digits}f}% on "
        f"live ({change:+.{digits}f} points"
    )
    # Compare the counts, not the rounded change: k_c/n_c - k_l/n_l > points/100.
    past = (k_c * n_l - k_l * n_c) * 100.0 > limit_points * n_c * n_l
    return _judge(
        common,
        figures,
        past=past,
        past_text=f"> {limit_points:.{digits}f}",
        within_text=f"within {limit_points:.{digits}f}",
        p_value=p_value,
        alpha=thresholds.alpha,
    )


def _judge(
    common: Callable[[Verdict, float | None, str], GuardResult],
    figures: str,
    *,
    past: bool,
    past_text: str,
    within_text: str,
    p_value: float,
    alpha: float,
) -> GuardResult:
    """Trip only when both the threshold is passed and the test is significant."""
    if not past:
        return common(
            Verdict.PASS, p_value, f"{figures}, {within_text}), {_p(p_value)}"
        )
    if p_value >= alpha:
        return common(
            Verdict.PASS,
            p_value,
            f"{figures} {past_text}), but {_p(p_value)} is not below {alpha:g}: "
            "not significant yet",
        )
    return common(Verdict.TRIP, p_value, f"{figures} {past_text}), {_p(p_value)}")


def _ttft_guard(
    candidate: VersionFigures, live: VersionFigures, thresholds: GuardThresholds
) -> GuardResult:
    """p95 TTFT above live's by the ratio, the candidate's TTFT stochastically greater."""
    name, label = "p95_ttft", "p95 TTFT"
    values_c = _expand(candidate.ttft, ttft_value)
    values_l = _expand(live.ttft, ttft_value)
    n_c, n_l = _count(candidate.ttft), _count(live.ttft)
    p95_c = _positive_quantile(candidate, 0.95)
    p95_l = _positive_quantile(live, 0.95)
    change = p95_c / p95_l - 1.0 if p95_c is not None and p95_l else None

    def common(verdict: Verdict, p_value: float | None, reason: str) -> GuardResult:
        return GuardResult(
            name, verdict, p95_c, p95_l, change, p_value, reason, n_c, n_l
        )

    need = thresholds.min_samples
    if n_c < need or n_l < need:
        return common(
            Verdict.TOO_FEW, None, _too_few(name, label, "TTFT samples", n_c, n_l, need)
        )
    if p95_c is None or p95_l is None or change is None:
        return common(
            Verdict.TOO_FEW, None, f"{label}: live has no p95 to compare with"
        )
    p_value = _mann_whitney(values_c, values_l, "greater")
    ratio = thresholds.p95_ttft_ratio
    figures = (
        f"{label} {p95_c:.3f} s against {p95_l:.3f} s on live ({change * 100:+.1f}%"
    )
    floor = thresholds.p95_ttft_min_s
    return _judge(
        common,
        figures,
        past=change > ratio and p95_c - p95_l > floor,
        past_text=f"> +{ratio * 100:.1f}% and +{floor * 1000:.0f} ms",
        within_text=f"within +{ratio * 100:.1f}% or +{floor * 1000:.0f} ms",
        p_value=p_value,
        alpha=thresholds.alpha,
    )


def _output_guard(
    candidate: VersionFigures, live: VersionFigures, thresholds: GuardThresholds
) -> GuardResult:
    """Mean output length off live's by the ratio either way, the shapes differing."""
    name, label = "output_length", "average output"
    n_c, n_l = max(0, candidate.answered), max(0, live.answered)
    mean_c = candidate.mean_output_tokens if n_c else None
    mean_l = live.mean_output_tokens if n_l else None
    change = mean_c / mean_l - 1.0 if mean_c is not None and mean_l else None

    def common(verdict: Verdict, p_value: float | None, reason: str) -> GuardResult:
        return GuardResult(
            name, verdict, mean_c, mean_l, change, p_value, reason, n_c, n_l
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
    values_c = _expand(candidate.output, output_value)
    values_l = _expand(live.output, output_value)
    if not values_c.size or not values_l.size:
        return common(
            Verdict.TOO_FEW, None, f"{label}: no output-length histogram to test"
        )
    p_value = _mann_whitney(values_c, values_l, "two-sided")
    ratio = thresholds.output_length_ratio
    figures = (
        f"{label} {mean_c:.1f} tokens against {mean_l:.1f} on live "
        f"({change * 100:+.1f}%"
    )
    return _judge(
        common,
        figures,
        past=abs(change) > ratio,
        past_text=f"beyond ±{ratio * 100:.1f}%",
        within_text=f"within ±{ratio * 100:.1f}%",
        p_value=p_value,
        alpha=thresholds.alpha,
    )


def _positive_quantile(figures: VersionFigures, q: float) -> float | None:
    """``ttft_quantile`` over the positive counts only (a malformed bucket ignored)."""
    clean = VersionFigures(ttft={i: c for i, c in figures.ttft.items() if c > 0})
    return clean.ttft_quantile(q)


def _count(histogram: Mapping[int, int]) -> int:
    return sum(c for c in histogram.values() if c > 0)


def _expand(
    histogram: Mapping[int, int], value: Callable[[int], float]
) -> NDArray[np.float64]:
    """Return the histogram as samples, scaled down to ``MWU_MAX_SAMPLES`` at most."""
    items = sorted((i, c) for i, c in histogram.items() if c > 0)
    if not items:
        return np.zeros(0, dtype=np.float64)
    values = np.array([value(i) for i, _ in items], dtype=np.float64)
    counts = np.array([c for _, c in items], dtype=np.int64)
    total = int(counts.sum())
    if total > MWU_MAX_SAMPLES:
        counts = np.rint(counts * (MWU_MAX_SAMPLES / total)).astype(np.int64)
    return np.repeat(values, counts)


def _mann_whitney(
    candidate: NDArray[np.float64], live: NDArray[np.float64], alternative: str
) -> float:
    """Return the Mann-Whitney U p-value (normal approximation, tie-corrected).

    Histogram samples are all ties within a bucket, so the exact method does not
    apply; with a single value on both sides nothing differs (p = 1).
    """
    if not candidate.size or not live.size:
        return 1.0
    if np.all(candidate == candidate[0]) and np.all(live == candidate[0]):
        return 1.0
    result = stats.mannwhitneyu(
        candidate, live, alternative=alternative, method="asymptotic"
    )
    return _finite_p(result.pvalue)


def _finite_p(value: Any) -> float:
    """A p-value as a float; NaN (a degenerate table) counts as no evidence."""
    p_value = float(value)
    return p_value if math.isfinite(p_value) else 1.0


def baseline_roles(candidate: Role) -> tuple[Role, ...]:
    """Return the live version's roles a candidate is compared with: a canary with
    its baseline band (conversations that began on the live version beside the
    canary's, in a band as wide: ``routing.domain.sticky``), a shadow with all of
    it (its copies sample every request)."""
    if candidate == Role.CANARY:
        return (Role.BASELINE,)
    return (Role.LIVE, Role.BASELINE)

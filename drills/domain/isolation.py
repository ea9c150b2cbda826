"""The seed's isolation test, judged: one team floods, the others must not notice.

Public surface: ``Sample``, ``TeamPhase``, ``summarise``, ``judge``, ``Verdict``.

"One team sends 10 times its limit. Every other team's p95 TTFT must not move, and
only the noisy team may see 429s." Here "must not move" is: within
``tolerance`` (10%) of the same team's baseline p95, measured in the same run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from simengine.domain.percentiles import percentile

__all__ = ["Sample", "TeamPhase", "Verdict", "judge", "summarise"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One request's outcome: its team, the phase, HTTP status and TTFT."""

    team: str
    phase: str  # "baseline" or "noisy"
    status: int
    ttft_s: float | None


@dataclass(frozen=True, slots=True)
class TeamPhase:
    """One team's figures in one phase."""

    team: str
    phase: str
    requests: int
    ok: int
    rate_limited: int
    other_errors: int
    p50_ttft_ms: float | None
    p95_ttft_ms: float | None


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the run kept the quiet teams isolated, and why not if it did not."""

    passed: bool
    reasons: tuple[str, ...]


def summarise(samples: Iterable[Sample]) -> list[TeamPhase]:
    """Return one row per (team, phase), sorted by team then phase."""
    groups: dict[tuple[str, str], list[Sample]] = {}
    for sample in samples:
        groups.setdefault((sample.team, sample.phase), []).append(sample)
    rows = []
    for (team, phase), group in sorted(groups.items()):
        ttfts = [
            s.ttft_s * 1000 for s in group if s.status == 200 and s.ttft_s is not None
        ]
        rows.append(
            TeamPhase(
                team=team,
                phase=phase,
                requests=len(group),
                ok=sum(1 for s in group if s.status == 200),
                rate_limited=sum(1 for s in group if s.status == 429),
                other_errors=sum(1 for s in group if s.status not in (200, 429)),
                p50_ttft_ms=percentile(ttfts, 0.50),
                p95_ttft_ms=percentile(ttfts, 0.95),
            )
        )
    return rows


def judge(
    rows: Sequence[TeamPhase], *, noisy_team: str, tolerance: float = 0.10
) -> Verdict:
    """Apply the seed's rule to a summary; list every way the run broke it."""
    reasons = []
    by_key = {(row.team, row.phase): row for row in rows}
    quiet = sorted({row.team for row in rows} - {noisy_team})
    for team in quiet:
        base = by_key.get((team, "baseline"))
        loud = by_key.get((team, "noisy"))
        if (
            base is None
            or loud is None
            or base.p95_ttft_ms is None
            or loud.p95_ttft_ms is None
        ):
            reasons.append(f"{team}: no successful requests in a phase")
            continue
        if loud.p95_ttft_ms > base.p95_ttft_ms * (1 + tolerance):
            reasons.append(
                f"{team}: p95 TTFT {loud.p95_ttft_ms:.1f} ms under the flood vs "
                f"{base.p95_ttft_ms:.1f} ms baseline (> {tolerance:.0%})"
            )
        for row in (base, loud):
            if row.rate_limited or row.other_errors:
                reasons.append(
                    f"{team}: {row.rate_limited} 429s and {row.other_errors} other "
                    f"errors in the {row.phase} phase"
                )
    noisy = by_key.get((noisy_team, "noisy"))
    if noisy is None or noisy.rate_limited == 0:
        reasons.append(f"{noisy_team}: the flood was never rate limited")
    return Verdict(passed=not reasons, reasons=tuple(reasons))

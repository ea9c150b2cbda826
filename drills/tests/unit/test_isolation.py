"""Judging the isolation test: the seed's rule on hand-made samples."""

from __future__ import annotations

from collections.abc import Sequence

from drills.domain.isolation import Sample, judge, summarise


def samples(
    team: str,
    phase: str,
    ttfts_ms: Sequence[float],
    *,
    statuses: Sequence[int] | None = None,
) -> list[Sample]:
    statuses = statuses or [200] * len(ttfts_ms)
    return [
        Sample(
            team=team,
            phase=phase,
            status=status,
            ttft_s=ms / 1000 if status == 200 else None,
        )
        for ms, status in zip(ttfts_ms, statuses, strict=True)
    ]


def test_summarise_counts_statuses_and_ttfts() -> None:
    rows = summarise(
        samples("q", "baseline", [10, 20, 30])
        + samples("n", "noisy", [10, 0, 0], statuses=[200, 429, 503])
    )
    by_team = {row.team: row for row in rows}
    assert by_team["q"].p95_ttft_ms == 30
    assert (by_team["n"].ok, by_team["n"].rate_limited, by_team["n"].other_errors) == (
        1,
        1,
        1,
    )


def test_judge_passes_when_quiet_teams_hold_and_only_the_noisy_one_is_limited() -> None:
    rows = summarise(
        samples("q", "baseline", [40] * 19 + [100])
        + samples("q", "noisy", [41] * 19 + [109])
        + samples("n", "noisy", [40, 0], statuses=[200, 429])
    )
    assert judge(rows, noisy_team="n").passed


def test_judge_fails_on_a_slower_quiet_team_or_a_quiet_429() -> None:
    rows = summarise(
        samples("q", "baseline", [40] * 20)
        + samples("q", "noisy", [40] * 18 + [60, 60])
        + samples("r", "baseline", [40] * 5)
        + samples("r", "noisy", [40, 0], statuses=[200, 429])
        + samples("n", "noisy", [0], statuses=[429])
    )
    verdict = judge(rows, noisy_team="n")
    assert not verdict.passed
    assert any(reason.startswith("q: p95") for reason in verdict.reasons)
    assert any(reason.startswith("r: 1 429s") for reason in verdict.reasons)


def test_judge_fails_when_the_flood_was_never_limited() -> None:
    rows = summarise(
        samples("q", "baseline", [40])
        + samples("q", "noisy", [40])
        + samples("n", "noisy", [40])
    )
    assert "n: the flood was never rate limited" in judge(rows, noisy_team="n").reasons

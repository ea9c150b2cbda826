"""The billing drill's comparison (drills.domain.billing_drill): it passes a bill
equal to what clients were told, and catches any difference."""

from __future__ import annotations

from typing import Any

from drills.domain.billing_drill import (
    Figures,
    Told,
    compare,
    cost_checks,
    expected_of,
)

TEAMS = ["wide", "tight"]
REGIONS = ["east", "west"]


def _told() -> list[Told]:
    """Eleven streams: complete ones in both regions, one cut, one refused with a
    429 (a team's limit) and one with a 503 (a batch stream shed)."""
    told = [
        Told(team, region, "complete", prompt_tokens=15, completion_tokens=10 + i)
        for i, (team, region) in enumerate([(t, r) for t in TEAMS for r in REGIONS] * 2)
    ]
    told.append(Told("wide", "east", "cut", tokens_seen=3, max_tokens=20))
    told.append(Told("tight", "west", "refused", status=429))
    told.append(Told("wide", "west", "refused", status=503))
    return told


def _bill(cut_output: int = 4) -> dict[tuple[str, str], Figures]:
    """What the platform bills for ``_told()``, the cut stream at ``cut_output``."""
    bill: dict[tuple[str, str], Figures] = {}
    for t in _told():
        if t.outcome == "complete":
            add = Figures(1, t.prompt_tokens, t.cached_tokens, t.completion_tokens)
        elif t.outcome == "cut":
            add = Figures(1, 15, 0, cut_output)
        elif t.status == 503:
            add = Figures(shed=1)
        else:
            add = Figures(rate_limited=1)
        bill[(t.team, t.region)] = bill.get((t.team, t.region), Figures()) + add
    return bill


def test_a_bill_equal_to_what_was_told_passes() -> None:
    bill = _bill()
    report = compare(
        _told(), {"rows": bill, "csv": bill, "org": bill}, regions=REGIONS, teams=TEAMS
    )

    assert report.passed
    total = report.lines[-1]
    assert total.region == "total"
    assert total.sources["rows"] == Figures(
        9, 135, 0, 4 + sum(range(10, 18)), rate_limited=1, shed=1
    )
    assert report.streams == {
        "sent": 11,
        "complete": 8,
        "cut": 1,
        "refused": 2,
        "refused_429": 1,
        "refused_503": 1,
    }


def test_one_token_more_in_one_region_is_caught_there_and_in_the_total() -> None:
    bill = _bill()
    off = dict(bill)
    off[("tight", "west")] = off[("tight", "west")] + Figures(output_tokens=1)
    report = compare(
        _told(), {"rows": bill, "csv": off, "org": bill}, regions=REGIONS, teams=TEAMS
    )

    assert not report.passed
    by_region = {line.region: line for line in report.lines}
    assert by_region["west"].differences["csv"] == Figures(output_tokens=1)
    assert by_region["total"].differences["csv"] == Figures(output_tokens=1)
    assert by_region["east"].passed
    assert report.sources_apart == ("csv != rows for tight in west",)


def test_a_missing_request_or_a_billed_refusal_is_caught() -> None:
    bill = _bill()
    missing = dict(bill)
    missing[("wide", "east")] = missing[("wide", "east")].minus(Figures(1, 15, 0, 10))
    report = compare(_told(), {"rows": missing}, regions=REGIONS, teams=TEAMS)
    assert not report.passed
    # The cut stream there was billed one token past what its client read: that
    # much of the shortfall is inside its bounds.
    assert report.lines[0].differences["rows"] == Figures(-1, -15, 0, -9)

    refused = dict(bill)
    refused[("tight", "west")] = refused[("tight", "west")] + Figures(rate_limited=1)
    assert not compare(_told(), {"rows": refused}, regions=REGIONS, teams=TEAMS).passed


def test_a_shed_counted_as_rate_limited_or_missing_is_caught() -> None:
    """503s and 429s are held apart: a shed request in ``rate_limited`` is two
    differences, not none."""
    bill = _bill()
    assert bill[("wide", "west")].shed == 1
    swapped = dict(bill)
    swapped[("wide", "west")] = swapped[("wide", "west")].minus(
        Figures(shed=1)
    ) + Figures(rate_limited=1)
    report = compare(_told(), {"rows": swapped}, regions=REGIONS, teams=TEAMS)
    assert not report.passed
    assert report.lines[1].differences["rows"] == Figures(rate_limited=1, shed=-1)
    assert report.lines[0].passed

    missing = dict(bill)
    missing[("wide", "west")] = missing[("wide", "west")].minus(Figures(shed=1))
    report = compare(_told(), {"rows": missing}, regions=REGIONS, teams=TEAMS)
    assert report.lines[-1].differences["rows"] == Figures(shed=-1)


def test_a_cut_stream_is_bounded_by_what_was_read_and_max_tokens() -> None:
    expected = expected_of(_told())[("wide", "east")]
    assert expected.cut == 1
    # Two complete streams (10 and 14 tokens) plus the cut one's 3..20.
    assert (expected.low.output_tokens, expected.high.output_tokens) == (27, 44)
    # Cut streams are told no cached tokens and the complete streams' prompt.
    assert expected.low.prompt_tokens == expected.high.prompt_tokens == 45

    for output, ok in [(3, True), (20, True), (2, False), (21, False)]:
        bill = _bill(cut_output=output)
        assert (
            compare(_told(), {"rows": bill}, regions=REGIONS, teams=TEAMS).passed is ok
        )


def _report_json(*, team_usd: float) -> dict[str, Any]:
    """A usage report's JSON: one pool a region, east at 2.00 and west at 4.00 USD a
    GPU-hour, each serving for an hour at 1 token/s of capacity per replica."""
    pools = [
        {
            "model": "chat-7b",
            "region": region,
            "gpu_hours": 1.0,
            "serving_replica_hours": 1.0,
            "tokens_per_s_per_replica": 1.0,
            "usd": price,
        }
        for region, price in [("east", 2.0), ("west", 4.0)]
    ]
    # 900 weighted tokens in east of a 3600 capacity: a quarter busy.
    data = [
        {
            "team": "wide",
            "model": "chat-7b",
            "region": "east",
            "prompt_tokens": 400,
            "cached_tokens": 0,
            "output_tokens": 800,
            "usd": team_usd,
        },
        {
            "team": "other",
            "model": "chat-7b",
            "region": "east",
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "output_tokens": 0,
            "usd": 0.0,
        },
    ]
    return {
        "weights": {"prompt": 0.25, "cached": 0.025, "output": 1.0},
        "gpu_hour_usd": 2.5,
        "gpu_hour_usd_by_region": {"east": 2.0, "west": 4.0},
        "pools": pools,
        "data": data,
        "idle": [
            {"region": "east", "usd": round(2.0 - team_usd, 6)},
            {"region": "west", "usd": 4.0},
        ],
    }


def test_usd_is_checked_against_the_cost_model_per_region() -> None:
    checks = {c.region: c for c in cost_checks(_report_json(team_usd=0.5), ["wide"])}
    assert checks["east"].model_usd == 0.5  # 2.00 x 900 / 3600
    assert checks["east"].passed and checks["west"].passed

    wrong = {c.region: c for c in cost_checks(_report_json(team_usd=0.51), ["wide"])}
    assert not wrong["east"].passed
    assert wrong["east"].difference == 0.01

"""Tests for the x-priority tiers."""

from __future__ import annotations

import pytest

from routing.domain.tiers import DEFAULT_TIER, Tier, parse_tier


def test_parse_tier_absent_header_means_standard() -> None:
    assert parse_tier(None) is Tier.STANDARD


@pytest.mark.parametrize("header", ["", "   "])
def test_parse_tier_rejects_an_empty_header_naming_the_choices(header: str) -> None:
    with pytest.raises(ValueError, match="x-priority is empty") as excinfo:
        parse_tier(header)
    assert "interactive, standard, batch" in str(excinfo.value)


def test_default_tier_is_standard() -> None:
    assert DEFAULT_TIER is Tier.STANDARD


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("interactive", Tier.INTERACTIVE),
        ("standard", Tier.STANDARD),
        ("batch", Tier.BATCH),
        ("BATCH", Tier.BATCH),
        ("Interactive", Tier.INTERACTIVE),
        (" batch ", Tier.BATCH),
    ],
)
def test_parse_tier_is_case_insensitive_and_trims(header: str, expected: Tier) -> None:
    assert parse_tier(header) is expected


@pytest.mark.parametrize("header", ["urgent", "high", "0", "batch,interactive"])
def test_parse_tier_rejects_unknown_value_naming_the_header(header: str) -> None:
    with pytest.raises(ValueError, match="x-priority") as excinfo:
        parse_tier(header)
    assert "interactive, standard, batch" in str(excinfo.value)


def test_tier_rank_orders_interactive_before_standard_before_batch() -> None:
    assert Tier.INTERACTIVE.rank < Tier.STANDARD.rank < Tier.BATCH.rank
    assert [t.rank for t in Tier] == [0, 1, 2]


def test_tier_sorted_by_rank_gives_shedding_order_reversed() -> None:
    shed_first = sorted(Tier, key=lambda t: t.rank, reverse=True)
    assert shed_first == [Tier.BATCH, Tier.STANDARD, Tier.INTERACTIVE]

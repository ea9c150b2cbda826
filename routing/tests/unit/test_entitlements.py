"""Tier entitlements as the gateway's plan checks them (pure, from a snapshot)."""

from __future__ import annotations

import pytest

from routing.domain.snapshot import ConfigSnapshot, EntitlementRecord
from routing.domain.tiers import Tier
from routing.entitlements import check_tier
from routing.plan import GatewaySettings
from routing.responses import GatewayError

SNAPSHOT = ConfigSnapshot(
    built_at=0.0,
    region="local",
    entitlements={
        ("alpha", "chat-7b"): EntitlementRecord("alpha", "chat-7b", ("batch",)),
        ("beta", "chat-7b"): EntitlementRecord("beta", "chat-7b", ()),
    },
)
ALL = GatewaySettings(region="local")
NO_INTERACTIVE = GatewaySettings(
    region="local", default_tiers=frozenset({Tier.STANDARD, Tier.BATCH})
)


def test_a_team_without_a_row_gets_the_default_tiers() -> None:
    for tier in Tier:
        check_tier(SNAPSHOT, ALL.default_tiers, "gamma", "chat-7b", tier)
    with pytest.raises(GatewayError) as refused:
        check_tier(
            SNAPSHOT, NO_INTERACTIVE.default_tiers, "gamma", "chat-7b", Tier.INTERACTIVE
        )
    assert refused.value.status == 403
    assert refused.value.code == "tier_not_entitled"
    assert refused.value.param == "x-priority"


def test_a_row_replaces_the_default() -> None:
    check_tier(SNAPSHOT, ALL.default_tiers, "alpha", "chat-7b", Tier.BATCH)
    for tier in (Tier.INTERACTIVE, Tier.STANDARD):
        with pytest.raises(GatewayError) as refused:
            check_tier(SNAPSHOT, ALL.default_tiers, "alpha", "chat-7b", tier)
        assert "may use: batch" in refused.value.message
    # Another model has no row: the default.
    check_tier(SNAPSHOT, ALL.default_tiers, "alpha", "other", Tier.INTERACTIVE)


def test_an_empty_row_allows_no_tier() -> None:
    for tier in Tier:
        with pytest.raises(GatewayError) as refused:
            check_tier(SNAPSHOT, ALL.default_tiers, "beta", "chat-7b", tier)
        assert "may use: none" in refused.value.message

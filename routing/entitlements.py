"""Tier entitlements at the gateway: may this team use this tier on this model?

Public surface: ``check_tier``.

Read from the snapshot (``EntitlementRecord``, team_entitlements rows) with the
operator's default (``PLATFORM_DEFAULT_TIERS``) for a team and model without a
row. ``routing.plan`` checks it right after the model resolves, before the
prompt is counted or anything is charged.
"""

from __future__ import annotations

from routing.domain.snapshot import ConfigSnapshot
from routing.domain.tiers import Tier
from routing.responses import GatewayError

__all__ = ["check_tier"]


def check_tier(
    snapshot: ConfigSnapshot,
    default_tiers: frozenset[Tier],
    team: str,
    model: str,
    tier: Tier,
) -> None:
    """Refuse (403 ``tier_not_entitled``) a tier the team may not use on ``model``.

    The team's entitlement row on the model says; without one, the operator's
    default tiers. Checked before admission, so a refused request is never
    charged.
    """
    record = snapshot.entitlements.get((team, model))
    allowed = (
        default_tiers
        if record is None
        else frozenset(t for t in Tier if t.value in record.tiers)
    )
    if tier in allowed:
        return
    may = ", ".join(t.value for t in Tier if t in allowed) or "none"
    raise GatewayError(
        403,
        f"team {team!r} may not use the {tier.value} tier on model {model!r} "
        f"(it may use: {may}); ask a platform admin to grant it "
        f"(PUT /admin/teams/{team}/entitlements)",
        param="x-priority",
        code="tier_not_entitled",
        error_type="permission_error",
    )

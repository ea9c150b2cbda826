"""The stages of a rollout and the rules for moving between them.

Public surface: ``Stage``, ``Decision``, ``CANARY_STEPS``, ``GuardThresholds``,
``stage_errors``.

Seed: shadow traffic first, then a canary at 1%, 10% and 50%, then the alias moves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["CANARY_STEPS", "Decision", "GuardThresholds", "Stage", "stage_errors"]

CANARY_STEPS: tuple[float, ...] = (1.0, 10.0, 50.0)


class Stage(enum.StrEnum):
    """What share of traffic a candidate version sees and how."""

    SHADOW = "shadow"  # copies of requests; output discarded, never affects a caller
    CANARY = "canary"  # real answers for a stable hash-slice of conversations


class Decision(enum.StrEnum):
    """How a rollout ended; ``pending`` while it runs."""

    PENDING = "pending"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"
    SUPERSEDED = "superseded"


@dataclass(frozen=True, slots=True)
class GuardThresholds:
    """Roll back when, against the live version, a guard moves more than this.

    The seed's starting values: error rate +0.5 points, p95 TTFT +20%, average
    output length shifted by 15% either way.
    """

    error_rate_points: float = 0.5
    p95_ttft_ratio: float = 0.20
    output_length_ratio: float = 0.15


def stage_errors(stage: str, percent: float) -> list[tuple[str, str]]:
    """Return (param, message) for an invalid stage or share; empty when valid."""
    try:
        Stage(stage)
    except ValueError:
        return [("stage", f"must be one of {[s.value for s in Stage]}")]
    if not 0.0 < percent <= 100.0:
        return [("percent", "must be greater than 0 and at most 100")]
    return []

"""Which priority tiers a team may use on a model, and the rules of a USD budget.

Public surface: see ``__all__``.

The tier names are the gateway's ``x-priority`` values (``routing.domain.tiers``);
accounts sits below routing and spells them here, and a test holds the two equal.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "MAX_BUDGET_USD",
    "MAX_HARD_FRACTION",
    "MIN_BUDGET_USD",
    "TIERS",
    "budget_errors",
    "normal_tiers",
    "tier_errors",
]

# In the order the seed sheds them last to first: interactive is served first.
TIERS = ("interactive", "standard", "batch")
# A month of a large fleet is far below this; a bound keeps nano-USD counters in
# 64-bit integers (routing.domain.budget) with room for reservations.
MAX_BUDGET_USD = 1_000_000_000.0
# A budget is kept to the micro-dollar (the column's precision).
MIN_BUDGET_USD = 0.000001
# A hard threshold may sit above the budget (a grace margin), not without bound.
MAX_HARD_FRACTION = 10.0


def tier_errors(tiers: Sequence[str]) -> list[str]:
    """Return a message for every name that is not a tier (repeats are harmless)."""
    return [
        f"{name!r} is not a tier ({', '.join(TIERS)})"
        for name in tiers
        if name not in TIERS
    ]


def normal_tiers(tiers: Sequence[str]) -> tuple[str, ...]:
    """Return ``tiers`` in ``TIERS`` order, each once."""
    return tuple(tier for tier in TIERS if tier in tiers)


def budget_errors(
    *, monthly_usd: float, soft_fraction: float, hard_fraction: float
) -> list[tuple[str, str]]:
    """Return (param, message) for every value that breaks a budget's rules.

    The budget is positive; the soft threshold is a fraction of it in (0, 1]
    and at most the hard one; the hard one is in (0, ``MAX_HARD_FRACTION``].
    """
    errors: list[tuple[str, str]] = []
    if not MIN_BUDGET_USD <= monthly_usd <= MAX_BUDGET_USD:
        errors.append(
            (
                "monthly_usd",
                f"must be between {MIN_BUDGET_USD} and {MAX_BUDGET_USD:.0f}",
            )
        )
    if not 0.0 < soft_fraction <= 1.0:
        errors.append(("soft_fraction", "must be a fraction above 0 and at most 1"))
    if not 0.0 < hard_fraction <= MAX_HARD_FRACTION:
        errors.append(
            ("hard_fraction", f"must be above 0 and at most {MAX_HARD_FRACTION:g}")
        )
    elif soft_fraction > hard_fraction:
        errors.append(("soft_fraction", "must not be above hard_fraction"))
    return errors

"""Priority tiers, in the order the seed sheds them (batch first, interactive last).

Public surface: ``Tier``, ``parse_tier``, ``DEFAULT_TIER``.
"""

from __future__ import annotations

import enum

__all__ = ["DEFAULT_TIER", "Tier", "parse_tier"]


class Tier(enum.StrEnum):
    """The value of the ``x-priority`` header."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 for the tier served first; higher ranks are shed first."""
        return _RANK[self]


_RANK = {Tier.INTERACTIVE: 0, Tier.STANDARD: 1, Tier.BATCH: 2}
DEFAULT_TIER = Tier.STANDARD


def parse_tier(header: str | None) -> Tier:
    """Return the tier named by an ``x-priority`` header; absent means standard.

    Raises:
        ValueError: any other value, an empty one included, so a typo (or a template
            that left the header blank) is a 400 rather than a silent downgrade.
    """
    if header is None:
        return DEFAULT_TIER
    if header.strip() == "":
        raise ValueError(
            "x-priority is empty: send one of "
            f"{', '.join(t.value for t in Tier)}, or leave the header out for standard"
        )
    try:
        return Tier(header.strip().lower())
    except ValueError:
        raise ValueError(
            f"x-priority must be one of {', '.join(t.value for t in Tier)}"
        ) from None

"""Console roles from an identity provider's claims (single sign-on).

The platform knows three roles (docs/platform-admins.md#single-sign-on): a platform
admin sees and changes everything, finance reads usage and cost reports, and a
team's viewer sees that team's usage and its keys' metadata. The provider says
which in one claim (``groups`` by default), a list of names; settings say which
names mean which role. A name that means nothing here is ignored; a user whose
names mean no role gets none and may not log in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ConsoleRoles", "RoleMapping", "claim_names", "roles_from_claims"]


@dataclass(frozen=True, slots=True)
class RoleMapping:
    """Which of the provider's group names make which console role."""

    groups_claim: str
    admin_groups: frozenset[str]
    finance_groups: frozenset[str]
    # A name ``<prefix><team id>`` makes a viewer of that team; "" turns it off.
    team_viewer_prefix: str


@dataclass(frozen=True, slots=True)
class ConsoleRoles:
    """The roles one login carries."""

    is_admin: bool
    is_finance: bool
    viewer_of: frozenset[str]

    @property
    def has_any(self) -> bool:
        """Whether the login may open the console at all."""
        return self.is_admin or self.is_finance or bool(self.viewer_of)


def claim_names(claims: Mapping[str, object], claim: str) -> frozenset[str]:
    """Return the names in ``claims[claim]``: a list of strings, or one string
    (some providers send a lone group so); anything else counts as none."""
    value = claims.get(claim)
    if isinstance(value, str):
        return frozenset([value])
    if isinstance(value, list | tuple):
        return frozenset(v for v in value if isinstance(v, str))
    return frozenset()


def roles_from_claims(
    claims: Mapping[str, object], mapping: RoleMapping
) -> ConsoleRoles:
    """Return the console roles that ``claims`` give under ``mapping``."""
    names = claim_names(claims, mapping.groups_claim)
    prefix = mapping.team_viewer_prefix
    teams = (
        frozenset(
            name.removeprefix(prefix)
            for name in names
            if name.startswith(prefix) and len(name) > len(prefix)
        )
        if prefix
        else frozenset()
    )
    return ConsoleRoles(
        is_admin=bool(names & mapping.admin_groups),
        is_finance=bool(names & mapping.finance_groups),
        viewer_of=teams,
    )

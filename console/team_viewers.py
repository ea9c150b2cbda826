"""A team's viewers: console users who see one team's usage and keys, no other.

Public surface: ``TEAM_VIEWER_GROUP_PREFIX``, ``TeamViewerBackend``,
``team_viewer_group``, ``viewer_team_ids``, ``may_view_team``.

The role is a Django group per team, ``team-viewer:<team id>``, with no model
permissions: a member gets nothing from Django's model-wide permissions, so every
admin table stays closed (403). ``TeamViewerBackend`` grants ``accounts.view_team``
on the member's own ``Team`` objects only (Django's object permissions), and the
console's team pages ask for that. Single sign-on fills the groups from the
provider's claims (``console.sso``); an admin may also add a password user to one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib.auth.backends import BaseBackend
from django.contrib.auth.models import Group

from accounts.models import Team

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser
    from django.contrib.auth.models import AnonymousUser, User

__all__ = [
    "TEAM_VIEWER_GROUP_PREFIX",
    "TeamViewerBackend",
    "may_view_team",
    "team_viewer_group",
    "viewer_team_ids",
]

TEAM_VIEWER_GROUP_PREFIX = "team-viewer:"
VIEW_TEAM = "accounts.view_team"
_CACHE_ATTR = "_console_viewer_team_ids"


def team_viewer_group(team_id: str) -> str:
    """Return the name of the Django group whose members view ``team_id``."""
    return f"{TEAM_VIEWER_GROUP_PREFIX}{team_id}"


def viewer_team_ids(user: AbstractBaseUser | AnonymousUser) -> frozenset[str]:
    """Return the teams ``user`` is a viewer of (cached on the user object for
    the request, as Django caches permissions)."""
    if not user.is_active or user.is_anonymous:
        return frozenset()
    cached = getattr(user, _CACHE_ATTR, None)
    if cached is None:
        names = Group.objects.filter(
            user__pk=user.pk, name__startswith=TEAM_VIEWER_GROUP_PREFIX
        ).values_list("name", flat=True)
        cached = frozenset(n.removeprefix(TEAM_VIEWER_GROUP_PREFIX) for n in names)
        setattr(user, _CACHE_ATTR, cached)
    return cached


def may_view_team(user: User | AnonymousUser, team_id: str) -> bool:
    """Whether ``user`` may see ``team_id``'s usage and keys: every team with the
    model permission, else only its own teams as a viewer."""
    return user.has_perm(VIEW_TEAM) or team_id in viewer_team_ids(user)


class TeamViewerBackend(BaseBackend):
    """Grant ``accounts.view_team`` on a viewer's own teams; authenticate nobody."""

    def has_perm(
        self,
        user_obj: AbstractBaseUser | AnonymousUser,
        perm: str,
        obj: Any = None,
    ) -> bool:
        """Return True for ``accounts.view_team`` on a ``Team`` the user views."""
        if perm != VIEW_TEAM or not isinstance(obj, Team):
            return False
        return obj.pk in viewer_team_ids(user_obj)

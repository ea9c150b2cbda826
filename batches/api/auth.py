"""Team-key authentication for the Files and Batch APIs (``/v1/files``,
``/v1/batches``), which Django serves beside the gateway.

A team's API key opens them; an admin token or anything else is a 401 in OpenAI's
error shape. The keys the platform mints for a batch's own lines open only the
gateway, not these endpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from accounts import services
from accounts.auth import bearer_secret
from accounts.models import ApiKey


@dataclass(frozen=True)
class TeamCaller:
    team_id: str
    key_id: int
    is_admin: bool = False
    is_authenticated: bool = True


class TeamKeyAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[TeamCaller, ApiKey] | None:
        secret = bearer_secret(request)
        if secret is None:
            return None
        key = services.find_active_team_key(secret)
        # Never a batch's own key: find_active_team_key returns people's keys only.
        if key is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        return TeamCaller(team_id=key.team_id, key_id=key.pk), key

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'


class IsTeam(BasePermission):
    message = "this endpoint needs a team's API key"

    def has_permission(self, request: Request, view: object) -> bool:
        return isinstance(request.user, TeamCaller)

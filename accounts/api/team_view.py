"""The base view of the /v1 endpoints Django serves for a team's key.

Public surface: ``TeamView``.

Kept apart from ``accounts.auth``: DRF imports that module while it loads its own
views (it names the default authentication), so it must not import them back.
"""

from __future__ import annotations

from typing import Any

from rest_framework.views import APIView

from accounts.auth import IsTeam, TeamCaller, TeamKeyAuthentication
from config.api import TeamApiSchema

__all__ = ["TeamView"]


class TeamView(APIView):
    """Base of the /v1 views Django serves for a team's key (files, batches, usage):
    a team's API key or a 401 in OpenAI's shape; ``team`` names the key's team."""

    authentication_classes = [TeamKeyAuthentication]
    permission_classes = [IsTeam]
    # In the team API's schema (GET /v1/openapi.json), not in /admin/schema.
    schema = TeamApiSchema()

    def team(self, request: Any) -> str:
        caller = request.user
        assert isinstance(caller, TeamCaller)  # IsTeam let only a team through
        return caller.team_id

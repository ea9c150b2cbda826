"""Control-plane endpoints for teams, their keys and their limits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from accounts import services
from accounts.api.serializers import (
    BudgetOutSerializer,
    BudgetSerializer,
    EntitlementOutSerializer,
    EntitlementSerializer,
    KeyCreatedSerializer,
    KeyCreateSerializer,
    KeySerializer,
    LimitOutSerializer,
    LimitSerializer,
    TeamCreateSerializer,
    TeamSerializer,
)
from accounts.models import ApiKey, Team, TeamBudget, TeamEntitlement, TeamLimit
from audit.api.base import AuditedView, body_text
from config.api import ControlPlaneView, ErrorSerializer, validated


def key_dict(key: ApiKey) -> dict[str, Any]:
    """Return a key's public record: never the secret, never the hash."""
    return {
        "id": key.pk,
        "team": key.team_id,
        "name": key.name,
        "prefix": key.prefix,
        "created_at": key.created_at.isoformat(),
        "last_used_at": key.last_used_at.isoformat() if key.last_used_at else None,
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
    }


def limit_dict(limit: TeamLimit) -> dict[str, Any]:
    """Return a team limit as the API shows it."""
    return {
        "team": limit.team_id,
        "model": limit.model_id,
        "tokens_per_minute": limit.tokens_per_minute,
        "max_concurrency": limit.max_concurrency,
        "guaranteed_share": limit.guaranteed_share,
    }


def entitlement_dict(row: TeamEntitlement) -> dict[str, Any]:
    """Return a team's tiers on a model as the API shows them."""
    return {"team": row.team_id, "model": row.model_id, "tiers": list(row.tiers)}


def budget_dict(budget: TeamBudget) -> dict[str, Any]:
    """Return a team's budget as the API shows it."""
    return {
        "team": budget.team_id,
        "model": budget.model_id,
        "monthly_usd": float(budget.monthly_usd),
        "soft_fraction": budget.soft_fraction,
        "hard_fraction": budget.hard_fraction,
    }


def team_dict(team: Team) -> dict[str, Any]:
    """Return a team with its limits."""
    return {
        "team": team.team,
        "name": team.name,
        "created_at": team.created_at.isoformat(),
        "limits": [limit_dict(limit) for limit in team.limits.all()],
    }


class TeamListView(AuditedView):
    """List teams or create one."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        # Only the team the body names: a create touches no other.
        return [Team.objects.filter(pk=body_text(request, "team"))]

    @extend_schema(
        operation_id="teams_list",
        responses={
            200: inline_serializer("TeamList", {"data": TeamSerializer(many=True)})
        },
    )
    def get(self, request: Request) -> Response:
        teams = Team.objects.prefetch_related("limits")
        return Response({"data": [team_dict(team) for team in teams]})

    @extend_schema(
        request=TeamCreateSerializer,
        responses={201: TeamSerializer, 409: ErrorSerializer},
    )
    def post(self, request: Request) -> Response:
        body = validated(TeamCreateSerializer, request.data)
        team = services.create_team(team_id=body["team"], name=body.get("name", ""))
        return Response(team_dict(team), status=status.HTTP_201_CREATED)


class TeamDetailView(ControlPlaneView):
    """One team with its limits."""

    @extend_schema(responses={200: TeamSerializer})
    def get(self, request: Request, team: str) -> Response:
        return Response(team_dict(services.get_team(team)))


class KeyListView(AuditedView):
    """List a team's keys (prefixes only) or issue a new one, shown once.

    The list holds the keys people hold; the keys the platform mints for batch
    jobs are left out (they are the batches', never edited or revoked here).
    """

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return [
            ApiKey.objects.filter(team_id=kwargs["team"], purpose=ApiKey.Purpose.TEAM)
        ]

    @extend_schema(
        responses={
            200: inline_serializer("KeyList", {"data": KeySerializer(many=True)})
        }
    )
    def get(self, request: Request, team: str) -> Response:
        services.get_team(team)
        keys = ApiKey.objects.filter(team_id=team, purpose=ApiKey.Purpose.TEAM)
        return Response({"data": [key_dict(key) for key in keys]})

    @extend_schema(request=KeyCreateSerializer, responses={201: KeyCreatedSerializer})
    def post(self, request: Request, team: str) -> Response:
        body = validated(KeyCreateSerializer, request.data or {})
        key, secret = services.issue_key(team_id=team, name=body.get("name", ""))
        return Response(
            {**key_dict(key), "key": secret}, status=status.HTTP_201_CREATED
        )


class KeyDetailView(AuditedView):
    """Revoke a team's key."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return [ApiKey.objects.filter(team_id=kwargs["team"], pk=kwargs["key_id"])]

    @extend_schema(responses={204: None})
    def delete(self, request: Request, team: str, key_id: int) -> Response:
        services.revoke_key(team_id=team, key_id=key_id, now=timezone.now())
        return Response(status=status.HTTP_204_NO_CONTENT)


class LimitView(AuditedView):
    """Read or set a team's limits (seed: PUT /admin/teams/{team}/limits)."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return [TeamLimit.objects.filter(team_id=kwargs["team"])]

    @extend_schema(
        responses={
            200: inline_serializer("LimitList", {"data": LimitOutSerializer(many=True)})
        }
    )
    def get(self, request: Request, team: str) -> Response:
        found = services.get_team(team)
        return Response({"data": [limit_dict(limit) for limit in found.limits.all()]})

    @extend_schema(
        request=LimitSerializer,
        responses={
            200: LimitOutSerializer,
            201: LimitOutSerializer,
            # The guaranteed shares of all teams on the model would pass 1.
            409: ErrorSerializer,
        },
    )
    def put(self, request: Request, team: str) -> Response:
        body = validated(LimitSerializer, request.data)
        limit, created = services.set_team_limit(
            team_id=team,
            model_id=body["model"],
            tokens_per_minute=body["tokens_per_minute"],
            max_concurrency=body["max_concurrency"],
            guaranteed_share=body["guaranteed_share"],
        )
        return Response(
            limit_dict(limit),
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class EntitlementView(AuditedView):
    """Read or set the tiers a team may use on each model.

    A model without a row allows the operator's default tiers
    (``PLATFORM_DEFAULT_TIERS``).
    """

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return [TeamEntitlement.objects.filter(team_id=kwargs["team"])]

    @extend_schema(
        operation_id="teams_entitlements_list",
        responses={
            200: inline_serializer(
                "EntitlementList", {"data": EntitlementOutSerializer(many=True)}
            )
        },
    )
    def get(self, request: Request, team: str) -> Response:
        found = services.get_team(team)
        rows = found.entitlements.all()
        return Response({"data": [entitlement_dict(row) for row in rows]})

    @extend_schema(
        request=EntitlementSerializer,
        responses={200: EntitlementOutSerializer, 201: EntitlementOutSerializer},
    )
    def put(self, request: Request, team: str) -> Response:
        body = validated(EntitlementSerializer, request.data)
        row, created = services.set_team_entitlement(
            team_id=team, model_id=body["model"], tiers=body["tiers"]
        )
        return Response(
            entitlement_dict(row),
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class BudgetView(AuditedView):
    """Read or set a team's monthly USD budgets (docs/finance.md)."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return [TeamBudget.objects.filter(team_id=kwargs["team"])]

    @extend_schema(
        operation_id="teams_budgets_list",
        responses={
            200: inline_serializer(
                "BudgetList", {"data": BudgetOutSerializer(many=True)}
            )
        },
    )
    def get(self, request: Request, team: str) -> Response:
        found = services.get_team(team)
        return Response({"data": [budget_dict(b) for b in found.budgets.all()]})

    @extend_schema(
        request=BudgetSerializer,
        responses={200: BudgetOutSerializer, 201: BudgetOutSerializer},
    )
    def put(self, request: Request, team: str) -> Response:
        body = validated(BudgetSerializer, request.data)
        budget, created = services.set_team_budget(
            team_id=team,
            model_id=body["model"],
            monthly_usd=body["monthly_usd"],
            soft_fraction=body.get("soft_fraction"),
            hard_fraction=body.get("hard_fraction"),
        )
        return Response(
            budget_dict(budget),
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )

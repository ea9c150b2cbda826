"""Tier entitlements and USD budgets: the admin REST API and the gateway's snapshot."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest
import time_machine

from accounts import services
from accounts.models import TeamBudget, TeamEntitlement
from metering.domain.cost import TokenWeights
from metering.models import Usage
from routing.domain.budget import NANO_PER_USD, Price
from routing.services import build_snapshot

if TYPE_CHECKING:
    from rest_framework.test import APIClient

    from accounts.models import Team
    from models_registry.models import Model, ModelVersion


def _error(response: Any, status: int, param: str) -> None:
    assert response.status_code == status, response.content
    assert response.json()["error"]["param"] == param


def test_set_entitlement_creates_then_replaces(
    admin_client: APIClient, team: Team, chat_model: Model
) -> None:
    body = {"model": "chat-7b", "tiers": ["batch", "standard", "batch"]}
    response = admin_client.put("/admin/teams/search/entitlements", body, format="json")
    assert response.status_code == 201
    # Kept once each, in the tiers' order.
    assert response.json() == {
        "team": "search",
        "model": "chat-7b",
        "tiers": ["standard", "batch"],
    }
    body["tiers"] = []
    response = admin_client.put("/admin/teams/search/entitlements", body, format="json")
    assert response.status_code == 200
    assert TeamEntitlement.objects.get().tiers == []
    listed = admin_client.get("/admin/teams/search/entitlements").json()
    assert listed == {"data": [{"team": "search", "model": "chat-7b", "tiers": []}]}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "chat-7b", "tiers": ["urgent"]}, 400, "tiers.0"),
        ({"model": "chat-7b", "tiers": "standard"}, 400, "tiers"),
        ({"model": "nope", "tiers": ["standard"]}, 404, "model"),
    ],
)
def test_set_entitlement_refuses_what_is_not_a_grant(
    admin_client: APIClient,
    team: Team,
    chat_model: Model,
    body: dict[str, Any],
    status: int,
    param: str,
) -> None:
    response = admin_client.put("/admin/teams/search/entitlements", body, format="json")
    _error(response, status, param)
    assert not TeamEntitlement.objects.exists()


def test_set_budget_on_the_team_and_on_a_model(
    admin_client: APIClient, team: Team, chat_model: Model
) -> None:
    response = admin_client.put(
        "/admin/teams/search/budgets", {"monthly_usd": 250.5}, format="json"
    )
    assert response.status_code == 201
    assert response.json() == {
        "team": "search",
        "model": None,
        "monthly_usd": 250.5,
        "soft_fraction": 0.8,
        "hard_fraction": 1.0,
    }
    body = {"model": "chat-7b", "monthly_usd": 10, "soft_fraction": 0.5}
    assert (
        admin_client.put("/admin/teams/search/budgets", body, format="json").status_code
        == 201
    )
    # Raising the team's budget replaces it.
    response = admin_client.put(
        "/admin/teams/search/budgets",
        {"monthly_usd": 300, "hard_fraction": 1.1},
        format="json",
    )
    assert response.status_code == 200
    assert TeamBudget.objects.count() == 2
    listed = admin_client.get("/admin/teams/search/budgets").json()["data"]
    assert [(b["model"], b["monthly_usd"]) for b in listed] == [
        ("chat-7b", 10.0),
        (None, 300.0),
    ] or [(b["model"], b["monthly_usd"]) for b in listed] == [
        (None, 300.0),
        ("chat-7b", 10.0),
    ]


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"monthly_usd": 0}, 400, "monthly_usd"),
        ({"monthly_usd": "100"}, 400, "monthly_usd"),
        ({"soft_fraction": 1.5}, 400, "soft_fraction"),
        ({"soft_fraction": 0.9, "hard_fraction": 0.5}, 400, "soft_fraction"),
        ({"hard_fraction": 0.5}, 400, "soft_fraction"),  # the default soft is 0.8
        ({"hard_fraction": 20}, 400, "hard_fraction"),
        ({"model": "nope"}, 404, "model"),
    ],
)
def test_set_budget_refuses_bad_values(
    admin_client: APIClient,
    team: Team,
    chat_model: Model,
    change: dict[str, Any],
    status: int,
    param: str,
) -> None:
    body = {"monthly_usd": 100.0, **change}
    response = admin_client.put("/admin/teams/search/budgets", body, format="json")
    _error(response, status, param)
    assert not TeamBudget.objects.exists()


def test_budget_on_an_unknown_team_is_404(
    admin_client: APIClient, chat_model: Model
) -> None:
    response = admin_client.put(
        "/admin/teams/nope/budgets", {"monthly_usd": 1}, format="json"
    )
    _error(response, 404, "team")


@pytest.mark.django_db
def test_snapshot_carries_entitlements_budgets_prices_and_the_months_spend(
    team: Team, chat_v1: ModelVersion, settings: Any
) -> None:
    """GIVEN a budget and usage rows from this month in two regions and last month
    WHEN the gateway's snapshot is built
    THEN it holds the budget with this month's spend, each region's at its price."""
    settings.PLATFORM_GPU_HOUR_USD_BY_REGION = {"west": 5.0}
    services.set_team_entitlement(
        team_id="search", model_id="chat-7b", tiers=["standard"]
    )
    services.set_team_budget(team_id="search", model_id=None, monthly_usd=40.0)
    rows = [
        ("local", datetime(2026, 12, 3, 10, 0, tzinfo=UTC), 1_000_000),
        ("west", datetime(2026, 12, 4, 10, 0, tzinfo=UTC), 1_000_000),
        ("local", datetime(2026, 11, 30, 23, 59, tzinfo=UTC), 9_000_000),
    ]
    for region, minute, output in rows:
        Usage.objects.create(
            team=team,
            model_id="chat-7b",
            version=chat_v1,
            region=region,
            minute=minute,
            prompt_tokens=400_000,
            cached_tokens=0,
            output_tokens=output,
            requests=1,
        )
    with time_machine.travel(datetime(2026, 12, 6, 9, 0, tzinfo=UTC), tick=False):
        snapshot = build_snapshot(region="local", default_policy="prefix_affinity")
    assert snapshot.entitlements[("search", "chat-7b")].tiers == ("standard",)
    record = snapshot.budgets[("search", "")]
    assert (record.monthly_usd, record.month) == (40.0, "2026-12")
    local_price = snapshot.versions[("chat-7b", "v1")].usd_per_million
    cost = Price(usd_per_million=local_price, weights=TokenWeights()).cost_nano(
        prompt_tokens=400_000, cached_tokens=0, output_tokens=1_000_000
    )
    # 1.1 million weighted tokens at 2.50 USD an hour for 2,500 tokens a second.
    assert record.spent_here_usd == pytest.approx(cost / NANO_PER_USD)
    assert record.spent_here_usd == pytest.approx(1.1 * 2.5 / 9.0)
    assert record.spent_elsewhere_usd == pytest.approx(2 * record.spent_here_usd)


def test_entitlement_and_budget_changes_are_audited_once_each(
    admin_client: APIClient, team: Team, chat_model: Model
) -> None:
    from audit.models import AuditEntry

    admin_client.put(
        "/admin/teams/search/entitlements",
        {"model": "chat-7b", "tiers": ["standard"]},
        format="json",
    )
    admin_client.put("/admin/teams/search/budgets", {"monthly_usd": 10}, format="json")
    admin_client.put("/admin/teams/search/budgets", {"monthly_usd": 20}, format="json")
    entitlement = TeamEntitlement.objects.get()
    budget = TeamBudget.objects.get()
    entries = {
        (e.object_type, e.object_id, e.action): e
        for e in AuditEntry.objects.filter(source="rest")
    }
    assert len(entries) == AuditEntry.objects.count() == 3
    created = entries[("accounts.teamentitlement", str(entitlement.pk), "create")]
    assert created.after is not None
    assert created.after["tiers"] == ["standard"]
    raised = entries[("accounts.teambudget", str(budget.pk), "update")]
    assert raised.before is not None
    assert raised.after is not None
    assert (
        float(raised.before["monthly_usd"]),
        float(raised.after["monthly_usd"]),
    ) == (
        10.0,
        20.0,
    )
    assert ("accounts.teambudget", str(budget.pk), "create") in entries

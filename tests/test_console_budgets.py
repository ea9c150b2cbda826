"""The console's team page shows the team's budgets, with a banner past a threshold."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pytest
import time_machine
from django.urls import reverse

from accounts import services
from accounts.models import TeamBudget, TeamEntitlement
from metering.models import Usage
from tests.test_console_live import client_with

if TYPE_CHECKING:
    from accounts.models import Team
    from models_registry.models import ModelVersion

NOW = datetime(2026, 12, 6, 9, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("monthly_usd", "state"), [(1.0, None), (0.35, "soft"), (0.3, "hard")]
)
def test_team_page_shows_budgets_and_a_banner_past_a_threshold(
    team: Team, chat_v1: ModelVersion, monthly_usd: float, state: str | None
) -> None:
    """GIVEN 1.1 million weighted tokens this month (0.3056 USD at the seed's
    price) and last month's usage besides
    WHEN a budget of 1, 0.35 or 0.3 USD is set (soft 0.8, hard 1.0)
    THEN the page lists the month's spend, and warns past the soft threshold,
    and says new requests are refused past the hard one."""
    services.set_team_budget(team_id="search", model_id=None, monthly_usd=monthly_usd)
    for minute, output in [
        (datetime(2026, 12, 2, 8, 0, tzinfo=UTC), 1_000_000),
        (datetime(2026, 11, 2, 8, 0, tzinfo=UTC), 5_000_000),
    ]:
        Usage.objects.create(
            team=team,
            model=chat_v1.model,
            version=chat_v1,
            minute=minute,
            prompt_tokens=400_000,
            output_tokens=output,
            requests=1,
        )
    with time_machine.travel(NOW, tick=False):
        page = client_with(superuser=True).get(
            reverse("console-team", kwargs={"team": "search"})
        )
    assert page.status_code == 200
    [budget] = page.context["budgets"]
    assert budget["spent_usd"] == pytest.approx(1.1 * 2.5 / 9.0, rel=1e-6)
    assert budget["state"] == (state or "ok")
    html = page.content.decode()
    assert 'id="team-budgets"' in html
    assert ('data-budget-state="soft"' in html) == (state == "soft")
    assert ('data-budget-state="hard"' in html) == (state == "hard")
    assert ("new requests are refused" in html) == (state == "hard")


def test_console_refuses_a_soft_threshold_above_the_hard_one(
    team: Team, chat_v1: ModelVersion
) -> None:
    console = client_with(superuser=True)
    add = reverse("admin:accounts_teambudget_add")
    body = {"team": "search", "model": "", "monthly_usd": "100"}
    refused = console.post(
        add, {**body, "soft_fraction": "0.9", "hard_fraction": "0.5"}
    )
    assert refused.status_code == 200
    assert "soft_fraction" in refused.context["adminform"].form.errors
    assert not TeamBudget.objects.exists()
    saved = console.post(add, {**body, "soft_fraction": "0.5", "hard_fraction": "0.9"})
    assert saved.status_code == 302
    assert TeamBudget.objects.get().hard_fraction == 0.9


def test_console_keeps_entitlement_tiers_in_order(
    team: Team, chat_v1: ModelVersion
) -> None:
    console = client_with(superuser=True)
    add = reverse("admin:accounts_teamentitlement_add")
    saved = console.post(
        add, {"team": "search", "model": "chat-7b", "tiers": ["batch", "interactive"]}
    )
    assert saved.status_code == 302
    assert TeamEntitlement.objects.get().tiers == ["interactive", "batch"]

"""Single sign-on in Chromium: finance and a team's viewer log in through a real
OIDC provider (``oidc_provider``, its own process) and see only what their role
may; a login whose ID token is spoiled is refused."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from accounts import services as accounts_services
from accounts.models import ApiKey
from metering.models import Usage
from models_registry.models import ModelVersion
from tests.browser.conftest import SSO_FINANCE, SSO_VIEWER

if TYPE_CHECKING:
    from playwright.sync_api import Page
    from pytest_django import DjangoDbBlocker

    from tests.live import LivePlatform
    from tests.oidc_provider.process import OidcProvider, ProviderUser

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def team_keys(
    browser_platform: LivePlatform, django_db_blocker: DjangoDbBlocker
) -> Iterator[dict[str, list[str]]]:
    """Give teams alpha and beta a named key and an hour-old usage row each;
    return each team's key prefixes."""
    with django_db_blocker.unblock():
        v1 = ModelVersion.objects.get(model_id="chat-7b", version="v1")
        for team in ("alpha", "beta"):
            accounts_services.issue_key(team_id=team, name=f"{team} notebook")
            Usage.objects.create(
                team_id=team,
                model_id="chat-7b",
                version=v1,
                region=browser_platform.region,
                minute=timezone.now().replace(second=0, microsecond=0)
                - timedelta(hours=1),
                requests=3,
                prompt_tokens=300,
                output_tokens=30,
            )
        prefixes = {
            team: list(
                ApiKey.objects.filter(team_id=team).values_list("prefix", flat=True)
            )
            for team in ("alpha", "beta")
        }
    yield prefixes


def sso_log_in(page: Page, user: ProviderUser, *, next_path: str) -> None:
    """Log ``user`` in through the console's single sign-on button and the
    provider's own login form; wait until the console shows ``next_path``."""
    page.goto(f"/console/login/?next={next_path}")
    page.click("#sso-login-link")
    page.wait_for_selector("#provider-username")
    page.fill("#provider-username", user.username)
    page.fill("#provider-password", user.password)
    page.click("#provider-submit")
    page.wait_for_url(f"**{next_path}")


def status_of(page: Page, path: str) -> int:
    response = page.goto(path)
    assert response is not None
    return response.status


def test_sso_finance_sees_reports_and_no_admin_pages(
    page: Page, browser_platform: LivePlatform, team_keys: dict[str, list[str]]
) -> None:
    """GIVEN a provider user in its ``finance`` group,
    WHEN they log in to the console through single sign-on,
    THEN they land on the Reports page, the nav offers Reports and no fleet or
    teams, and every admin table, team and pool page answers 403."""
    sso_log_in(page, SSO_FINANCE, next_path="/console/reports/")

    expect(page.locator("#report-filters")).to_be_visible()
    expect(page.locator("#nav-reports")).to_be_visible()
    expect(page.locator('#console-nav [data-nav="teams"]')).to_have_count(0)
    expect(page.locator('#console-nav [data-nav="fleet"]')).to_have_count(0)
    assert status_of(page, "/console/metering/usage/") == 200
    for path in (
        "/console/accounts/apikey/",
        "/console/accounts/team/",
        "/console/auth/user/",
        "/console/teams/",
        "/console/teams/alpha/",
        "/console/rollouts/",
        "/console/fleet/pools/chat-7b/v1/e2e/",
    ):
        assert status_of(page, path) == 403, path


def test_sso_team_viewer_sees_only_its_team(
    page: Page, browser_platform: LivePlatform, team_keys: dict[str, list[str]]
) -> None:
    """GIVEN a provider user in group ``team-viewer:alpha``,
    WHEN they log in through single sign-on,
    THEN team alpha's page shows its usage and its keys' metadata, the teams list
    shows alpha alone, and beta's page, the reports and the admin tables are 403."""
    sso_log_in(page, SSO_VIEWER, next_path="/console/teams/alpha/")

    expect(page.locator('#team-usage tr[data-model="chat-7b"]')).to_have_count(1)
    expect(page.locator('#console-nav [data-nav="teams"]')).to_be_visible()
    expect(page.locator("#nav-reports")).to_have_count(0)
    keys = page.locator("#team-keys tr[data-key-prefix]")
    expect(keys).to_have_count(len(team_keys["alpha"]))
    shown = set(keys.evaluate_all("rows => rows.map(r => r.dataset.keyPrefix)"))
    assert shown == set(team_keys["alpha"])
    expect(page.locator("#team-keys")).to_contain_text("alpha notebook")
    expect(page.locator("#team-keys")).not_to_contain_text("beta notebook")
    # The admin's edit link is for those who may open the admin's team table.
    expect(page.locator("a[href*='/console/accounts/team/']")).to_have_count(0)

    page.goto("/console/teams/")
    expect(page.locator('#teams tr[data-team="alpha"]')).to_have_count(1)
    expect(page.locator('#teams tr[data-team="beta"]')).to_have_count(0)
    expect(page.locator('#team-list li[data-team="beta"]')).to_have_count(0)
    for path in (
        "/console/teams/beta/",
        "/console/reports/",
        "/console/accounts/apikey/",
        "/console/metering/usage/",
        "/console/fleet/pools/chat-7b/v1/e2e/",
    ):
        assert status_of(page, path) == 403, path


def test_sso_refuses_an_expired_id_token(
    page: Page, browser_platform: LivePlatform, oidc_provider: OidcProvider
) -> None:
    """GIVEN a provider that issues expired ID tokens,
    WHEN finance logs in through it,
    THEN the console refuses: back on its login page with an error, no session."""
    oidc_provider.tamper("expired")
    try:
        page.goto("/console/login/?next=/console/reports/")
        page.click("#sso-login-link")
        page.fill("#provider-username", SSO_FINANCE.username)
        page.fill("#provider-password", SSO_FINANCE.password)
        page.click("#provider-submit")
        page.wait_for_url("**/console/login/")
    finally:
        oidc_provider.tamper("")

    expect(page.locator(".messagelist .error")).to_contain_text("Single sign-on failed")
    page.goto("/console/reports/")
    assert "/console/login/" in page.url

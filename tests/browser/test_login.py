"""Logging in to the console in Chromium and seeing the fleet at a glance."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import OPERATOR, log_in

if TYPE_CHECKING:
    from playwright.sync_api import Page

    from tests.live import LivePlatform

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_login_shows_the_fleet_with_the_seeded_pool(
    page: Page, browser_platform: LivePlatform
) -> None:
    """GIVEN chat-7b@v1 serving on one replica in region e2e (and v2 with none),
    WHEN the operator logs in through /console/login/,
    THEN the home page's fleet table has a row per pool with their replicas."""
    log_in(page, OPERATOR)

    v1 = page.locator('#fleet tr[data-pool="chat-7b/v1/e2e"]')
    expect(v1).to_be_visible()
    expect(v1.locator("[data-field=serving_replicas]")).to_have_text("1")
    expect(v1.locator("[data-field=desired_replicas]")).to_have_text("1")
    expect(
        page.locator(
            '#fleet tr[data-pool="chat-7b/v2/e2e"] [data-field=serving_replicas]'
        )
    ).to_have_text("0")
    for section in ("#rollouts", "#alerts"):
        expect(page.locator(section)).to_be_attached()


def test_login_refuses_a_wrong_password(
    page: Page, browser_platform: LivePlatform
) -> None:
    page.goto("/console/login/?next=/console/")
    page.fill("#id_username", OPERATOR[0])
    page.fill("#id_password", "not-the-password")
    page.click("input[type=submit]")

    expect(page.locator(".errornote")).to_be_visible()
    assert "/console/login/" in page.url
    expect(page.locator("#fleet")).to_have_count(0)

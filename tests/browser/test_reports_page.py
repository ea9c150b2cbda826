"""A finance user reads this month's usage report and downloads its CSV, in Chromium.

Written against the console contract for /console/reports/ (the lead's page):
``#report`` with ``tr[data-team][data-month]``, ``canvas#report-chart`` and
``a#download-csv`` (``usage-YYYY-MM.csv``, the columns of
``metering.reports.CSV_COLUMNS``).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db.models import Sum
from django.utils import timezone
from playwright.sync_api import expect

from accounts import services as accounts_services
from metering import reports
from metering.models import Usage
from metering.roles import FINANCE_GROUP
from models_registry.models import ModelVersion
from tests.browser.conftest import log_in

if TYPE_CHECKING:
    from playwright.sync_api import Page
    from pytest_django import DjangoDbBlocker

    from tests.live import LivePlatform

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FINANCE = ("finance-reader", "finance-Pa55-word")
TEAM = "ledger"  # a team of its own: no live traffic adds to its usage
COUNTED = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "rate_limited",
    "shed",
)
# This month's rows (minutes into it) and one of last month, which must not count.
ROWS = (
    (
        1,
        {
            "requests": 3,
            "prompt_tokens": 1_200,
            "cached_tokens": 800,
            "output_tokens": 150,
        },
    ),
    (
        2,
        {
            "requests": 5,
            "prompt_tokens": 2_000,
            "cached_tokens": 0,
            "output_tokens": 410,
            "rate_limited": 4,
        },
    ),
    (
        3,
        {
            "requests": 7,
            "prompt_tokens": 700,
            "cached_tokens": 300,
            "output_tokens": 90,
            "shed": 2,
        },
    ),
)
LAST_MONTH = {
    "requests": 11,
    "prompt_tokens": 9_999,
    "cached_tokens": 0,
    "output_tokens": 999,
}


def month_start(at: datetime) -> datetime:
    return at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


@pytest.fixture(scope="module")
def ledger(
    browser_platform: LivePlatform, django_db_blocker: DjangoDbBlocker
) -> Iterator[datetime]:
    """Seed team ledger's usage of chat-7b@v1 (this month and last) and a finance
    user; return the month of the rows counted."""
    # The rows sit in the first minutes of this month, which the report asks for
    # whole (to = this month): never in the month before, whatever the time.
    month = month_start(timezone.now())
    with django_db_blocker.unblock():
        accounts_services.create_team(team_id=TEAM, name="Ledger")
        v1 = ModelVersion.objects.get(model_id="chat-7b", version="v1")
        for minutes, counts in ROWS:
            Usage.objects.create(
                team_id=TEAM,
                model_id="chat-7b",
                version=v1,
                region=browser_platform.region,
                minute=month + timedelta(minutes=minutes),
                **counts,
            )
        Usage.objects.create(
            team_id=TEAM,
            model_id="chat-7b",
            version=v1,
            region=browser_platform.region,
            minute=month - timedelta(days=1),
            **LAST_MONTH,
        )
        user = get_user_model().objects.create_user(
            username=FINANCE[0], password=FINANCE[1], is_staff=True
        )
        # The group and its permissions are the platform's; the test only adds a
        # user to it.
        user.groups.add(Group.objects.get(name=FINANCE_GROUP))
    yield month


def ledger_usd(month: str) -> float:
    """Return the USD of team ledger in ``month`` as the cost report has it now."""
    now = timezone.now()
    query = reports.report_query({"from": month, "to": month, "team": TEAM}, now=now)
    return float(reports.usage_report(query, now=now).totals()["usd"])


def test_finance_downloads_the_month_csv_matching_the_usage_table(
    page: Page, ledger: datetime
) -> None:
    """GIVEN team ledger's usage rows this month (and one last month),
    WHEN a finance user opens the reports page, asks for this month only and
    downloads its CSV,
    THEN the page's row for the team and month and the CSV's line add up to this
    month's usage rows, and the CSV's USD is what the cost report says."""
    label = f"{ledger:%Y-%m}"
    expected = {f: sum(c.get(f, 0) for _, c in ROWS) for f in COUNTED}
    stored = Usage.objects.filter(
        team_id=TEAM, minute__gte=ledger, minute__lt=ledger + timedelta(days=32)
    ).aggregate(**{f: Sum(f) for f in COUNTED})
    assert stored == expected  # the seed is what the table holds

    log_in(page, FINANCE, next_path="/console/reports/")
    page.fill("#report-filters input[name=from]", label)
    page.fill("#report-filters input[name=to]", label)
    with page.expect_navigation():
        page.click("#report-filters input[type=submit]")
    row = page.locator(f'#report tr[data-team="{TEAM}"][data-month="{label}"]')
    expect(row).to_have_count(1)
    for name, count in expected.items():
        expect(row.locator(f"[data-field={name}]")).to_have_text(str(count))
    expect(
        page.locator(f'#report tr[data-month]:not([data-month="{label}"])')
    ).to_have_count(0)
    expect(page.locator("canvas#report-chart")).to_be_visible()
    page.wait_for_function(
        "() => window.Chart && !!Chart.getChart(document.querySelector('#report-chart'))"
    )

    before = ledger_usd(label)
    with page.expect_download() as download_info:
        page.click("a#download-csv")
    download = download_info.value
    after = ledger_usd(label)
    assert download.suggested_filename == f"usage-{label}.csv"
    text = download.path().read_text()

    lines = [
        line
        for line in csv.DictReader(io.StringIO(text))
        if line["team"] == TEAM and line["line"] == "team"
    ]
    assert lines, text
    assert {line["period"] for line in lines} == {label}
    totals = {f: sum(int(line[f]) for line in lines) for f in COUNTED}
    assert totals == expected
    usd = sum(float(line["usd"]) for line in lines)
    assert usd > 0
    # The cost report's figure between just before and just after the download:
    # the GPU time of a replica still serving counts until "now", so the team's
    # share moves a little from one instant to the next (rounded to 6 digits).
    assert min(before, after) - 1e-6 <= usd <= max(before, after) + 1e-6, (
        before,
        usd,
        after,
    )


@pytest.mark.parametrize(
    "path",
    [
        "/console/accounts/apikey/",
        "/console/accounts/teamlimit/",
        "/console/fleet/pools/chat-7b/v1/e2e/",
    ],
)
def test_finance_is_refused_keys_limits_and_pools(
    page: Page, ledger: datetime, path: str
) -> None:
    log_in(page, FINANCE, next_path="/console/reports/")
    response = page.goto(path)
    assert response is not None
    assert response.status == 403, (response.status, page.url)

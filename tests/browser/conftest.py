"""The console in a real browser: Playwright driving Debian's Chromium.

Public surface: ``browser_platform``, ``oidc_provider``, ``playwright``,
``browser``, ``page``, ``log_in``, ``FAILURES``, ``OPERATOR``, ``SSO_FINANCE``,
``SSO_VIEWER``, ``TIMEOUT_MS``.

One platform serves every browser test (``browser_platform``): the gateway, the
console and the static files in one uvicorn process on ``config.asgi`` (as `make
up` serves them), the node agent and its simulated replicas, seeded by
``tests.live.start_platform``, plus a console superuser committed to the test
database so that the server process sees it. The console's single sign-on points
at a real OIDC provider run for the package (``oidc_provider``,
``tests.oidc_provider``), which knows ``SSO_FINANCE`` and ``SSO_VIEWER`` (a viewer
of team alpha); password login stays on. One Chromium runs for the package
(``browser``), each test gets a fresh context and page (``page``).

Playwright's own browser download cannot work here, so Chromium is Debian's
(``chromium_binary`` in the root conftest, which skips, or fails under
``REQUIRE_SERVICES=1``, when it is missing). A test that fails leaves a screenshot
and the page's HTML under ``.local/browser-failures/`` (``<test name>.png`` and
``.html``, with the failure in ``.txt``), and its report names them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth import get_user_model

from tests.live import LivePlatform, start_platform
from tests.oidc_provider.process import OidcProvider, ProviderUser, run_provider

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page, Playwright
    from pytest_django import DjangoDbBlocker

ROOT = Path(__file__).resolve().parents[2]
FAILURES = ROOT / ".local" / "browser-failures"
OPERATOR = ("operator", "operator-Pa55-word")
SSO_FINANCE = ProviderUser(
    "fiona", "fiona-Pa55-word", ("finance",), "fiona@example.com"
)
SSO_VIEWER = ProviderUser(
    "victor", "victor-Pa55-word", ("team-viewer:alpha",), "victor@example.com"
)
# Chromium as root in a container: no user-namespace sandbox, a small /dev/shm.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]
# How long a browser test waits on a page (a refresh every 2 s, heartbeats every 1 s).
TIMEOUT_MS = 20_000


@pytest.fixture(scope="package")
def playwright(
    chromium_binary: str, browser_platform: LivePlatform
) -> Iterator[Playwright]:
    """Run Playwright's driver while the package's tests run.

    Its sync API keeps an asyncio loop running in this thread, so Django's check
    against ORM calls from async code would refuse every query the tests make
    between two browser calls; nothing of Django runs on that loop, so the check
    is lifted while the driver runs (``DJANGO_ALLOW_ASYNC_UNSAFE``, Django's switch
    for such environments), and restored after. Django keeps the connections opened meanwhile
    apart from the others (they are per context, and the loop's is another): they
    are closed here, or the test database could not be dropped at the end. The
    platform starts first, so that its processes never inherit the lifted check;
    before it, ``chromium_binary`` skips (or fails) where there is no Chromium.
    """
    from django.db import connections
    from playwright.sync_api import expect, sync_playwright

    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    driver = sync_playwright().start()
    # Pages refresh every 2 s on a loaded machine: more than expect's default 5 s.
    expect.set_options(timeout=TIMEOUT_MS)
    try:
        yield driver
    finally:
        connections.close_all()
        driver.stop()
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture(scope="package")
def browser(playwright: Playwright, chromium_binary: str) -> Iterator[Browser]:
    """Return one headless Chromium (Debian's) for the package."""
    chromium = playwright.chromium.launch(
        executable_path=chromium_binary, headless=True, args=CHROMIUM_ARGS
    )
    try:
        yield chromium
    finally:
        chromium.close()


@pytest.fixture
def page(browser: Browser, browser_platform: LivePlatform) -> Iterator[Page]:
    """Return a page in a fresh context (no cookies) on the platform's origin."""
    context = browser.new_context(base_url=browser_platform.url, accept_downloads=True)
    context.set_default_timeout(TIMEOUT_MS)
    tab = context.new_page()
    try:
        yield tab
    finally:
        context.close()


@pytest.fixture(scope="package")
def oidc_provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    """Run the OIDC provider the console's single sign-on uses in these tests.

    The callback is registered on the loopback address without a port: the
    provider (django-oauth-toolkit, RFC 8252) lets a loopback client's port vary,
    and the platform's port is drawn after the provider starts.
    """
    with run_provider(
        tmp_path_factory.mktemp("oidc"),
        users=[SSO_FINANCE, SSO_VIEWER],
        redirect_uris=["http://127.0.0.1/console/sso/callback/"],
    ) as provider:
        yield provider


@pytest.fixture(scope="package")
def browser_platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    oidc_provider: OidcProvider,
) -> Iterator[LivePlatform]:
    """Run the platform the browser tests share: chat-7b@v1 on one replica in
    region e2e, v2 ready to roll out (a pool of none), static files served, the
    console's single sign-on on ``oidc_provider``."""
    tmp = tmp_path_factory.mktemp("browser")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 1, "v2": 0},
            PLATFORM_SERVE_STATIC="true",
            PLATFORM_OIDC_DISCOVERY_URL=oidc_provider.discovery_url,
            PLATFORM_OIDC_CLIENT_ID=oidc_provider.client_id,
            PLATFORM_OIDC_CLIENT_SECRET=oidc_provider.client_secret,
        ) as live,
    ):
        get_user_model().objects.create_superuser(
            username=OPERATOR[0], email="operator@example.com", password=OPERATOR[1]
        )
        yield live


def log_in(page: Page, user: tuple[str, str], *, next_path: str = "/console/") -> None:
    """Log ``user`` in through the console's login form and wait for ``next_path``."""
    page.goto(f"/console/login/?next={next_path}")
    page.fill("#id_username", user[0])
    page.fill("#id_password", user[1])
    with page.expect_navigation():
        page.click("input[type=submit]")
    if "/console/login/" in page.url:
        errors = page.locator(".errornote, .errorlist").all_inner_texts()
        raise AssertionError(f"login as {user[0]} failed: {errors}")
    if not page.url.endswith(next_path):
        raise AssertionError(f"login as {user[0]} led to {page.url}, not {next_path}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep a screenshot and the HTML of a failed test's page, and its failure as
    text, and name them in its report."""
    report = yield
    tab = getattr(item, "funcargs", {}).get("page")
    if report.failed and report.when == "call" and tab is not None:
        FAILURES.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.name)
        shot, html = FAILURES / f"{name}.png", FAILURES / f"{name}.html"
        # The failure itself beside them: a CI log may be cut before it.
        (FAILURES / f"{name}.txt").write_text(report.longreprtext)
        try:
            tab.screenshot(path=str(shot), full_page=True)
            html.write_text(tab.content())
        except Exception as exc:  # a closed page must not hide the failure
            report.sections.append(("browser", f"no screenshot: {exc}"))
        else:
            report.sections.append(
                ("browser", f"screenshot {shot}\npage HTML {html}\nat {tab.url}")
            )
    return report

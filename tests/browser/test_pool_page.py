"""A pool's page refreshing by itself in Chromium while streams are in flight."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import OPERATOR, log_in

if TYPE_CHECKING:
    from playwright.sync_api import Frame, Page, Response

    from tests.live import LivePlatform

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POOL_PATH = "/console/fleet/pools/chat-7b/v1/e2e/"
# The pool's own figure, not a replica row's (the replicas table may sit inside #pool).
POOL_TOKENS = "#pool [data-field=tokens_in_flight]:not(#replicas *)"
STREAMS = 4
# Each stream runs to max_tokens (ignore_eos): at the simulated A100's ~95 tokens
# per second per sequence, a few seconds in flight, longer than a heartbeat.
MAX_TOKENS = 400
# The figure in a cell, whatever its formatting ("1,234", "1.2k", "12 tokens").
NUMBER_ABOVE_ZERO = """(selector) => {
    const cell = document.querySelector(selector);
    if (!cell) return false;
    const number = parseFloat(cell.textContent.replace(/[^0-9.]/g, ""));
    return number > 0;
}"""


@contextmanager
def streaming_load(live: LivePlatform) -> Iterator[threading.Event]:
    """Keep ``STREAMS`` streaming chat completions in flight until the block ends.

    Yields an event set once the first answer finished, so a failure says whether
    the gateway served at all. Every stream is read to its end, and every error
    is raised when the block ends.
    """
    stop, answered = threading.Event(), threading.Event()

    def keep_streaming(worker: int) -> None:
        client = live.client("alpha", timeout=60)
        while not stop.is_set():
            stream = client.chat.completions.create(
                model="chat-7b",
                messages=[
                    {"role": "user", "content": f"Count slowly, worker {worker}"}
                ],
                max_tokens=MAX_TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                pass
            answered.set()

    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(keep_streaming, n) for n in range(STREAMS)]
        try:
            yield answered
        finally:
            stop.set()
            for future in futures:
                future.result()


def test_pool_page_updates_under_load_without_a_reload(
    page: Page, browser_platform: LivePlatform
) -> None:
    """GIVEN the pool page of chat-7b@v1 in e2e open, no request in flight,
    WHEN streaming completions go through the gateway,
    THEN its tokens in flight (pool and replica) rise above 0 and the page's
    refresh stamp changes, with no navigation (a script's mark survives), and the
    chart's library loaded from the platform's static files."""
    failed_static: list[str] = []

    def on_response(response: Response) -> None:
        if "/static/" in response.url and response.status >= 400:
            failed_static.append(f"{response.status} {response.url}")

    page.on("response", on_response)
    log_in(page, OPERATOR, next_path=POOL_PATH)
    pool = page.locator("#pool")
    expect(pool).to_have_attribute("data-refreshed-at", re.compile(r".+"))
    expect(page.locator("canvas#pool-chart")).to_be_visible()
    # Chart.js loaded (from static files) and drew on the canvas.
    page.wait_for_function(
        "() => window.Chart && !!Chart.getChart(document.querySelector('#pool-chart'))"
    )
    replicas = page.locator("#replicas tr[data-replica]")
    expect(replicas).to_have_count(1)
    replica_id = replicas.first.get_attribute("data-replica")
    assert replica_id
    expect(replicas.first.locator("[data-field=state]")).to_have_text("serving")
    expect(
        page.locator("#pool [data-field=capacity_tokens_in_flight]")
    ).not_to_be_empty()
    # Nothing in flight yet: what rises below is the load's.
    expect(page.locator(POOL_TOKENS)).to_have_text(re.compile(r"^\D*0(\.0+)?\D*$"))

    navigations: list[str] = []

    def on_navigation(frame: Frame) -> None:
        if frame == page.main_frame:
            navigations.append(frame.url)

    page.on("framenavigated", on_navigation)
    page.evaluate("window.__marker = 1")
    first_stamp = pool.get_attribute("data-refreshed-at")

    with streaming_load(browser_platform) as answered:
        page.wait_for_function(NUMBER_ABOVE_ZERO, arg=POOL_TOKENS)
        page.wait_for_function(
            NUMBER_ABOVE_ZERO,
            arg=f'#replicas tr[data-replica="{replica_id}"] [data-field=tokens_in_flight]',
        )
    assert answered.is_set(), "no stream finished"

    page.wait_for_function(
        "(stamp) => document.querySelector('#pool').dataset.refreshedAt !== stamp",
        arg=first_stamp,
    )
    assert page.evaluate("window.__marker") == 1, "the page was reloaded"
    assert navigations == [], navigations
    assert failed_static == [], failed_static

"""Each pool's p95 TTFT and hit rate in Chromium, per pool and region, with no
rollout running: the gateways' live figures, as the pool state API gives them."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from metering.services import flush_redis_figures
from rollouts.domain.plan import Decision
from rollouts.models import Rollout
from tests.browser.conftest import OPERATOR, log_in
from tests.live import cached_tokens_of

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam
    from playwright.sync_api import Page
    from pytest_django import DjangoDbBlocker

    from tests.live import LivePlatform

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POOL = "chat-7b/v1/e2e"
POOL_PATH = f"/console/fleet/pools/{POOL}/"
# A figure the console formats ("123 ms", "45.0%"), not its "—" for none.
MS = re.compile(r"^\d+ ms$")
PERCENT = re.compile(r"^(?!0\.0%)\d+(\.\d)?%$")


def serve_without_a_rollout(live: LivePlatform) -> int:
    """Send conversations of two turns, the second hitting the first's prefix;
    return the cached tokens the answers reported."""
    system: ChatCompletionMessageParam = {
        "role": "system",
        "content": "You answer briefly. " * 40,
    }
    cached = 0
    client = live.client("alpha", timeout=60)
    for i in range(4):
        turns: list[ChatCompletionMessageParam] = [system]
        for text in ("one", "two"):
            turns.append({"role": "user", "content": f"{text} {i}"})
            answer = client.chat.completions.create(
                model="chat-7b",
                messages=turns,
                max_tokens=8,
                extra_headers={"x-conversation-id": f"pool-figures-{i}"},
            )
            cached += cached_tokens_of(answer)
            turns.append(
                {"role": "assistant", "content": answer.choices[0].message.content}
            )
    return cached


def flush(live: LivePlatform) -> None:
    """Write the gateways' figures to their rows, as the beat task would (without
    Redis the gateway flushes its own every second)."""
    if os.environ.get("REDIS_URL"):
        import redis

        with redis.Redis.from_url(os.environ["REDIS_URL"]) as client:
            flush_redis_figures(
                client=client,
                prefix=live.prefix,
                region=live.region,
                now=timezone.now(),
            )


def test_pool_page_and_fleet_show_live_ttft_and_hit_rate_without_a_rollout(
    page: Page,
    browser_platform: LivePlatform,
    django_db_blocker: DjangoDbBlocker,
) -> None:
    """GIVEN chat-7b@v1 serving in region e2e and no rollout,
    WHEN chats (with follow-up turns) go through the gateway,
    THEN the pool's page and the fleet's row show its p95 TTFT and prefix hit
    rate, and its page names the pool's region."""
    with django_db_blocker.unblock():
        assert not Rollout.objects.filter(
            model_id="chat-7b", decision=Decision.PENDING
        ).exists()
        assert serve_without_a_rollout(browser_platform) > 0
        flush(browser_platform)

    log_in(page, OPERATOR, next_path=POOL_PATH)
    summary = page.locator("#pool-summary")
    # The feed refreshes every 2 s: the figures arrive with the next refresh at
    # the latest (the gateway's own flush without Redis).
    expect(summary.locator("[data-field=ttft_p95_ms]")).to_have_text(MS)
    expect(summary.locator("[data-field=prefix_hit_rate]")).to_have_text(PERCENT)
    expect(summary.locator("[data-field=ttft_p99_ms]")).to_have_text(MS)
    expect(page.locator("body")).to_contain_text("in e2e")

    page.goto("/console/")
    row = page.locator(f'tr[data-pool="{POOL}"]')
    expect(row.locator("[data-field=ttft_p95_ms]")).to_have_text(MS)
    expect(row.locator("[data-field=prefix_hit_rate]")).to_have_text(PERCENT)

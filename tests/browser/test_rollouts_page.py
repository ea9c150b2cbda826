"""Starting a rollout and rolling it back from the console, in Chromium."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from models_registry.models import Model
from rollouts import plans
from rollouts.domain.plan import Decision
from rollouts.models import Rollout
from tests.browser.conftest import OPERATOR, log_in

if TYPE_CHECKING:
    from collections.abc import Iterator

    from playwright.sync_api import Page
    from pytest_django import DjangoDbBlocker

    from tests.live import LivePlatform

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROLLOUT_PATH = "/console/rollouts/chat-7b/"
# What the console's "roll back" ends a rollout as: ``plans.control``'s abort
# (traffic back on the live version, the candidate not rejected), or a rollback.
ENDED_BY_ROLLBACK = {Decision.ABORTED.value, Decision.ROLLED_BACK.value}
CANARY_STEP = {"stage": "canary", "percent": 10.0}


def pending_rollout() -> Rollout | None:
    return (
        Rollout.objects.filter(model_id="chat-7b", decision=Decision.PENDING)
        .select_related("version")
        .first()
    )


@pytest.fixture
def canary_plan(
    browser_platform: LivePlatform, django_db_blocker: DjangoDbBlocker
) -> Iterator[None]:
    """Give chat-7b a plan that starts at a canary (the default's starts at a
    shadow, which sets no canary share), and take it away after."""
    with django_db_blocker.unblock():
        plans.set_model_plan("chat-7b", {"steps": [CANARY_STEP]})
        yield
        plans.set_model_plan("chat-7b", {})


def test_rollout_starts_and_rolls_back_from_the_console(
    page: Page, canary_plan: None
) -> None:
    """GIVEN chat-7b@v1 live, v2 ready, no rollout, a plan that starts at a canary,
    WHEN the operator starts v2 from the model's rollout page (and its step
    begins), THEN a pending rollout of v2 runs on the plan with its canary share
    and the page shows its stage and state; WHEN they roll it back, THEN it ends,
    the canary share is gone, v1 is still live, and the page shows how it ended."""
    assert pending_rollout() is None
    log_in(page, OPERATOR, next_path=ROLLOUT_PATH)

    page.select_option("select[name=version]", "v2")
    with page.expect_navigation():
        page.click("button[name=action][value=start]")

    expect(page.locator(".messagelist")).to_contain_text("v2")
    rollout = pending_rollout()
    assert rollout is not None, "no rollout started"
    assert rollout.version.version == "v2"
    assert rollout.plan is not None  # the model's plan, not a stage set by hand
    assert (
        rollout.previous_version_id == Model.objects.get(pk="chat-7b").live_version_id
    )
    # What the guard task does once v2 serves (no worker runs here): the step's
    # traffic begins, v2 takes its canary share.
    assert plans.begin_step(rollout.pk, now=timezone.now())
    model = Model.objects.get(pk="chat-7b")
    assert model.canary_version_id == rollout.version_id
    assert model.canary_percent == CANARY_STEP["percent"]
    page.reload()
    panel = page.locator("#rollout")
    expect(panel.locator("[data-field=stage]")).to_contain_text(
        rollout.stage, ignore_case=True
    )
    expect(panel.locator("[data-field=state]")).to_contain_text(
        "running", ignore_case=True
    )
    expect(page.locator("#guards")).to_be_attached()

    with page.expect_navigation():
        page.click("button[name=action][value=rollback]")

    rollout.refresh_from_db()
    assert rollout.decision in ENDED_BY_ROLLBACK, rollout.decision
    assert rollout.decided_at is not None
    # The POST answered (its redirect followed): the change is committed.
    model = Model.objects.select_related("live_version").get(pk="chat-7b")
    assert model.canary_version_id is None
    assert model.canary_percent == 0.0
    assert model.live_version is not None
    assert model.live_version.version == "v1"
    assert pending_rollout() is None
    state = re.compile(rollout.decision.replace("_", "[ _]"), re.IGNORECASE)
    expect(panel.locator("[data-field=state]")).to_have_text(state)
    # Nothing left to roll back: the page offers a new start instead.
    expect(page.locator("button[name=action][value=rollback]")).to_have_count(0)
    expect(page.locator("button[name=action][value=start]")).to_be_visible()

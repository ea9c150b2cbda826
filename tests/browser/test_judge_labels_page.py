"""A reviewer labels the eval judge's verdicts in the console, in Chromium, and
sees the judge's kappa change with each label.

Written against /console/judge-labels/ (``console.judge_labels``):
``#label-progress[data-labelled][data-total]``, ``#judge-agreement
tr[data-judge] [data-field=kappa][data-kappa]``, ``#judge-item[data-item-id]``
with ``#answer-a``, ``#answer-b`` and the buttons ``#label-a``, ``#label-b``,
``#label-tie``; ``#judge-item-none`` once all are labelled.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from playwright.sync_api import expect

from models_registry import judge_labels
from models_registry.models import JudgeItem
from tests.browser.conftest import log_in

if TYPE_CHECKING:
    from playwright.sync_api import Page
    from pytest_django import DjangoDbBlocker

    from tests.live import LivePlatform

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REVIEWER = ("judge-reviewer", "review-Pa55-word")
JUDGE = "reason-70b@v7"  # a judge of its own: no gate run adds items to it
# What the judge said of each item, in the pair's own terms, and the side the
# reviewer is shown the candidate's answer on.
ITEMS = (("candidate", "b"), ("live", "a"), ("tie", "b"))


@pytest.fixture(scope="module")
def items(
    browser_platform: LivePlatform, django_db_blocker: DjangoDbBlocker
) -> Iterator[list[int]]:
    """Keep three judge verdicts to label and a reviewer who may label them."""
    with django_db_blocker.unblock():
        made = [
            JudgeItem.objects.create(
                judge=JUDGE,
                judge_prompt="judge-v1",
                candidate="chat-7b@v2",
                live="chat-7b@v1",
                eval_set="file:///evals/browser.jsonl",
                item_id=f"browser-{n}",
                question=[{"role": "user", "content": f"What is {n} + {n}?"}],
                answer_a=f"The answer is {2 * n}." if side == "a" else f"{2 * n + 1}",
                answer_b=f"The answer is {2 * n}." if side == "b" else f"{2 * n + 1}",
                candidate_side=side,
                judge_verdict=verdict,
            ).pk
            for n, (verdict, side) in enumerate(ITEMS, start=1)
        ]
        user = get_user_model().objects.create_user(
            username=REVIEWER[0], password=REVIEWER[1], is_staff=True
        )
        user.user_permissions.add(
            Permission.objects.get(
                codename="change_judgeitem", content_type__app_label="models_registry"
            )
        )
    try:
        yield made
    finally:
        with django_db_blocker.unblock():
            JudgeItem.objects.filter(judge=JUDGE).delete()
            get_user_model().objects.filter(username=REVIEWER[0]).delete()


def label(page: Page, button: str) -> None:
    with page.expect_navigation():
        page.click(button)


def test_reviewer_labels_items_and_sees_the_kappa_change(
    page: Page, items: list[int], django_db_blocker: DjangoDbBlocker
) -> None:
    """GIVEN three verdicts of one judge, none labelled,
    WHEN a reviewer labels them in the console (agreeing, disagreeing, tie),
    THEN after each the page's kappa for the judge is Cohen's kappa of the labels
    so far (1, 0, 0.5), the progress counts up, and the labels are stored."""
    log_in(page, REVIEWER, next_path="/console/judge-labels/")
    progress = page.locator("#label-progress")
    kappa = page.locator(
        f'#judge-agreement tr[data-judge="{JUDGE}"] [data-field=kappa]'
    )
    expect(progress).to_have_attribute("data-total", "3")
    expect(progress).to_have_attribute("data-labelled", "0")
    expect(kappa).to_have_text("—")

    # 1: the judge preferred the candidate (shown as B); so does the reviewer.
    expect(page.locator("#judge-item")).to_have_attribute("data-item-id", str(items[0]))
    expect(page.locator("#answer-b")).to_have_text("The answer is 2.")
    label(page, "#label-b")
    expect(kappa).to_have_attribute("data-kappa", "1.000")
    expect(progress).to_have_attribute("data-labelled", "1")

    # 2: the judge preferred live; the reviewer the candidate (shown as A).
    expect(page.locator("#judge-item")).to_have_attribute("data-item-id", str(items[1]))
    label(page, "#label-a")
    expect(kappa).to_have_attribute("data-kappa", "0.000")

    # 3: both say tie.
    expect(page.locator("#judge-item")).to_have_attribute("data-item-id", str(items[2]))
    label(page, "#label-tie")
    expect(kappa).to_have_attribute("data-kappa", "0.500")
    expect(kappa).to_have_text("0.50")
    expect(progress).to_have_attribute("data-labelled", "3")
    expect(page.locator("#judge-item-none")).to_be_visible()

    with django_db_blocker.unblock():
        stored = dict(JudgeItem.objects.filter(judge=JUDGE).values_list("pk", "label"))
        agreement = judge_labels.agreement_for(JUDGE, min_kappa=0.6, min_labels=20)
        reviewers = set(
            JudgeItem.objects.filter(judge=JUDGE).values_list("labelled_by", flat=True)
        )
    assert stored == dict(zip(items, ["b", "a", "tie"], strict=True))
    assert agreement.kappa == pytest.approx(0.5)
    assert reviewers == {f"console user {REVIEWER[0]}"}

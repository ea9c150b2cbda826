"""The console's labelling page with Django's test client: blind, one label each."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from models_registry import judge_labels
from models_registry import services as registry_services
from models_registry.models import JudgeItem, ModelVersion
from rollouts.services import set_alias
from tests.factories import VERSION_BODY, accept

pytestmark = pytest.mark.django_db

PAGE = "/console/judge-labels/"


def item(n: int, *, verdict: str = "candidate", side: str = "a") -> JudgeItem:
    return JudgeItem.objects.create(
        judge="reason-70b@v1",
        judge_prompt="judge-v1",
        candidate="chat-7b@v2",
        live="chat-7b@v1",
        eval_set="file:///evals/default.jsonl",
        item_id=f"maths-{n}",
        question=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {n} times 3?"},
        ],
        answer_a=f"answer one of {n}",
        answer_b=f"answer two of {n}",
        candidate_side=side,
        judge_verdict=verdict,
    )


@pytest.fixture
def console() -> Client:
    user = get_user_model().objects.create_superuser(username="reviewer")
    client = Client()
    client.force_login(user)
    return client


def test_label_page_shows_one_item_blind(console: Client) -> None:
    first = item(1)
    item(2)
    page = console.get(PAGE).content.decode()
    assert f'data-item-id="{first.pk}"' in page
    assert "What is 1 times 3?" in page and "answer one of 1" in page
    assert "What is 2 times 3?" not in page
    # Nothing says which version wrote which, nor what the judge said.
    for secret in ("chat-7b@v2", "chat-7b@v1", "candidate", ">live<"):
        assert secret not in page
    assert 'data-labelled="0" data-total="2"' in page


def test_label_page_records_label_and_reviewer_then_shows_the_next(
    console: Client,
) -> None:
    first, second = item(1), item(2, verdict="live")
    response = console.post(PAGE, {"item": first.pk, "label": "a"})
    assert response.status_code == 302
    first.refresh_from_db()
    assert (first.label, first.labelled_by) == ("a", "console user reviewer")
    page = console.get(PAGE).content.decode()
    assert f'data-item-id="{second.pk}"' in page
    assert 'data-labelled="1" data-total="2"' in page
    assert 'data-kappa="1.000"' in page  # one label, agreeing
    console.post(PAGE, {"item": first.pk, "label": "b"})  # labelled already
    first.refresh_from_db()
    assert first.label == "a"


def test_label_page_refuses_an_unknown_label(console: Client) -> None:
    first = item(1)
    console.post(PAGE, {"item": first.pk, "label": "maybe"})
    first.refresh_from_db()
    assert first.label == ""


def test_label_page_refuses_staff_without_the_permission() -> None:
    user = get_user_model().objects.create_user(username="viewer", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.get(PAGE).status_code == 403


def test_version_page_shows_the_judges_agreement_beside_its_gates(
    console: Client, chat_v1: ModelVersion
) -> None:
    registry_services.create_model(model_id="reason-70b")
    judge = accept(
        registry_services.register_version(model_id="reason-70b", **VERSION_BODY)
    )
    set_alias(model_id="reason-70b", version=judge.version)
    first = item(1)
    first.judge = judge.ref
    first.save()
    judge_labels.label_item(
        item_id=first.pk, label="a", reviewer="ana", now=timezone.now()
    )
    page = console.get(
        reverse("admin:models_registry_modelversion_change", args=[chat_v1.pk])
    ).content.decode()
    assert (
        f'<p class="judge-agreement">the judge {judge.ref}: Cohen&#x27;s kappa 1.00'
    ) in page
    assert "at least 20 are needed before they decide" in page

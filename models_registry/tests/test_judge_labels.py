"""Judge items and human labels against the real database."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from models_registry import judge_labels
from models_registry.domain.judge_agreement import JudgedPair
from models_registry.models import JudgeItem

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
JUDGE = "reason-70b@v1"


def pairs(n: int, verdict: str = "candidate") -> list[JudgedPair]:
    return [
        JudgedPair(
            item_id=f"item-{i}",
            messages=({"role": "user", "content": f"What is {i} + {i}?"},),
            candidate_answer=f"{2 * i}",
            live_answer=f"{2 * i + 1}",
            verdict=verdict,
        )
        for i in range(n)
    ]


def record(n: int, *, sample: int = 20, eval_set: str = "file:///e.jsonl") -> int:
    return judge_labels.record_judge_items(
        gate_run=None,
        eval_set=eval_set,
        judge=JUDGE,
        judge_prompt="judge-v1",
        candidate="chat-7b@v2",
        live="chat-7b@v1",
        pairs=pairs(n),
        sample_size=sample,
    )


def test_record_judge_items_keeps_a_sample_blind_in_either_order() -> None:
    assert record(30, sample=12) == 12
    items = list(JudgeItem.objects.all())
    assert len(items) == 12
    for item in items:
        n = int(item.item_id.removeprefix("item-"))
        candidate = item.answer_a if item.candidate_side == "a" else item.answer_b
        live = item.answer_b if item.candidate_side == "a" else item.answer_a
        assert (candidate, live) == (f"{2 * n}", f"{2 * n + 1}")
        assert item.question == [{"role": "user", "content": f"What is {n} + {n}?"}]
        assert item.label == ""


def test_record_judge_items_with_a_sample_of_none_keeps_nothing() -> None:
    assert record(5, sample=0) == 0
    assert not JudgeItem.objects.exists()


def test_label_item_records_the_reviewer_once() -> None:
    record(2)
    first = judge_labels.next_item()
    assert first is not None
    assert judge_labels.label_item(
        item_id=first.pk, label="tie", reviewer="ana", now=NOW
    )
    assert not judge_labels.label_item(
        item_id=first.pk, label="a", reviewer="bo", now=NOW
    )
    first.refresh_from_db()
    assert (first.label, first.labelled_by, first.labelled_at) == ("tie", "ana", NOW)
    second = judge_labels.next_item()
    assert second is not None and second.pk != first.pk
    assert judge_labels.label_progress() == (1, 2)
    with pytest.raises(ValueError, match="a label is"):
        judge_labels.label_item(item_id=second.pk, label="", reviewer="x", now=NOW)


def test_agreement_reads_labels_in_the_pairs_own_terms() -> None:
    """A label names the side shown; the judge's verdict names the version."""
    record(4)  # the judge said "candidate" on every item
    for item in JudgeItem.objects.all():
        judge_labels.label_item(
            item_id=item.pk, label=item.candidate_side, reviewer="ana", now=NOW
        )
    agreement = judge_labels.agreement_for(JUDGE, min_kappa=0.6, min_labels=4)
    assert agreement.labels == 4
    assert agreement.estimate is not None and agreement.estimate.agreed == 4
    trust = judge_labels.trust_from_agreement(agreement)
    assert trust is not None and trust.trusted and trust.labelled == 4
    few = judge_labels.agreement_for(JUDGE, min_kappa=0.6, min_labels=5)
    assert judge_labels.trust_from_agreement(few) is None
    assert [a.judge for a in judge_labels.agreements()] == [JUDGE]
    assert judge_labels.human_verdict("tie", "a") == "tie"
    assert judge_labels.human_verdict("b", "a") == "live"

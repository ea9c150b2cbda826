"""The eval gate and human labels: a judge people disagree with cannot gate."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from control import gates
from control.tests.test_gates import register, storage, weights_tree
from models_registry import services as registry
from models_registry.models import GateRun, JudgeItem, Model
from rollouts.services import set_alias
from tests.factories import version_body

__all__ = ["storage"]  # the fixture, used by name

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def live_judge(storage: Path) -> str:
    """Register reason-70b@v1 and make it live; return its model@version."""
    registry.create_model(model_id="reason-70b")
    uri, digest = weights_tree(storage / "registered" / "judge", b"judge")
    registry.register_version(
        model_id="reason-70b",
        version="v1",
        **version_body(weights_uri=uri, weights_hash=digest),
    )
    registry.accept_version(model_id="reason-70b", version="v1", by="t", reason="t")
    set_alias(model_id="reason-70b", version="v1")
    return "reason-70b@v1"


def label(judge: str, verdicts_and_labels: list[tuple[str, str]]) -> None:
    """Store items the judge decided and people labelled (candidate shown as A)."""
    for n, (verdict, human) in enumerate(verdicts_and_labels):
        JudgeItem.objects.create(
            judge=judge,
            judge_prompt="judge-v1",
            candidate="chat-7b@v0",
            live="chat-7b@v00",
            eval_set="file:///earlier.jsonl",
            item_id=f"item-{n}",
            question=[{"role": "user", "content": "?"}],
            answer_a="x",
            answer_b="y",
            candidate_side="a",
            judge_verdict=verdict,
            label={"candidate": "a", "live": "b", "tie": "tie"}[human],
            labelled_by="ana",
            labelled_at=NOW,
        )


def test_a_judge_below_its_floor_by_human_labels_fails_the_gate_closed(
    storage: Path, chat_model: Model
) -> None:
    judge = live_judge(storage)
    C, L = "candidate", "live"
    # 20 labels (min_labels), 12 agree on balanced sides: kappa 0.2 < 0.6.
    label(judge, [(C, C)] * 6 + [(L, L)] * 6 + [(C, L)] * 4 + [(L, C)] * 4)
    version = register(storage, chat_model)

    gates.run_gates(version.pk, 1)

    version.refresh_from_db()
    assert version.status == "rejected"
    assert version.status_reason.startswith(
        "eval gate: the judge reason-70b@v1 cannot gate: Cohen's kappa 0.20 (95% CI"
    )
    assert version.status_reason.endswith(
        "over 20 human labels, below its floor 0.60, so the gate fails closed"
    )
    run = GateRun.objects.get(version=version, kind="eval")
    assert run.result["judge_agreement"]["can_gate"] is False
    history = registry.gate_history("chat-7b", "v2")
    assert history["judge_agreement"] is not None
    assert history["judge_agreement"]["kappa"] == pytest.approx(0.2)


def test_too_few_human_labels_leave_the_judge_to_the_eval_sets_pairs(
    storage: Path, chat_model: Model
) -> None:
    judge = live_judge(storage)
    label(judge, [("candidate", "live")] * 19)  # all wrong, one label short
    assert gates._judge_agreement("reason-70b", gates.GateConfig()) is not None

"""Human labels for the eval gate's judge: items to grade, labels, agreement.

The eval gate keeps a sample of the judge's verdicts (``record_judge_items``,
``PLATFORM_JUDGE_LABEL_SAMPLE`` per eval set and gate run); reviewers grade them
blind in the console (``next_item``, ``label_item``); the judge's agreement with
them (``agreement_for``: Cohen's kappa with its interval,
``models_registry.domain.judge_agreement``) is recomputed from the labels per
judge (its model@version) whenever it is read. When enough people have labelled
(``min_labels``), their labels decide whether the judge may gate
(``trust_from_agreement``), ahead of an eval set's own labelled pairs. See
docs/platform-admins.md, "Human labels for the judge".

Prompt and answer text stored here come from the platform's own eval sets, not
from users' traffic.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction

from models_registry.domain.eval_gate import JudgeTrust
from models_registry.domain.gates import GateConfig, parse_gate_config
from models_registry.domain.judge_agreement import (
    Agreement,
    JudgedPair,
    judge_agreement,
    sample_for_labels,
)
from models_registry.models import GateRun, JudgeItem, JudgeLabel, Model, ModelKind

__all__ = [
    "agreement_for",
    "agreements",
    "human_verdict",
    "judge_version",
    "label_item",
    "label_progress",
    "model_agreement",
    "next_item",
    "record_judge_items",
    "trust_from_agreement",
]

# Reviewers' order of a pair: drawn from the OS, so nothing about it can be
# inferred from the item (the judge's own order is a hash of the item's id).
_SIDES = random.SystemRandom()


def judge_version(judge_model: str) -> str | None:
    """Return the judge's model@version that answers now (its live version)."""
    found = Model.objects.select_related("live_version").filter(pk=judge_model).first()
    if found is None or found.live_version is None:
        return None
    return found.live_version.ref


def record_judge_items(
    *,
    gate_run: GateRun | None,
    eval_set: str,
    judge: str,
    judge_prompt: str,
    candidate: str,
    live: str,
    pairs: Sequence[JudgedPair],
    sample_size: int,
) -> int:
    """Keep a sample of ``pairs`` as items to label; return how many were kept.

    The sample is stable per gate run and eval set, so a resumed gate keeps the
    same items (and a second write of one is skipped by its unique key).
    """
    by_id = {p.item_id: p for p in pairs}
    seed = f"{gate_run.pk if gate_run else 'none'}\0{eval_set}"
    kept = 0
    for key in sample_for_labels(sorted(by_id), sample_size, seed=seed):
        pair = by_id[key]
        side = "a" if _SIDES.random() < 0.5 else "b"
        first, second = pair.candidate_answer, pair.live_answer
        shown = (first, second) if side == "a" else (second, first)
        try:
            with transaction.atomic():
                JudgeItem.objects.create(
                    gate_run=gate_run,
                    judge=judge,
                    judge_prompt=judge_prompt,
                    candidate=candidate,
                    live=live,
                    eval_set=eval_set,
                    item_id=key,
                    question=[dict(m) for m in pair.messages],
                    answer_a=shown[0],
                    answer_b=shown[1],
                    candidate_side=side,
                    judge_verdict=pair.verdict,
                )
        except IntegrityError:
            continue  # kept by an earlier delivery of the same gate run
        kept += 1
    return kept


def next_item(judge: str | None = None) -> JudgeItem | None:
    """Return the oldest item nobody has labelled (of ``judge``, if given)."""
    items = JudgeItem.objects.filter(label=JudgeLabel.NONE)
    if judge:
        items = items.filter(judge=judge)
    return items.order_by("id").first()


def label_item(*, item_id: int, label: str, reviewer: str, now: datetime) -> bool:
    """Record ``reviewer``'s label of an item; False if it was labelled already.

    Raises:
        ValueError: ``label`` is not ``a``, ``b`` or ``tie``.
    """
    if label not in {JudgeLabel.A, JudgeLabel.B, JudgeLabel.TIE}:
        raise ValueError("a label is a, b or tie")
    n = JudgeItem.objects.filter(pk=item_id, label=JudgeLabel.NONE).update(
        label=label, labelled_by=reviewer, labelled_at=now
    )
    return n == 1


def human_verdict(label: str, candidate_side: str) -> str:
    """Map a label of the shown pair (a, b, tie) to the pair's own terms."""
    if label == JudgeLabel.TIE:
        return "tie"
    return "candidate" if label == candidate_side else "live"


def _pairs(items: Iterable[tuple[str, str, str]]) -> list[tuple[str, str]]:
    return [(verdict, human_verdict(label, side)) for verdict, label, side in items]


def agreement_for(
    judge: str, *, min_kappa: float, min_labels: int, confidence: float = 0.95
) -> Agreement:
    """Return ``judge``'s agreement with every human label of its verdicts."""
    rows = (
        JudgeItem.objects.filter(judge=judge)
        .exclude(label=JudgeLabel.NONE)
        .values_list("judge_verdict", "label", "candidate_side")
    )
    return judge_agreement(
        judge,
        _pairs(rows),
        min_kappa=min_kappa,
        min_labels=min_labels,
        confidence=confidence,
    )


def agreements(config: GateConfig | None = None) -> list[Agreement]:
    """Return every judge's agreement with people, held to ``config``'s floor."""
    config = config or GateConfig()
    judges = JudgeItem.objects.values_list("judge", flat=True).distinct()
    return [
        agreement_for(j, min_kappa=config.min_kappa, min_labels=config.min_labels)
        for j in sorted(set(judges))
    ]


def label_progress() -> tuple[int, int]:
    """Return (items labelled, items in all)."""
    total = JudgeItem.objects.count()
    return total - JudgeItem.objects.filter(label=JudgeLabel.NONE).count(), total


def trust_from_agreement(agreement: Agreement) -> JudgeTrust | None:
    """Return the eval gate's trust in the judge from human labels, if they decide.

    None when too few people have labelled: the eval set's labelled pairs check
    the judge instead.
    """
    est = agreement.estimate
    if not agreement.decides or est is None:
        return None
    return JudgeTrust(
        labelled=est.n,
        kappa=est.kappa,
        min_kappa=agreement.min_kappa,
        min_labels=agreement.min_labels,
        agreed=est.agreed,
    )


def model_agreement(model: Model) -> dict[str, Any] | None:
    """Return the agreement of ``model``'s eval judge with people, held to the
    model's floor (as the gates endpoint shows it); None without a judge."""
    config, problems = parse_gate_config(model.gate_config)
    judge = judge_version(config.judge_model) if not problems else None
    if judge is None or model.kind != ModelKind.CHAT:
        return None
    return agreement_for(
        judge, min_kappa=config.min_kappa, min_labels=config.min_labels
    ).as_dict()

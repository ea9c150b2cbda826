"""The judge's agreement with people: Cohen's kappa, its interval, and the floor.

Public surface: ``HUMAN_LABELS``, ``KappaEstimate``, ``estimate_kappa``,
``Agreement``, ``judge_agreement``, ``JudgedPair``, ``sample_for_labels``.

Pure: no Django, no I/O. Reviewers grade judge items in the console
(``models_registry.judge_labels``); each graded item gives a pair (the judge's
verdict, the person's label), both one of ``candidate``, ``live`` or ``tie``.

**The interval** is the standard large-sample one (Cohen 1960): with observed
agreement ``p_o``, chance agreement ``p_e`` and ``n`` items, the standard error
of kappa is ``sqrt(p_o (1 - p_o) / (n (1 - p_e)^2))`` and the interval is kappa
plus or minus ``z`` standard errors (``z`` = 1.96 at 95%), clipped to [-1, 1].
It is an approximation that is poor for a few dozen labels; the floor is
therefore held to the point estimate (as the script-label path does), and the
interval is shown so that a reader sees how little 20 labels prove.

**The floor.** A judge *decides* from human labels once it has at least
``min_labels`` of them; then it may gate only if its kappa is at least
``min_kappa``. With fewer, the human labels say nothing yet and the eval set's
own labelled pairs (if any) check the judge instead.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from models_registry.domain.eval_gate import cohen_kappa

__all__ = [
    "HUMAN_LABELS",
    "Agreement",
    "JudgedPair",
    "KappaEstimate",
    "estimate_kappa",
    "judge_agreement",
    "sample_for_labels",
]

# What a reviewer can say of a pair, in the pair's own terms (candidate, live).
HUMAN_LABELS = ("candidate", "live", "tie")


@dataclass(frozen=True, slots=True)
class JudgedPair:
    """One comparison the judge made: the question, both answers, its verdict."""

    item_id: str
    messages: Sequence[Mapping[str, str]]
    candidate_answer: str
    live_answer: str
    verdict: str  # candidate | live | tie


@dataclass(frozen=True, slots=True)
class KappaEstimate:
    """Cohen's kappa of two raters over ``n`` items, with its interval."""

    n: int
    agreed: int
    kappa: float
    low: float
    high: float
    confidence: float


def estimate_kappa(
    first: Sequence[str], second: Sequence[str], *, confidence: float = 0.95
) -> KappaEstimate:
    """Return kappa of two raters' labels and its large-sample interval.

    Raises:
        ValueError: the lists differ in length or are empty, or ``confidence``
            is not in (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError("confidence is in (0, 1)")
    kappa = cohen_kappa(first, second)  # checks the lengths
    n = len(first)
    agreed = sum(a == b for a, b in zip(first, second, strict=True))
    observed = agreed / n
    labels = set(first) | set(second)
    expected = sum((first.count(x) / n) * (second.count(x) / n) for x in labels)
    if math.isclose(expected, 1.0):
        # One label throughout from both: kappa is 1 by convention, and n such
        # items say nothing about disagreement, so the interval is the widest.
        return KappaEstimate(n, agreed, kappa, -1.0, 1.0, confidence)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    se = math.sqrt(observed * (1 - observed) / (n * (1 - expected) ** 2))
    low = max(-1.0, kappa - z * se)
    high = min(1.0, kappa + z * se)
    return KappaEstimate(n, agreed, kappa, low, high, confidence)


@dataclass(frozen=True, slots=True)
class Agreement:
    """One judge's agreement with people, and whether it may gate."""

    judge: str  # model@version, as the gate asked it
    labels: int
    estimate: KappaEstimate | None
    min_kappa: float
    min_labels: int

    @property
    def kappa(self) -> float | None:
        return self.estimate.kappa if self.estimate is not None else None

    @property
    def decides(self) -> bool:
        """Whether there are enough human labels to judge the judge by them."""
        return self.estimate is not None and self.labels >= self.min_labels

    @property
    def can_gate(self) -> bool:
        """False only when enough people say the judge is below its floor."""
        if not self.decides or self.estimate is None:
            return True
        return self.estimate.kappa >= self.min_kappa

    @property
    def reason(self) -> str:
        est = self.estimate
        if est is None:
            return f"the judge {self.judge} has no human labels yet"
        figures = (
            f"Cohen's kappa {est.kappa:.2f} ({est.confidence:.0%} CI "
            f"{est.low:.2f} to {est.high:.2f}) over {est.n} human labels"
        )
        if not self.decides:
            return (
                f"the judge {self.judge}: {figures}; at least {self.min_labels} "
                "are needed before they decide"
            )
        if not self.can_gate:
            return (
                f"the judge {self.judge} cannot gate: {figures}, below its floor "
                f"{self.min_kappa:.2f}"
            )
        return f"the judge {self.judge} agrees with people: {figures}"

    def as_dict(self) -> dict[str, Any]:
        est = self.estimate
        return {
            "judge": self.judge,
            "labels": self.labels,
            "agreed": est.agreed if est is not None else 0,
            "kappa": est.kappa if est is not None else None,
            "interval": [est.low, est.high] if est is not None else None,
            "confidence": est.confidence if est is not None else None,
            "method": "Cohen (1960) large-sample standard error",
            "min_kappa": self.min_kappa,
            "min_labels": self.min_labels,
            "decides": self.decides,
            "can_gate": self.can_gate,
            "reason": self.reason,
        }


def judge_agreement(
    judge: str,
    pairs: Iterable[tuple[str, str]],
    *,
    min_kappa: float,
    min_labels: int,
    confidence: float = 0.95,
) -> Agreement:
    """Return ``judge``'s agreement over ``(judge verdict, human label)`` pairs.

    Both are ``HUMAN_LABELS``.
    """
    judged: list[str] = []
    human: list[str] = []
    for verdict, label in pairs:
        if verdict not in HUMAN_LABELS or label not in HUMAN_LABELS:
            raise ValueError(f"verdicts and labels are one of {HUMAN_LABELS}")
        judged.append(verdict)
        human.append(label)
    estimate = estimate_kappa(judged, human, confidence=confidence) if judged else None
    return Agreement(judge, len(judged), estimate, min_kappa, min_labels)


def sample_for_labels(keys: Sequence[str], size: int, *, seed: str) -> list[str]:
    """Return up to ``size`` of ``keys`` to put before reviewers, stable per seed.

    Each key is ranked by a hash of the seed and itself, so a rerun of the same
    gate samples the same items and two gate runs sample independently.
    """
    if size <= 0:
        return []

    def rank(key: str) -> bytes:
        return hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()

    return sorted(keys, key=rank)[:size]

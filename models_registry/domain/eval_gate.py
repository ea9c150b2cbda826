"""The eval gate's arithmetic: eval sets, task metrics, judge trust and the verdict.

Public surface: ``CATEGORIES``, ``DEFAULT_CATEGORY``, ``PAIR_LABELS``, ``JUDGE_VERDICTS``, ``EvalItem``,
``EvalSetError``, ``parse_eval_set``, ``normalise_answer``, ``numeric_answer``, ``score_answer``, ``judge_score``,
``cohen_kappa``, ``JudgeTrust``, ``judge_trust``, ``CategoryResult``,
``compare_category``, ``GateVerdict``, ``eval_verdict``, ``floor_verdict``.

Pure: no Django, no I/O. The gate's tasks (issue 15) read the JSONL, send each
prompt through the gateway to the candidate and the live version, ask the judge,
and hand the answers here (``control.eval_run``).

**Eval sets** are JSONL, one item per line: ``{"id", "messages", "reference",
"category"}``; ``category`` is one of ``CATEGORIES`` (``general``, scored by
exact match, when left out). The precision gate scores each category apart.
Some items also carry a labelled pair, to check the judge against people:

- ``"labelled_pair": {"a": "<an answer>", "b": "<another answer>"}``: two fixed
  answers to the item's question (written or collected once, never regenerated);
- ``"human_label": "a" | "b" | "tie"`` (``PAIR_LABELS``): which of the two a
  person judged better, ``"tie"`` when both are as good (or as bad).

The two come together or not at all. A preference only means something for the
pair that was shown, so the judge is run on the same fixed pair to measure its
agreement, never on whatever the candidate and live versions answered that day.
Identical answers can only tie. A malformed line is an ``EvalSetError`` naming
the file and the line.

**Task metrics**, one score in [0, 1] per answer (``score_answer``):

- ``general`` and ``reasoning``: normalised exact match (lower case, punctuation
  and articles dropped, whitespace collapsed, as SQuAD's evaluation normalises,
  but a number keeps its minus sign);
- ``maths``: the last number in the answer equals the reference's (``1,000`` and
  ``1000.0`` are the same number);
- ``long_output``: completion times length: 0 when the answer was cut off
  (``finish_reason`` not ``stop``), else the answer's length over the reference's,
  capped at 1 (an answer half as long as the reference scores 0.5).

**The judge** compares two answers to an item's question pairwise. On the
candidate's and the live version's answers its verdict is ``candidate``, ``live``
or ``tie`` (``JUDGE_VERDICTS``; ``judge_score``: 1, 0, 0.5 for the candidate). On
a labelled pair it says ``a``, ``b`` or ``tie`` and is held to the human label:
it is trusted only when its verdicts agree with the labels beyond chance, Cohen's
kappa at least ``min_kappa`` over at least ``min_labels`` labelled pairs
(``judge_trust``). A reply that could not be read (``None``) agrees with no
label. An untrusted judge fails the gate closed, saying so.

**The verdict** (``eval_verdict``), per category and metric (the task metric, and
the judge's preference when the judge is trusted): the mean paired difference
candidate minus live, with a paired bootstrap confidence interval (``scipy.stats.
bootstrap``, ``paired=True``, BCa). A category passes only if the interval rules
out a drop larger than its threshold: the interval's low end is at least
``-threshold``. For the judge, each item scores the candidate ``w`` and live
``1 - w``, so the difference is the share of items the judge gave the candidate
less the share it gave live: on the same scale as a task metric's difference in
the share of right answers, and held to the same threshold. So a real drop
fails, and so does an eval set too small to rule one out: the gate fails closed
and the report says which. The seed: "Ship INT8 only if the team's own eval set
shows no real drop."

A model's first version has no live version to compare with: ``floor_verdict``
holds each category to a floor instead (the floor plays live's score).
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

__all__ = [
    "CATEGORIES",
    "DEFAULT_CATEGORY",
    "JUDGE_VERDICTS",
    "PAIR_LABELS",
    "CategoryResult",
    "EvalItem",
    "EvalSetError",
    "GateVerdict",
    "JudgeTrust",
    "cohen_kappa",
    "compare_category",
    "eval_verdict",
    "floor_verdict",
    "judge_score",
    "judge_trust",
    "normalise_answer",
    "numeric_answer",
    "parse_eval_set",
    "score_answer",
]

CATEGORIES = ("reasoning", "maths", "long_output", "general")
DEFAULT_CATEGORY = "general"
JUDGE_VERDICTS = ("candidate", "live", "tie")
PAIR_LABELS = ("a", "b", "tie")
_FIELDS = frozenset(
    {"id", "messages", "reference", "category", "labelled_pair", "human_label"}
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_MINUS = re.compile(r"(?<![\w.])-(?=\.?\d)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_MAX_ID = 200


class EvalSetError(ValueError):
    """A line of an eval set that is no item: says the file, the line and why."""

    def __init__(self, source: str, line: int, why: str) -> None:
        super().__init__(f"{source}, line {line}: {why}")
        self.source = source
        self.line = line
        self.why = why


@dataclass(frozen=True, slots=True)
class EvalItem:
    """One prompt of an eval set, its reference answer and its category."""

    id: str
    messages: tuple[dict[str, str], ...]
    reference: str
    category: str
    # The fixed pair a person labelled, (a, b), and which they preferred.
    labelled_pair: tuple[str, str] | None = None
    human_label: str | None = None


def _labelled_pair(data: dict[str, Any]) -> tuple[tuple[str, str] | None, str | None]:
    pair, label = data.get("labelled_pair"), data.get("human_label")
    if pair is None and label is None:
        return None, None
    if pair is None or label is None:
        raise ValueError("labelled_pair and human_label come together")
    if (
        not isinstance(pair, dict)
        or set(pair) != {"a", "b"}
        or not all(isinstance(v, str) for v in pair.values())
    ):
        raise ValueError('labelled_pair must be {"a": string, "b": string}')
    if label not in PAIR_LABELS:
        raise ValueError(f"human_label must be one of {', '.join(PAIR_LABELS)}")
    if pair["a"] == pair["b"] and label != "tie":
        raise ValueError("a labelled pair of identical answers can only tie")
    return (pair["a"], pair["b"]), label


def _item(data: Any, seen: set[str]) -> EvalItem:
    if not isinstance(data, dict):
        raise ValueError("an item is a JSON object")
    unknown = set(data) - _FIELDS
    if unknown:
        raise ValueError(f"unknown field {sorted(unknown)[0]!r}")
    item_id = data.get("id")
    if not isinstance(item_id, str) or not 0 < len(item_id) <= _MAX_ID:
        raise ValueError(f"id must be a string of 1 to {_MAX_ID} characters")
    if item_id in seen:
        raise ValueError(f"id {item_id!r} appears twice")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for message in messages:
        if (
            not isinstance(message, dict)
            or message.get("role") not in {"system", "user", "assistant"}
            or not isinstance(message.get("content"), str)
            or set(message) - {"role", "content"}
        ):
            raise ValueError(
                "each message is {role: system|user|assistant, content: string}"
            )
    if messages[-1]["role"] != "user":
        raise ValueError("the last message must be the user's")
    reference = data.get("reference")
    if not isinstance(reference, str) or not reference.strip():
        raise ValueError("reference must be a non-empty string")
    # A team's set written before categories: each item is plain instructions,
    # scored by exact match, until its author says which skill it tests.
    category = data.get("category", DEFAULT_CATEGORY)
    if category not in CATEGORIES:
        raise ValueError(f"category must be one of {', '.join(CATEGORIES)}")
    pair, label = _labelled_pair(data)
    if category == "maths" and numeric_answer(reference) is None:
        raise ValueError("a maths reference must contain a number")
    return EvalItem(
        id=item_id,
        messages=tuple(dict(m) for m in messages),
        reference=reference,
        category=category,
        labelled_pair=pair,
        human_label=label,
    )


def parse_eval_set(lines: Iterable[str], *, source: str) -> list[EvalItem]:
    """Return the items of a JSONL eval set; blank lines are skipped.

    Raises ``EvalSetError`` on the first line that is not an item, and on a set
    with no item at all (line 0).
    """
    items: list[EvalItem] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalSetError(source, number, f"not JSON ({exc.msg})") from None
        try:
            item = _item(data, seen)
        except ValueError as exc:
            raise EvalSetError(source, number, str(exc)) from None
        seen.add(item.id)
        items.append(item)
    if not items:
        raise EvalSetError(source, 0, "the eval set has no item")
    return items


def normalise_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's rule).

    Unlike SQuAD, a minus sign before a number is kept (as the word ``minus``):
    punctuation it may be, but ``-4`` is not the answer ``4``.
    """
    text = _MINUS.sub(" minus ", text.lower()).translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def numeric_answer(text: str) -> float | None:
    """Return the last number written in ``text`` (``1,000.5`` -> 1000.5), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def score_answer(
    item: EvalItem, answer: str, *, finish_reason: str | None = "stop"
) -> float:
    """Return the task metric of ``answer`` to ``item``, in [0, 1] (module docstring)."""
    if item.category == "maths":
        got, want = numeric_answer(answer), numeric_answer(item.reference)
        if got is None or want is None:
            return 0.0
        return float(math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9))
    if item.category == "long_output":
        if finish_reason != "stop":
            return 0.0
        return min(1.0, len(answer.split()) / max(1, len(item.reference.split())))
    return float(normalise_answer(answer) == normalise_answer(item.reference))


def judge_score(verdict: str) -> float:
    """The candidate's score in one pairwise judgement: 1 won, 0.5 tie, 0 lost."""
    if verdict not in JUDGE_VERDICTS:
        raise ValueError(f"a judge verdict is one of {', '.join(JUDGE_VERDICTS)}")
    return {"candidate": 1.0, "tie": 0.5, "live": 0.0}[verdict]


def cohen_kappa(first: Sequence[str], second: Sequence[str]) -> float:
    """Return Cohen's kappa of two raters' labels of the same items.

    1 is full agreement, 0 is what chance gives, below 0 worse than chance. Two
    raters who both gave one and the same label throughout agree fully (1.0).
    """
    if len(first) != len(second) or not first:
        raise ValueError("kappa needs two equally long, non-empty label lists")
    n = len(first)
    observed = sum(a == b for a, b in zip(first, second, strict=True)) / n
    labels = set(first) | set(second)
    expected = sum((first.count(x) / n) * (second.count(x) / n) for x in labels)
    if math.isclose(expected, 1.0):
        return 1.0
    return (observed - expected) / (1.0 - expected)


@dataclass(frozen=True, slots=True)
class JudgeTrust:
    """Whether the judge's verdicts on labelled pairs agree enough with people's."""

    labelled: int
    kappa: float | None
    min_kappa: float
    min_labels: int
    agreed: int = 0  # pairs where the judge said what the person said
    unparsed: int = 0  # replies that could not be read (they agree with nothing)

    @property
    def trusted(self) -> bool:
        return (
            self.labelled >= self.min_labels
            and self.kappa is not None
            and self.kappa >= self.min_kappa
        )

    @property
    def reason(self) -> str:
        if self.labelled < self.min_labels:
            return (
                f"the judge is not trusted: {self.labelled} human labels, "
                f"at least {self.min_labels} are needed to check it"
            )
        unread = f", {self.unparsed} replies unreadable" if self.unparsed else ""
        if not self.trusted:
            return (
                f"the judge is not trusted: Cohen's kappa {self.kappa:.2f} against "
                f"{self.labelled} human labels, below {self.min_kappa:.2f} "
                f"(it agreed on {self.agreed}{unread})"
            )
        return (
            f"the judge agrees with people: kappa {self.kappa:.2f} over "
            f"{self.labelled} human labels{unread}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "labelled": self.labelled,
            "agreed": self.agreed,
            "unparsed": self.unparsed,
            "kappa": self.kappa,
            "min_kappa": self.min_kappa,
            "min_labels": self.min_labels,
            "trusted": self.trusted,
            "reason": self.reason,
        }


def judge_trust(
    pairs: Iterable[tuple[str | None, str]],
    *,
    min_kappa: float = 0.6,
    min_labels: int = 20,
) -> JudgeTrust:
    """Judge the judge on ``(judge verdict, human label)`` of labelled pairs.

    Both are ``PAIR_LABELS``; a verdict of None (a reply that could not be read)
    is a disagreement. 0.6 is where Landis and Koch's scale starts "substantial"
    agreement.
    """
    judged: list[str] = []
    human: list[str] = []
    unparsed = 0
    for verdict, label in pairs:
        if label not in PAIR_LABELS:
            raise ValueError(f"a human label is one of {', '.join(PAIR_LABELS)}")
        if verdict is None:
            unparsed += 1
            verdict = "unreadable"  # a category of its own: never agrees
        elif verdict not in PAIR_LABELS:
            raise ValueError(
                f"a judge verdict on a labelled pair is one of {', '.join(PAIR_LABELS)}"
            )
        judged.append(verdict)
        human.append(label)
    kappa = cohen_kappa(judged, human) if judged else None
    agreed = sum(j == h for j, h in zip(judged, human, strict=True))
    return JudgeTrust(len(judged), kappa, min_kappa, min_labels, agreed, unparsed)


@dataclass(frozen=True, slots=True)
class CategoryResult:
    """One category and metric: candidate against live, and whether it passes."""

    category: str
    metric: str  # task | judge | floor
    items: int
    candidate_mean: float
    live_mean: float
    difference: float  # candidate minus live
    low: float
    high: float
    threshold: float
    confidence: float = 0.95

    @property
    def passed(self) -> bool:
        return self.low >= -self.threshold - 1e-12

    @property
    def reason(self) -> str:
        """One sentence a person reads: what changed, how sure, against what."""
        name = f"{self.category} ({self.metric})"
        ci = f"{self.confidence:.0%} CI {self.low:+.3f} to {self.high:+.3f}"
        if self.passed:
            return (
                f"{name}: no drop over its {self.threshold:.3f} threshold "
                f"(difference {self.difference:+.3f}, {ci}, {self.items} items)"
            )
        if self.high < -self.threshold:
            return (
                f"{name}: a real drop of {-self.difference:.3f} ({ci}, "
                f"{self.items} items), more than its {self.threshold:.3f} threshold"
            )
        if self.difference < -self.threshold:
            return (
                f"{name}: a likely drop of {-self.difference:.3f}, which "
                f"{self.items} items cannot confirm ({ci}), over its "
                f"{self.threshold:.3f} threshold"
            )
        return (
            f"{name}: {self.items} items cannot rule out a drop over its "
            f"{self.threshold:.3f} threshold (difference {self.difference:+.3f}, {ci})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "metric": self.metric,
            "items": self.items,
            "candidate_mean": self.candidate_mean,
            "live_mean": self.live_mean,
            "difference": self.difference,
            "interval": [self.low, self.high],
            "threshold": self.threshold,
            "confidence": self.confidence,
            "passed": self.passed,
            "reason": self.reason,
        }


def compare_category(
    category: str,
    candidate: Sequence[float],
    live: Sequence[float],
    *,
    threshold: float,
    metric: str = "task",
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> CategoryResult:
    """Compare paired scores (item i of both is the same prompt) of one category."""
    if len(candidate) != len(live) or not candidate:
        raise ValueError("paired scores: equally long, non-empty lists")
    if not 0 <= threshold < 1:
        raise ValueError("a threshold is a drop in [0, 1)")
    a = np.asarray(candidate, dtype=float)
    b = np.asarray(live, dtype=float)
    difference = float(np.mean(a - b))
    if len(a) < 2:
        low, high = -1.0, 1.0  # one item proves nothing either way
    elif np.ptp(a - b) == 0:
        low = high = difference  # every pair differs alike: nothing to resample
    else:
        result = stats.bootstrap(
            (a, b),
            lambda x, y, axis: np.mean(x - y, axis=axis),
            paired=True,
            vectorized=True,
            confidence_level=confidence,
            n_resamples=resamples,
            method="BCa",
            rng=np.random.default_rng(seed),
        )
        low = float(result.confidence_interval.low)
        high = float(result.confidence_interval.high)
        if math.isnan(low) or math.isnan(high):  # BCa degenerates on few values
            low, high = float(np.min(a - b)), float(np.max(a - b))
    return CategoryResult(
        category=category,
        metric=metric,
        items=len(a),
        candidate_mean=float(np.mean(a)),
        live_mean=float(np.mean(b)),
        difference=difference,
        low=low,
        high=high,
        threshold=threshold,
        confidence=confidence,
    )


@dataclass(frozen=True, slots=True)
class GateVerdict:
    """The eval gate's outcome: passed, and every reason, as the report shows."""

    passed: bool
    reasons: tuple[str, ...]
    results: tuple[CategoryResult, ...]
    judge: JudgeTrust | None
    thresholds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "reasons": list(self.reasons),
            "categories": [r.as_dict() for r in self.results],
            "judge": self.judge.as_dict() if self.judge is not None else None,
            "thresholds": dict(self.thresholds),
        }


def eval_verdict(
    items: Sequence[EvalItem],
    candidate_scores: Mapping[str, float],
    live_scores: Mapping[str, float],
    *,
    thresholds: Mapping[str, float],
    judge_verdicts: Mapping[str, str] | None = None,
    judge: JudgeTrust | None = None,
    confidence: float = 0.95,
    seed: int = 0,
) -> GateVerdict:
    """Return the gate's verdict over ``items`` (scores and verdicts keyed by item id).

    ``thresholds`` gives each category's largest tolerated drop (a category
    without one is refused: the model's documentation must say it). With
    ``judge_verdicts`` the judge's preference is a second metric per category,
    used only when ``judge`` says it is trusted; an untrusted judge fails the gate.
    """
    reasons: list[str] = []
    results: list[CategoryResult] = []
    missing = [
        i.id for i in items if i.id not in candidate_scores or i.id not in live_scores
    ]
    if missing:
        raise ValueError(f"no score for item {missing[0]!r}")
    # The judge's verdicts count only when it was checked and is trusted.
    judged_by: Mapping[str, str] = {}
    if judge_verdicts is not None:
        if judge is not None and judge.trusted:
            judged_by = judge_verdicts
        else:
            reasons.append(
                judge.reason if judge is not None else "the judge was not checked"
            )
    for category in CATEGORIES:
        in_category = [i for i in items if i.category == category]
        if not in_category:
            continue
        if category not in thresholds:
            raise ValueError(f"no threshold for category {category!r}")
        threshold = thresholds[category]
        results.append(
            compare_category(
                category,
                [candidate_scores[i.id] for i in in_category],
                [live_scores[i.id] for i in in_category],
                threshold=threshold,
                confidence=confidence,
                seed=seed,
            )
        )
        judged = [i for i in in_category if i.id in judged_by]
        if judged:
            wins = [judge_score(judged_by[i.id]) for i in judged]
            results.append(
                compare_category(
                    category,
                    wins,
                    [1.0 - w for w in wins],
                    threshold=threshold,
                    metric="judge",
                    confidence=confidence,
                    seed=seed,
                )
            )
    reasons.extend(r.reason for r in results if not r.passed)
    passed = not reasons
    if passed:
        reasons = [r.reason for r in results]
    return GateVerdict(
        passed=passed,
        reasons=tuple(reasons),
        results=tuple(results),
        judge=judge,
        thresholds=dict(thresholds),
    )


def floor_verdict(
    items: Sequence[EvalItem],
    candidate_scores: Mapping[str, float],
    *,
    floors: Mapping[str, float],
    thresholds: Mapping[str, float],
    confidence: float = 0.95,
    seed: int = 0,
) -> GateVerdict:
    """Return the verdict on a model's first version, which has no live one to beat.

    Each category's scores are held to its floor instead: the floor stands in for
    the live version's score on every item (metric ``floor``), with the same
    interval and threshold, so a first version passes only if the interval rules
    out falling more than the threshold below the floor.
    """
    missing = [i.id for i in items if i.id not in candidate_scores]
    if missing:
        raise ValueError(f"no score for item {missing[0]!r}")
    results: list[CategoryResult] = []
    for category in CATEGORIES:
        in_category = [i for i in items if i.category == category]
        if not in_category:
            continue
        if category not in thresholds or category not in floors:
            raise ValueError(f"no threshold or floor for category {category!r}")
        results.append(
            compare_category(
                category,
                [candidate_scores[i.id] for i in in_category],
                [floors[category]] * len(in_category),
                threshold=thresholds[category],
                metric="floor",
                confidence=confidence,
                seed=seed,
            )
        )
    failed = [r.reason for r in results if not r.passed]
    return GateVerdict(
        passed=not failed,
        reasons=tuple(failed or [r.reason for r in results]),
        results=tuple(results),
        judge=None,
        thresholds=dict(thresholds),
    )

"""The precision gate: a candidate that changes precision, set beside the others.

Public surface: ``PRECISION_ORDER``, ``PrecisionColumn``, ``PrecisionRow``,
``PrecisionReport``, ``is_precision_change``, ``category_means``,
``precision_report``.

Pure: no Django, no I/O. The seed: "Ship INT8 only if the team's own eval set
shows no real drop"; "compare FP16, INT8 and 4-bit ... with separate scores for
reasoning, maths and long outputs". When a candidate's precision differs from
the live version's, the eval gate (``control.gates``) also asks one version of
each other precision registered for the model, and this module puts every
precision's score per category side by side (a ``PrecisionColumn`` each).

**The verdict** is the eval gate's own, per category, candidate against live
(``eval_gate.compare_category``): the mean paired difference of the task metric
with a 95% paired bootstrap (BCa) interval, and a category passes only if the
interval's low end is at least ``-margin``, the category's threshold in the
model's gate settings. That is a one-sided non-inferiority test at 2.5%: a
drop beyond the margin fails, and so does a set too small to rule one out. The
other precisions' columns are for comparison; only their point drops are shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from models_registry.domain.eval_gate import CATEGORIES, CategoryResult, EvalItem

__all__ = [
    "PRECISION_ORDER",
    "PrecisionColumn",
    "PrecisionReport",
    "PrecisionRow",
    "category_means",
    "is_precision_change",
    "precision_report",
]

# The order the report shows precisions in: the full one first.
PRECISION_ORDER = ("fp16", "int8", "4bit")
STATISTIC = (
    "paired bootstrap (BCa) of the mean difference candidate minus live, 95% "
    "interval; a category passes when the low end is at least -margin "
    "(one-sided non-inferiority at 2.5%)"
)


def is_precision_change(candidate: str, live: str | None) -> bool:
    """Return True when a candidate's precision differs from the live version's."""
    return live is not None and candidate != live


def category_means(
    items: Sequence[EvalItem], scores: Mapping[str, float]
) -> dict[str, float]:
    """Return the mean task score per category over the items that were scored."""
    means: dict[str, float] = {}
    for category in CATEGORIES:
        values = [
            scores[i.id] for i in items if i.category == category and i.id in scores
        ]
        if values:
            means[category] = sum(values) / len(values)
    return means


@dataclass(frozen=True, slots=True)
class PrecisionColumn:
    """One precision's scores: the version that gave them and its role.

    ``role`` is ``candidate``, ``live`` or ``other``; ``means`` is empty when it
    was not measured, and ``note`` then says why.
    """

    precision: str
    version: str | None
    role: str
    means: Mapping[str, float]
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "version": self.version,
            "role": self.role,
            "means": dict(self.means),
            "note": self.note,
        }


@dataclass(frozen=True, slots=True)
class PrecisionRow:
    """One category: each precision's score, the drops from live, the verdict."""

    category: str
    scores: Mapping[str, float | None]  # precision -> mean task score
    drops: Mapping[str, float | None]  # precision -> live's score minus its own
    result: CategoryResult  # the candidate against live

    @property
    def passed(self) -> bool:
        return self.result.passed

    def as_dict(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "scores": dict(self.scores),
            "drops": dict(self.drops),
            "candidate_drop": -self.result.difference,
            "interval": [self.result.low, self.result.high],
            "margin": self.result.threshold,
            "passed": self.passed,
            "reason": self.result.reason,
        }


@dataclass(frozen=True, slots=True)
class PrecisionReport:
    """The precisions side by side, and whether the candidate's may ship."""

    candidate: str  # its precision
    live: str
    columns: tuple[PrecisionColumn, ...]
    rows: tuple[PrecisionRow, ...]

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def reason(self) -> str:
        """One sentence: which categories dropped beyond their margins, if any."""
        change = f"precision {self.candidate} against live {self.live}"
        if not self.rows:
            return f"{change}: no category was scored"
        failed = [r for r in self.rows if not r.passed]
        if not failed:
            return f"{change}: no category drops beyond its margin"
        drops = ", ".join(
            f"{r.category} drops {-r.result.difference:.3f} "
            f"(margin {r.result.threshold:.3f})"
            for r in failed
        )
        return f"{change}: {drops}, not ruled out beyond the margin"

    def as_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "live": self.live,
            "precisions": [c.precision for c in self.columns],
            "columns": [c.as_dict() for c in self.columns],
            "categories": [r.as_dict() for r in self.rows],
            "statistic": STATISTIC,
            "passed": self.passed,
            "reason": self.reason,
        }


def _order(precision: str) -> tuple[int, str]:
    if precision in PRECISION_ORDER:
        return PRECISION_ORDER.index(precision), precision
    return len(PRECISION_ORDER), precision


def precision_report(
    columns: Sequence[PrecisionColumn], results: Sequence[CategoryResult]
) -> PrecisionReport:
    """Return the side-by-side report of ``columns`` (one per precision).

    ``results`` are the eval verdict's results; the task metric's (``task``) give
    each category's verdict. Exactly one column is the candidate and one live.
    """
    by_role = {c.role: c for c in columns if c.role in {"candidate", "live"}}
    if set(by_role) != {"candidate", "live"}:
        raise ValueError("a precision report needs a candidate and a live column")
    if len({c.precision for c in columns}) != len(columns):
        raise ValueError("one column per precision")
    ordered = tuple(sorted(columns, key=lambda c: _order(c.precision)))
    live = by_role["live"]
    rows = []
    for result in results:
        if result.metric != "task":
            continue
        category = result.category
        scores = {c.precision: c.means.get(category) for c in ordered}
        base = live.means.get(category)
        drops = {
            precision: None if base is None or score is None else base - score
            for precision, score in scores.items()
        }
        rows.append(PrecisionRow(category, scores, drops, result))
    return PrecisionReport(
        candidate=by_role["candidate"].precision,
        live=live.precision,
        columns=ordered,
        rows=tuple(rows),
    )

"""The precision gate against real simulated replicas: FP16 live, INT8 and 4-bit.

GIVEN chat-7b's live version in FP16 and a 4-bit version, each a simulated
replica of quality 0.9, WHEN an INT8 candidate whose maths alone is worse (its
replica's ``quality_by_category``) is evaluated, THEN it is rejected naming
maths, with the three precisions side by side; WHEN the INT8 candidate is as good
as live, THEN it passes with the same three-way report.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from control.eval_report import render_html
from control.eval_run import EvalReport, PrecisionSides
from control.tests.test_eval_run import (
    CATEGORIES,
    EVAL_SET,
    THRESHOLDS,
    Replica,
    run,
    sim_replica,
)
from models_registry.domain.eval_gate import EvalItem, parse_eval_set

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUALITY = 0.9
PER_CATEGORY = 40


@pytest.fixture(scope="module")
def items() -> list[EvalItem]:
    """The shipped set's first 40 items of each category (a drop of 0.5 in maths
    shows in 40; identical answers tie at any size)."""
    every = parse_eval_set(EVAL_SET.read_text().splitlines(), source=str(EVAL_SET))
    return [
        item
        for category in CATEGORIES
        for item in [i for i in every if i.category == category][:PER_CATEGORY]
    ]


@pytest.fixture(scope="module")
def precisions(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Replica]]:
    tmp = tmp_path_factory.mktemp("precision-sims")
    quality = ("--sim-quality", str(QUALITY))
    with (
        sim_replica(tmp, "chat-7b@v1", *quality) as fp16,
        sim_replica(tmp, "chat-7b@v2", *quality) as int8,
        sim_replica(tmp, "chat-7b@v3", *quality) as bit4,
    ):
        yield {"fp16": fp16, "int8": int8, "4bit": bit4}


def evaluate(
    items: list[EvalItem], replicas: dict[str, Replica], *, int8_maths: float
) -> EvalReport:
    """Evaluate the INT8 candidate against FP16 live, with 4-bit beside them."""
    replicas["int8"].set(quality=QUALITY, quality_by_category={"maths": int8_maths})
    batch = {"x-priority": "batch"}
    sides = PrecisionSides(
        candidate="int8", live="fp16", others={"4bit": replicas["4bit"].target(**batch)}
    )
    report = run(
        items,
        candidate=replicas["int8"].target(**batch),
        live=replicas["fp16"].target(**batch),
        judge=None,
        thresholds=THRESHOLDS,
        min_kappa=0.6,
        min_labels=30,
        concurrency=16,
        precision=sides,
    )
    return report


def test_an_int8_candidate_whose_maths_drops_is_rejected_with_three_precisions(
    items: list[EvalItem], precisions: dict[str, Replica]
) -> None:
    report = evaluate(items, precisions, int8_maths=0.4)

    assert not report.passed
    table = report.precision
    assert table is not None and not table.passed
    assert [c.precision for c in table.columns] == ["fp16", "int8", "4bit"]
    assert [c.role for c in table.columns] == ["live", "candidate", "other"]
    assert table.columns[2].version == "chat-7b@v3"
    rows = {r.category: r for r in table.rows}
    assert {c for c, r in rows.items() if not r.passed} == {"maths"}
    maths = rows["maths"]
    assert maths.drops["int8"] is not None and maths.drops["int8"] > 0.3
    assert maths.drops["fp16"] == 0
    assert maths.drops["4bit"] == 0  # same seed and quality as live: same answers
    assert report.reasons[0].startswith("precision int8 against live fp16: maths drops")
    shown = report.as_dict()["precision"]
    assert shown["precisions"] == ["fp16", "int8", "4bit"]
    assert "bootstrap" in shown["statistic"]
    page = render_html(report.as_dict())
    assert "Precisions side by side" in page and "4bit" in page


def test_an_int8_candidate_without_a_drop_passes_with_three_precisions(
    items: list[EvalItem], precisions: dict[str, Replica]
) -> None:
    report = evaluate(items, precisions, int8_maths=QUALITY)

    assert report.passed, report.reasons
    table = report.precision
    assert table is not None and table.passed
    assert {r.category for r in table.rows} == set(THRESHOLDS)
    for row in table.rows:
        assert set(row.scores) == {"fp16", "int8", "4bit"}
        assert row.drops["int8"] == 0 and row.scores["fp16"] is not None
    assert report.reasons[0] == (
        "precision int8 against live fp16: no category drops beyond its margin"
    )

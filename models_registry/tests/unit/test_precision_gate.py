"""The precision gate's report: columns per precision, rows per category."""

from __future__ import annotations

import pytest

from models_registry.domain.eval_gate import EvalItem, compare_category
from models_registry.domain.precision_gate import (
    PrecisionColumn,
    category_means,
    is_precision_change,
    precision_report,
)


def item(key: str, category: str) -> EvalItem:
    return EvalItem(key, ({"role": "user", "content": "q"},), "1", category)


def test_is_precision_change_needs_a_live_version_of_another_precision() -> None:
    assert is_precision_change("int8", "fp16")
    assert not is_precision_change("fp16", "fp16")
    assert not is_precision_change("int8", None)


def test_category_means_counts_only_scored_items() -> None:
    items = [item("a", "maths"), item("b", "maths"), item("c", "reasoning")]
    assert category_means(items, {"a": 1.0, "b": 0.0}) == {"maths": 0.5}


def test_precision_report_puts_precisions_in_order_with_drops_and_verdict() -> None:
    maths = compare_category(
        "maths", [0.0] * 20 + [1.0] * 20, [1.0] * 40, threshold=0.05
    )
    reasoning = compare_category("reasoning", [1.0] * 40, [1.0] * 40, threshold=0.05)
    columns = [
        PrecisionColumn("int8", "m@v2", "candidate", {"maths": 0.5, "reasoning": 1.0}),
        PrecisionColumn("4bit", None, "other", {}, "no ready version"),
        PrecisionColumn("fp16", "m@v1", "live", {"maths": 1.0, "reasoning": 1.0}),
    ]
    report = precision_report(columns, [maths, reasoning])
    assert [c.precision for c in report.columns] == ["fp16", "int8", "4bit"]
    assert not report.passed
    rows = {r.category: r for r in report.rows}
    assert rows["maths"].drops == {"fp16": 0.0, "int8": 0.5, "4bit": None}
    assert not rows["maths"].passed and rows["reasoning"].passed
    assert report.reason == (
        "precision int8 against live fp16: maths drops 0.500 (margin 0.050), "
        "not ruled out beyond the margin"
    )
    shown = report.as_dict()
    assert shown["columns"][2]["note"] == "no ready version"
    assert shown["categories"][0]["candidate_drop"] == pytest.approx(0.5)


def test_precision_report_needs_a_candidate_and_a_live_column() -> None:
    with pytest.raises(ValueError, match="candidate and a live"):
        precision_report([PrecisionColumn("int8", None, "candidate", {})], [])

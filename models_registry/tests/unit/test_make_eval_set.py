"""The default eval set's generator and the file shipped from it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from models_registry.domain.eval_gate import CATEGORIES, parse_eval_set
from models_registry.management.commands.make_eval_set import (
    DEFAULT_ITEMS,
    DEFAULT_OUTPUT,
    build_eval_set,
    eval_set_lines,
)

ROOT = Path(__file__).resolve().parents[3]


def test_the_shipped_eval_set_is_the_generators_output() -> None:
    shipped = (ROOT / DEFAULT_OUTPUT).read_text(encoding="utf-8")
    assert shipped == eval_set_lines(build_eval_set()), (
        "platform/evals/chat-default.jsonl is stale: run manage.py make_eval_set"
    )


def test_the_generator_is_deterministic_per_seed() -> None:
    assert build_eval_set(seed=3, items=20) == build_eval_set(seed=3, items=20)
    assert build_eval_set(seed=3, items=20) != build_eval_set(seed=4, items=20)


def test_the_default_set_covers_every_category_with_labelled_pairs() -> None:
    items = parse_eval_set(
        eval_set_lines(build_eval_set()).splitlines(), source="chat-default.jsonl"
    )
    assert Counter(i.category for i in items) == dict.fromkeys(
        CATEGORIES, DEFAULT_ITEMS
    )
    labels = Counter(i.human_label for i in items if i.labelled_pair is not None)
    assert sum(labels.values()) >= 30
    assert set(labels) == {"a", "b", "tie"}
    assert all(i.messages[-1]["role"] == "user" for i in items)
    assert any(i.messages[0]["role"] == "system" for i in items)


def test_the_labelled_pairs_are_spread_over_the_categories() -> None:
    items = build_eval_set(items=12, labelled=10)
    per = Counter(i["category"] for i in items if "labelled_pair" in i)
    assert sorted(per.values()) == [2, 2, 3, 3]

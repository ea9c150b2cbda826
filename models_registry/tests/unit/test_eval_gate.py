"""The eval gate's arithmetic: eval sets, metrics, judge trust, the verdict."""

from __future__ import annotations

import json
import random

import pytest

from models_registry.domain.eval_gate import (
    EvalItem,
    EvalSetError,
    cohen_kappa,
    compare_category,
    eval_verdict,
    floor_verdict,
    judge_trust,
    normalise_answer,
    numeric_answer,
    parse_eval_set,
    score_answer,
)

THRESHOLDS = {"reasoning": 0.05, "maths": 0.05, "long_output": 0.1, "general": 0.05}


def line(**fields: object) -> str:
    base: dict[str, object] = {
        "id": "q1",
        "messages": [{"role": "user", "content": "What is 6 x 7?"}],
        "reference": "42",
        "category": "maths",
    }
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not None})


def item(category: str, reference: str, n: int = 0) -> EvalItem:
    return EvalItem(
        id=f"{category}-{n}",
        messages=({"role": "user", "content": "q"},),
        reference=reference,
        category=category,
    )


def test_an_eval_set_parses_and_skips_blank_lines() -> None:
    items = parse_eval_set(
        [
            line(),
            "",
            line(
                id="q2",
                category="general",
                reference="Paris",
                labelled_pair={"a": "Paris", "b": "Lyon"},
                human_label="a",
            ),
        ],
        source="evals/chat.jsonl",
    )
    assert [i.id for i in items] == ["q1", "q2"]
    assert items[0].labelled_pair is None and items[0].human_label is None
    assert items[1].labelled_pair == ("Paris", "Lyon")
    assert items[1].human_label == "a"
    assert items[0].messages == ({"role": "user", "content": "What is 6 x 7?"},)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "a JSON object"),
        (line(category="poetry"), "category must be one of"),
        (line(reference=""), "reference must be"),
        (line(messages=[]), "messages must be"),
        (line(messages=[{"role": "robot", "content": "x"}]), "each message"),
        (line(messages=[{"role": "assistant", "content": "x"}]), "the user's"),
        (line(labelled_pair={"a": "42", "b": "41"}, human_label="maybe"), "one of a"),
        (line(labelled_pair={"a": "42", "b": "41"}, human_label="candidate"), "one of"),
        (line(human_label="a"), "come together"),
        (line(labelled_pair={"a": "42", "b": "41"}), "come together"),
        (line(labelled_pair={"a": "42"}, human_label="a"), "labelled_pair must be"),
        (line(labelled_pair=["42", "41"], human_label="a"), "labelled_pair must be"),
        (line(labelled_pair={"a": 42, "b": "41"}, human_label="a"), "must be"),
        (line(labelled_pair={"a": "42", "b": "42"}, human_label="b"), "only tie"),
        (line(reference="forty-two"), "must contain a number"),
        (line(extra=1), "unknown field 'extra'"),
        (line(id=""), "id must be"),
    ],
)
def test_a_malformed_line_names_the_file_and_the_line(text: str, why: str) -> None:
    with pytest.raises(EvalSetError) as raised:
        parse_eval_set([line(id="ok"), "", text], source="evals/chat.jsonl")
    assert raised.value.line == 3
    assert str(raised.value).startswith("evals/chat.jsonl, line 3: ")
    assert why in raised.value.why


def test_an_item_without_a_category_is_general() -> None:
    (parsed,) = parse_eval_set(
        [line(category=None, reference="Paris")], source="evals/team.jsonl"
    )
    assert parsed.category == "general"


def test_a_repeated_id_and_an_empty_set_are_refused() -> None:
    with pytest.raises(EvalSetError, match="line 2: id 'q1' appears twice"):
        parse_eval_set([line(), line()], source="s.jsonl")
    with pytest.raises(EvalSetError, match="line 0: the eval set has no item"):
        parse_eval_set(["", "  "], source="s.jsonl")


def test_answers_are_normalised_as_squad_does() -> None:
    assert normalise_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalise_answer("an Apple, a day") == "apple day"
    # A minus sign is no mere punctuation: -4 is not 4.
    assert normalise_answer("-4") == "minus 4" != normalise_answer("4")
    assert normalise_answer("x-4, well-known") == "x4 wellknown"
    assert score_answer(item("reasoning", "-3"), "3") == 0.0
    assert score_answer(item("reasoning", "-3"), "-3.") == 1.0


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The answer is 1,000.", 1000.0),
        ("first 3 then 4.5", 4.5),
        ("-12 degrees", -12.0),
        ("no number here", None),
    ],
)
def test_the_numeric_answer_is_the_last_number(text: str, number: float | None) -> None:
    assert numeric_answer(text) == number


def test_task_metrics_per_category() -> None:
    maths = item("maths", "1000")
    assert score_answer(maths, "so it is 1,000.0") == 1.0
    assert score_answer(maths, "about 999") == 0.0
    assert score_answer(maths, "I cannot say") == 0.0
    general = item("general", "Paris")
    assert score_answer(general, "paris.") == 1.0
    assert score_answer(general, "Lyon") == 0.0
    long = item("long_output", " ".join(["word"] * 100))
    assert score_answer(long, " ".join(["w"] * 50)) == 0.5
    assert score_answer(long, " ".join(["w"] * 300)) == 1.0
    assert score_answer(long, " ".join(["w"] * 300), finish_reason="length") == 0.0


def test_cohen_kappa_against_known_values() -> None:
    # Two raters, 50 items: 20 yes/yes, 15 no/no, 5 yes/no, 10 no/yes.
    first = ["y"] * 25 + ["n"] * 25
    second = ["y"] * 20 + ["n"] * 5 + ["y"] * 10 + ["n"] * 15
    # observed 0.7, expected 0.5 x 0.6 + 0.5 x 0.4 = 0.5: kappa 0.4.
    assert cohen_kappa(first, second) == pytest.approx(0.4)
    assert cohen_kappa(["a", "b"], ["a", "b"]) == 1.0
    assert cohen_kappa(["a", "a"], ["a", "a"]) == 1.0
    assert cohen_kappa(["a", "b"], ["b", "a"]) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="equally long"):
        cohen_kappa(["a"], [])


def test_a_judge_is_trusted_only_with_enough_agreeing_labels() -> None:
    agreeing: list[tuple[str | None, str]] = [("a", "a"), ("b", "b"), ("tie", "tie")]
    trusted = judge_trust(agreeing * 8)
    assert trusted.trusted
    assert (trusted.labelled, trusted.agreed, trusted.kappa) == (24, 24, 1.0)
    few = judge_trust(agreeing * 3)
    assert not few.trusted
    assert "9 human labels, at least 20" in few.reason
    coin = random.Random(3)
    noise: list[tuple[str | None, str]] = [
        (coin.choice(["a", "b"]), coin.choice(["a", "b"])) for _ in range(60)
    ]
    noisy = judge_trust(noise)
    assert not noisy.trusted
    assert "not trusted: Cohen's kappa" in noisy.reason
    with pytest.raises(ValueError, match="judge verdict"):
        judge_trust([("candidate", "a")])
    with pytest.raises(ValueError, match="human label"):
        judge_trust([("a", "live")])


def test_an_unreadable_judge_reply_agrees_with_no_label() -> None:
    pairs: list[tuple[str | None, str]] = [("a", "a"), ("b", "b")] * 10
    read = judge_trust(pairs)
    unread = judge_trust([(None, label) for _, label in pairs[:6]] + pairs[6:])
    assert read.kappa == 1.0
    assert unread.unparsed == 6 and unread.agreed == 14
    assert unread.kappa is not None and unread.kappa < read.kappa
    assert judge_trust([(None, "a")] * 25).kappa == pytest.approx(0.0)


def test_a_real_drop_fails_and_no_drop_passes() -> None:
    rng = random.Random(7)
    live = [float(rng.random() < 0.8) for _ in range(400)]
    same = compare_category("maths", live, live, threshold=0.05)
    assert same.passed
    assert (same.low, same.high) == (0.0, 0.0)
    # The candidate loses a fifth of the live version's right answers.
    worse = [v if rng.random() > 0.2 else 0.0 for v in live]
    dropped = compare_category("maths", worse, live, threshold=0.05)
    assert not dropped.passed
    assert dropped.high < -0.05
    assert "a real drop of" in dropped.reason
    assert "more than its 0.050 threshold" in dropped.reason
    assert "95% CI" in dropped.reason
    assert dropped.low <= dropped.difference <= dropped.high


def test_too_few_items_cannot_rule_out_a_drop() -> None:
    # As good on average, on too few items to tell.
    candidate = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    live = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    result = compare_category("reasoning", candidate, live, threshold=0.05)
    assert not result.passed
    assert result.low < -0.05 < 0.05 < result.high
    assert "6 items cannot rule out a drop" in result.reason
    # Worse on average, and still too few to be sure.
    worse = compare_category(
        "reasoning", [1.0, 0.0, 1.0, 1.0, 0.0, 1.0], [1.0] * 5 + [0.0], threshold=0.05
    )
    assert not worse.passed
    assert worse.low < worse.difference < -0.05 < worse.high
    assert "a likely drop of 0.167, which 6 items cannot confirm" in worse.reason
    single = compare_category("reasoning", [1.0], [1.0], threshold=0.05)
    assert not single.passed  # one item proves nothing


def test_the_verdict_judges_each_category_and_says_why() -> None:
    rng = random.Random(11)
    items = [item("maths", "7", n) for n in range(300)] + [
        item("general", "yes", n) for n in range(300)
    ]
    live = {i.id: float(rng.random() < 0.9) for i in items}
    # INT8 keeps general knowledge and loses maths.
    candidate = {
        i.id: (live[i.id] if i.category == "general" or rng.random() > 0.3 else 0.0)
        for i in items
    }
    verdict = eval_verdict(items, candidate, live, thresholds=THRESHOLDS)
    assert not verdict.passed
    assert [r.category for r in verdict.results] == ["maths", "general"]
    assert [r.passed for r in verdict.results] == [False, True]
    assert len(verdict.reasons) == 1 and verdict.reasons[0].startswith("maths (task)")
    report = verdict.as_dict()
    assert report["passed"] is False
    assert report["categories"][0]["interval"][1] < -0.05
    json.dumps(report)  # the report is JSON

    fine = eval_verdict(items, live, live, thresholds=THRESHOLDS)
    assert fine.passed
    assert len(fine.reasons) == 2


def test_an_untrusted_judge_fails_the_gate_closed() -> None:
    items = [item("general", "yes", n) for n in range(50)]
    scores = {i.id: 1.0 for i in items}
    verdicts = {i.id: "tie" for i in items}
    untrusted = judge_trust([("a", "b")] * 25)
    verdict = eval_verdict(
        items,
        scores,
        scores,
        thresholds=THRESHOLDS,
        judge_verdicts=verdicts,
        judge=untrusted,
    )
    assert not verdict.passed
    assert verdict.reasons[0].startswith("the judge is not trusted")


def test_a_trusted_judge_preferring_live_fails_the_category() -> None:
    items = [item("general", "yes", n) for n in range(200)]
    scores = {i.id: 1.0 for i in items}  # the task metric sees no difference
    verdicts = {i.id: ("live" if n % 4 else "tie") for n, i in enumerate(items)}
    trusted = judge_trust([("a", "a"), ("b", "b")] * 15)
    verdict = eval_verdict(
        items,
        scores,
        scores,
        thresholds=THRESHOLDS,
        judge_verdicts=verdicts,
        judge=trusted,
    )
    assert not verdict.passed
    assert [(r.metric, r.passed) for r in verdict.results] == [
        ("task", True),
        ("judge", False),
    ]


def test_the_verdict_refuses_missing_scores_and_thresholds() -> None:
    items = [item("maths", "1")]
    with pytest.raises(ValueError, match="no score for item 'maths-0'"):
        eval_verdict(items, {}, {}, thresholds=THRESHOLDS)
    with pytest.raises(ValueError, match="no threshold for category 'maths'"):
        eval_verdict(items, {"maths-0": 1.0}, {"maths-0": 1.0}, thresholds={})


def test_a_first_version_is_held_to_the_floors() -> None:
    items = [item("maths", "7", n) for n in range(100)] + [
        item("general", "yes", n) for n in range(100)
    ]
    # Right on 90 % of maths, 40 % of general: general is far below its 0.7 floor.
    scores = {
        i.id: float(int(i.id.rsplit("-", 1)[1]) < (90 if i.category == "maths" else 40))
        for i in items
    }
    floors = {"maths": 0.5, "general": 0.7}
    verdict = floor_verdict(items, scores, floors=floors, thresholds=THRESHOLDS)
    assert not verdict.passed
    assert [(r.category, r.metric, r.passed) for r in verdict.results] == [
        ("maths", "floor", True),
        ("general", "floor", False),
    ]
    assert verdict.results[1].live_mean == pytest.approx(0.7)
    assert verdict.reasons[0].startswith("general (floor): a real drop of 0.300")
    assert floor_verdict(
        items, scores, floors={"maths": 0.5, "general": 0.3}, thresholds=THRESHOLDS
    ).passed
    with pytest.raises(ValueError, match="no threshold or floor"):
        floor_verdict(items, scores, floors={"maths": 0.5}, thresholds=THRESHOLDS)

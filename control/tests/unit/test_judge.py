"""The judge's prompt, the reading of its reply, and the guard against position bias."""

from __future__ import annotations

import pytest

from models_registry.domain.judge import (
    DEFAULT_JUDGE_PROMPT,
    JUDGE_PROMPTS,
    candidate_verdict,
    is_swapped,
    judge_messages,
    parse_judge_reply,
    present_pair,
    unswap_verdict,
)

QUESTION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 6 x 7? Answer with the number."},
]


def test_the_judge_prompt_holds_the_question_and_both_answers() -> None:
    messages = judge_messages(QUESTION, " 42 ", "{not a field}", "judge-v1")
    assert [m["role"] for m in messages] == ["user"]
    content = messages[0]["content"]
    assert (
        "[Question]\n(system) Answer briefly.\n\n"
        "What is 6 x 7? Answer with the number.\n\n"
        "[Answer A]\n42\n\n[Answer B]\n{not a field}\n\n[End]"
    ) in content
    assert DEFAULT_JUDGE_PROMPT in JUDGE_PROMPTS


def test_an_unknown_judge_prompt_or_no_question_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown judge prompt 'judge-v0'"):
        judge_messages(QUESTION, "a", "b", "judge-v0")
    with pytest.raises(ValueError, match="question"):
        judge_messages([], "a", "b")


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("A", "a"),
        ("b", "b"),
        (" tie\n", "tie"),
        ("Tie.", "tie"),
        ('"A"', "a"),
        ("[[B]]", "b"),
        ("**A**", "a"),
        ("Answer B", "b"),
        ("Verdict: tie", "tie"),
        ("", None),
        (None, None),
        ("A or B", None),
        ("a good answer", None),
        ("Both are right", None),
        ("C", None),
        ("A" + " " * 30 + ".", None),
    ],
)
def test_judge_replies_are_read_strictly(
    reply: str | None, verdict: str | None
) -> None:
    assert parse_judge_reply(reply) == verdict


def test_the_order_is_drawn_per_item_stably_and_about_half_each_way() -> None:
    keys = [f"maths-{n:03d}" for n in range(400)]
    swapped = [is_swapped(key) for key in keys]
    assert swapped == [is_swapped(key, DEFAULT_JUDGE_PROMPT) for key in keys]
    assert 160 <= sum(swapped) <= 240
    assert [is_swapped(k, "judge-v9") for k in keys] != swapped


def test_a_verdict_maps_back_to_the_pair_it_was_about() -> None:
    # The candidate is shown second: the judge preferring B prefers the candidate.
    shown = present_pair("candidate answer", "live answer", swapped=True)
    assert shown == ("live answer", "candidate answer")
    assert candidate_verdict(unswap_verdict("b", swapped=True)) == "candidate"
    assert candidate_verdict(unswap_verdict("a", swapped=True)) == "live"
    assert candidate_verdict(unswap_verdict("a", swapped=False)) == "candidate"
    assert candidate_verdict(unswap_verdict("tie", swapped=True)) == "tie"
    assert candidate_verdict(unswap_verdict(None, swapped=True)) is None
    assert present_pair("x", "y", swapped=False) == ("x", "y")

"""The live-answer judge's pure half: sampling, the question, the verdict's meaning."""

from __future__ import annotations

import json

import pytest

from routing.domain.live_judge import (
    JudgeSampler,
    judge_body,
    pair_outcome,
    question_messages,
)
from simengine.domain import oracle


def test_the_sampler_takes_its_share_and_no_more_than_its_rate() -> None:
    sampler = JudgeSampler()
    # Outside the share: never taken, and no allowance spent.
    assert not sampler.take("m", share=0.25, per_minute=2, draw=0.25, now=0.0)
    assert sampler.take("m", share=0.25, per_minute=2, draw=0.1, now=0.0)
    assert sampler.take("m", share=0.25, per_minute=2, draw=0.1, now=0.0)
    assert not sampler.take("m", share=0.25, per_minute=2, draw=0.1, now=1.0)
    # Two a minute: one more after 30 s, and another model has its own bucket.
    assert sampler.take("m", share=0.25, per_minute=2, draw=0.1, now=31.0)
    assert sampler.take("other", share=1.0, per_minute=2, draw=0.9, now=31.0)
    assert not sampler.take("m", share=1.0, per_minute=0, draw=0.0, now=1e6)


def test_the_question_is_the_requests_text_messages() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
            {"role": "tool", "content": "42", "tool_call_id": "x"},
            {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]},
        ]
    }
    assert question_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "What is 2 + 2?"},
    ]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": "hello"},
        {"messages": [{"role": "assistant", "content": "hi"}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x"}}],
                }
            ]
        },
        {"messages": [{"role": "user", "content": 7}]},
        {"messages": [["user", "hi"]]},
    ],
)
def test_what_cannot_be_shown_as_text_is_not_judged(body: dict[str, object]) -> None:
    assert question_messages(body) is None


@pytest.mark.parametrize("pair_key", [f"req-{i}" for i in range(12)])
@pytest.mark.parametrize(
    ("candidate", "live", "outcome"),
    [("12", "11", "win"), ("11", "12", "loss"), ("12", "12", "tie"), ("3", "4", "tie")],
)
def test_a_right_judge_gives_the_candidate_its_outcome_in_either_order(
    pair_key: str, candidate: str, live: str, outcome: str
) -> None:
    """The simulated judge (always right) reads the body the gateway sends; its
    reply, mapped back through the order shown, is the candidate's outcome."""
    question = [{"role": "user", "content": "What is 5 + 7? Answer with the number."}]
    raw, swapped = judge_body("judge-m", question, candidate, live, pair_key=pair_key)
    body = json.loads(raw)
    assert body["model"] == "judge-m" and body["stream"] is True
    reply = oracle.reply(body["messages"], quality=1.0, seed=0)
    assert pair_outcome(reply, swapped=swapped) == outcome


def test_both_orders_are_shown_and_an_unreadable_reply_is_no_outcome() -> None:
    shown = {
        judge_body("j", [{"role": "user", "content": "q"}], "a", "b", pair_key=f"k{i}")[
            1
        ]
        for i in range(40)
    }
    assert shown == {True, False}
    assert pair_outcome("I think both are fine", swapped=False) == "unreadable"
    assert pair_outcome(None, swapped=True) == "unreadable"
    assert pair_outcome("B", swapped=True) == "win"

"""The live-answer judge's decisions: which requests to judge, what it is shown,
and what its reply means for the candidate (issue 38).

Public surface: ``JudgeSampler``, ``question_messages``, ``judge_body``,
``pair_outcome``, ``JUDGE_MAX_TOKENS``.

Pure: no I/O; the clock is passed in. The gateway (``routing.live_judge``)
sends a sampled request to the candidate and to the live version, shows both
answers to the plan's judge model with the eval gate's versioned prompt
(``models_registry.domain.judge``), and counts the verdict on the candidate's
figures. Text lives only in memory while a pair is judged: the figures keep
the outcome alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from models_registry.domain.judge import (
    DEFAULT_JUDGE_PROMPT,
    candidate_verdict,
    is_swapped,
    judge_messages,
    parse_judge_reply,
    present_pair,
    unswap_verdict,
)

__all__ = [
    "JUDGE_MAX_TOKENS",
    "JudgeSampler",
    "judge_body",
    "pair_outcome",
    "question_messages",
]

# The judge answers one word; a few tokens leave room for "Answer A.".
JUDGE_MAX_TOKENS = 8
_OUTCOME = {"candidate": "win", "live": "loss", "tie": "tie"}


class JudgeSampler:
    """Which of a model's candidate requests get judged: a share of them, at most
    ``per_minute`` a minute (a token bucket per model, refilled continuously).

    One per gateway process; ``take`` is called on the request path, so it is a
    few arithmetic operations and a dict lookup.
    """

    def __init__(self) -> None:
        # model -> (allowance left, when it was last refilled)
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(
        self, model: str, *, share: float, per_minute: int, draw: float, now: float
    ) -> bool:
        """Return True if this request's pair is judged.

        ``draw``: a uniform number in [0, 1) for the share; ``now``: seconds on a
        monotonic clock. A request outside the share costs no allowance.
        """
        if per_minute <= 0 or draw >= share:
            return False
        allowance, last = self._buckets.get(model, (float(per_minute), now))
        allowance = min(
            float(per_minute), allowance + max(0.0, now - last) * per_minute / 60.0
        )
        if allowance < 1.0:
            self._buckets[model] = (allowance, now)
            return False
        self._buckets[model] = (allowance - 1.0, now)
        return True


def _text_of(content: Any) -> str | None:
    """A message's content as text; None when it holds anything but text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            parts.append(text)
        return "".join(parts)
    return None


def question_messages(body: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """Return a chat request's messages as the judge's question, or None.

    None when the request cannot be shown to a judge as text: no messages, a
    last message that is not the user's, or content other than text (images,
    audio). Tool calls an assistant made are left out; their results stay.
    """
    raw = body.get("messages")
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes) or not raw:
        return None
    messages: list[dict[str, str]] = []
    for message in raw:
        if not isinstance(message, Mapping):
            return None
        role = message.get("role")
        text = _text_of(message.get("content"))
        if not isinstance(role, str) or text is None:
            return None
        messages.append({"role": role, "content": text})
    if messages[-1]["role"] != "user":
        return None
    return messages


def judge_body(
    judge_model: str,
    question: Sequence[Mapping[str, str]],
    candidate_answer: str,
    live_answer: str,
    *,
    pair_key: str,
    prompt_version: str = DEFAULT_JUDGE_PROMPT,
) -> tuple[bytes, bool]:
    """Return the judge's request body and whether the pair is shown swapped.

    The candidate is the pair's first answer; the order shown is drawn from
    ``pair_key`` (``is_swapped``), so position bias favours neither side.
    """
    swapped = is_swapped(pair_key, prompt_version)
    shown_a, shown_b = present_pair(candidate_answer, live_answer, swapped=swapped)
    body = {
        "model": judge_model,
        "messages": judge_messages(question, shown_a, shown_b, prompt_version),
        "max_tokens": JUDGE_MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode(), swapped


def pair_outcome(reply: str | None, *, swapped: bool) -> str:
    """Return the candidate's outcome from the judge's reply: ``win``, ``loss``,
    ``tie`` or ``unreadable``."""
    verdict = candidate_verdict(
        unswap_verdict(parse_judge_reply(reply), swapped=swapped)
    )
    return "unreadable" if verdict is None else _OUTCOME[verdict]

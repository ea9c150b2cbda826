"""The eval gate's LLM judge: versioned prompts, reading its reply, the order guard.

Public surface: ``JUDGE_PROMPTS``, ``DEFAULT_JUDGE_PROMPT``, ``DEFAULT_JUDGE_MODEL``,
``judge_messages``, ``parse_judge_reply``, ``is_swapped``, ``present_pair``,
``unswap_verdict``, ``candidate_verdict``.

Pure: no I/O. The judge is a model registered on the platform
(``DEFAULT_JUDGE_MODEL``, ``reason-70b``, unless the gate names another), asked
through the gateway like any other (``control.eval_run``).

**Prompts are versioned.** ``JUDGE_PROMPTS`` maps a version (``judge-v1``) to its
template; a report records the version it was judged with, and a template is
never edited in place (a new wording is a new version), so two reports with the
same version were judged alike. Every template holds the blocks ``[Question]``,
``[Answer A]``, ``[Answer B]`` and ``[End]``, each followed by its text and a
blank line, which is also how the simulated replica recognises a judge prompt
(``simengine.domain.oracle``). The question is the item's messages: earlier ones
as ``(role) content`` paragraphs, the final user message last.

**The reply** (``parse_judge_reply``) is one word, ``A``, ``B`` or ``tie`` (case,
quotes, brackets and a trailing full stop aside; ``Answer A`` too); anything else
is unreadable (None) and counts against the judge, never for either side.

**Position bias.** Judges tend to favour the first answer shown. So each
comparison shows its two answers in an order drawn from a hash of the item's id
and the prompt version (``is_swapped``: stable, so a rerun asks the same
question, and about half the items each way), and maps the verdict back
(``unswap_verdict``): ``a`` then means the first of the pair as given (the
candidate, or a labelled pair's ``a``), whatever side it was shown on.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType

__all__ = [
    "DEFAULT_JUDGE_MODEL",
    "DEFAULT_JUDGE_PROMPT",
    "JUDGE_PROMPTS",
    "candidate_verdict",
    "is_swapped",
    "judge_messages",
    "parse_judge_reply",
    "present_pair",
    "unswap_verdict",
]

DEFAULT_JUDGE_MODEL = "reason-70b"
DEFAULT_JUDGE_PROMPT = "judge-v1"
JUDGE_PROMPTS: Mapping[str, str] = MappingProxyType(
    {
        "judge-v1": (
            "You are grading two answers to the same question. Decide which one is "
            "correct and does what the question asks.\n\n"
            "[Question]\n{question}\n\n"
            "[Answer A]\n{answer_a}\n\n"
            "[Answer B]\n{answer_b}\n\n"
            "[End]\n\n"
            "Reply with one word: A if only answer A is correct, B if only answer "
            "B is correct, tie if both or neither are. Say nothing else."
        ),
    }
)
_WORDS = re.compile(r"[a-z]+")
_VERDICTS = frozenset({"a", "b", "tie"})


def _question_text(messages: Sequence[Mapping[str, str]]) -> str:
    *earlier, last = messages
    parts = [f"({m['role']}) {m['content']}" for m in earlier]
    parts.append(last["content"])
    return "\n\n".join(parts)


def judge_messages(
    question_messages: Sequence[Mapping[str, str]],
    answer_a: str,
    answer_b: str,
    version: str = DEFAULT_JUDGE_PROMPT,
) -> list[dict[str, str]]:
    """Return the chat messages that ask the judge to compare two answers.

    Raises:
        ValueError: ``version`` is not in ``JUDGE_PROMPTS``, or there is no
            question.
    """
    template = JUDGE_PROMPTS.get(version)
    if template is None:
        raise ValueError(
            f"unknown judge prompt {version!r}; known: {', '.join(JUDGE_PROMPTS)}"
        )
    if not question_messages:
        raise ValueError("the judge needs the question's messages")
    content = template.format(
        question=_question_text(question_messages),
        answer_a=answer_a.strip(),
        answer_b=answer_b.strip(),
    )
    return [{"role": "user", "content": content}]


def parse_judge_reply(text: str | None) -> str | None:
    """Return ``a``, ``b`` or ``tie`` from the judge's reply, or None if unreadable."""
    if not text:
        return None
    words = _WORDS.findall(text.lower())
    if len(words) == 2 and words[0] in {"answer", "verdict"}:
        words = words[1:]
    # Only letters count as words: "[[A]]", '"tie".' and "**B**" read as one.
    if len(words) != 1 or words[0] not in _VERDICTS:
        return None
    if len(text.strip()) > 24:  # one word, not an essay that happens to be one
        return None
    return str(words[0])


def is_swapped(key: str, version: str = DEFAULT_JUDGE_PROMPT) -> bool:
    """Return True if the pair keyed ``key`` is shown second answer first."""
    digest = hashlib.blake2b(f"{version}\0{key}".encode(), digest_size=8).digest()
    return bool(digest[0] & 1)


def present_pair(first: str, second: str, *, swapped: bool) -> tuple[str, str]:
    """Return the pair as shown to the judge: (answer A, answer B)."""
    return (second, first) if swapped else (first, second)


def unswap_verdict(verdict: str | None, *, swapped: bool) -> str | None:
    """Map a verdict about the shown order back to the pair's own order."""
    if verdict is None or verdict == "tie" or not swapped:
        return verdict
    return "b" if verdict == "a" else "a"


def candidate_verdict(verdict: str | None) -> str | None:
    """Name the winner of (candidate, live) in the pair's own order."""
    if verdict is None:
        return None
    return {"a": "candidate", "b": "live", "tie": "tie"}[verdict]

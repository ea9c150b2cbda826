"""What the simulated replica answers when it can tell the right answer: its quality.

Public surface: ``CATEGORIES``, ``Task``, ``JudgePrompt``, ``recognise``, ``read_judge_prompt``,
``is_right``, ``wrong_answer``, ``judge_truth``, ``reply``, ``answer_pieces``,
``TEMPLATES``.

Pure: no I/O, no clock. A real model's quality shows in its answers; the stand-in
has none of its own, so it recognises a small family of prompts whose right answer
is computable from the prompt, and answers them right with probability
``quality``. Anything else keeps the generated text the replica always sent.

**Prompt templates** (the whole last user message, ``TEMPLATES``; the default eval
set, ``platform/evals/chat-default.jsonl``, is built from them):

- maths: ``What is 37 + 48? Answer with the number.`` (``+``, ``-`` or ``x``);
- general: ``Reply with exactly this word: lantern`` and ``Spell the word lantern
  backwards. Answer with the word.``;
- reasoning: ``Is 37 even or odd? Answer with one word.``, ``Which is larger, 37
  or 48? Answer with the number.`` and ``Sam has 12 apples and buys 5 more, then
  gives away 3. How many apples does Sam have now? Answer with the number.``;
- long_output: ``Write exactly 40 words about rivers.`` (2 to 2,000 words),
  answered with that many words.

**Quality.** Whether an answer is right is decided by a hash of the rendered
prompt, the replica's seed and nothing else: two runs of one replica, and two
replicas with the same seed, agree; a replica of lower quality (same seed) is
wrong on every prompt the better one got wrong and on some more, as a quantized
model loses answers its parent had. A wrong answer is plausible: another number
(off by one to nine, the smaller of the two), another word (the word not
reversed, the other parity), a long output cut to half its length.

**The judge.** A user message holding the blocks ``[Question]``, ``[Answer A]``,
``[Answer B]`` and ``[End]`` (as ``models_registry.domain.judge`` writes its
templates) is a request to compare two answers. The oracle recomputes the right
answer of the question (the block's last paragraph, where the judge template puts
the final user message) and says ``A`` when only answer A is right, ``B`` when only
B is, ``tie`` when both or neither are (or the question is none of its templates);
itself right with probability ``quality``, else one of the two other verdicts.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simengine.domain import tokens

# tokens keeps its piece regex private; the pieces an answer streams as must be
# exactly the tokenizer's, so that usage counts follow the text.
from simengine.domain.tokens import _PIECE_RE

__all__ = [
    "CATEGORIES",
    "TEMPLATES",
    "JudgePrompt",
    "Task",
    "answer_pieces",
    "is_right",
    "judge_truth",
    "read_judge_prompt",
    "recognise",
    "reply",
    "wrong_answer",
]

# The categories of the prompts the oracle knows (``Task.category``), as the eval
# sets' (``models_registry.domain.eval_gate.CATEGORIES``).
CATEGORIES = ("reasoning", "maths", "long_output", "general")
TEMPLATES: Mapping[str, re.Pattern[str]] = {
    "sum": re.compile(
        r"What is (-?\d{1,6}) ([+\-x]) (-?\d{1,6})\? Answer with the number\."
    ),
    "echo": re.compile(r"Reply with exactly this word: ([A-Za-z]{1,32})"),
    "reverse": re.compile(
        r"Spell the word ([A-Za-z]{2,32}) backwards\. Answer with the word\."
    ),
    "parity": re.compile(r"Is (\d{1,9}) even or odd\? Answer with one word\."),
    "larger": re.compile(
        r"Which is larger, (-?\d{1,9}) or (-?\d{1,9})\? Answer with the number\."
    ),
    "story": re.compile(
        r"([A-Z][a-z]{1,15}) has (\d{1,4}) ([a-z]{2,15}) and buys (\d{1,4}) more, "
        r"then gives away (\d{1,4})\. How many \3 does \1 have now\? "
        r"Answer with the number\."
    ),
    "words": re.compile(r"Write exactly (\d{1,4}) words about ([a-z][a-z ]{0,40})\."),
}
_MIN_WORDS, _MAX_WORDS = 2, 2000
_JUDGE = re.compile(
    r"\[Question\]\n(?P<question>.*?)\n\n\[Answer A\]\n(?P<a>.*?)\n\n"
    r"\[Answer B\]\n(?P<b>.*?)\n\n\[End\]",
    re.DOTALL,
)
# Words a wrong "echo" answer says instead (no articles: they normalise away).
_OTHER_WORDS = (
    "candle",
    "river",
    "window",
    "pepper",
    "garden",
    "silver",
    "ladder",
    "meadow",
)
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_INTEGER = re.compile(r"-?\d+")
_VERDICT_TEXT = {"a": "A", "b": "B", "tie": "tie"}


@dataclass(frozen=True, slots=True)
class Task:
    """A recognised prompt: its category, its right answer and how one is checked.

    ``check`` is ``number`` (the last integer written), ``exact`` (the same text,
    case and punctuation aside) or ``words`` (exactly ``len(answer.split())``
    words).
    """

    category: str
    answer: str
    check: str


@dataclass(frozen=True, slots=True)
class JudgePrompt:
    """The question and the two answers a judge prompt asks about."""

    question: str
    answer_a: str
    answer_b: str


def _filler_words(n: int, key: str) -> str:
    """Return ``n`` words drawn from the replica's output vocabulary, stably."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return " ".join(piece.strip() for piece in tokens.output_text(seed, n))


def recognise(text: str) -> Task | None:
    """Return the task of a prompt (``TEMPLATES``), or None for any other text."""
    text = text.strip()
    if m := TEMPLATES["sum"].fullmatch(text):
        a, op, b = int(m[1]), m[2], int(m[3])
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Task("maths", str(value), "number")
    if m := TEMPLATES["echo"].fullmatch(text):
        return Task("general", m[1], "exact")
    if m := TEMPLATES["reverse"].fullmatch(text):
        return Task("general", m[1][::-1], "exact")
    if m := TEMPLATES["parity"].fullmatch(text):
        return Task("reasoning", "odd" if int(m[1]) % 2 else "even", "exact")
    if m := TEMPLATES["larger"].fullmatch(text):
        a, b = int(m[1]), int(m[2])
        return None if a == b else Task("reasoning", str(max(a, b)), "number")
    if m := TEMPLATES["story"].fullmatch(text):
        value = int(m[2]) + int(m[4]) - int(m[5])
        return None if value < 0 else Task("reasoning", str(value), "number")
    if m := TEMPLATES["words"].fullmatch(text):
        n = int(m[1])
        if not _MIN_WORDS <= n <= _MAX_WORDS:
            return None
        return Task("long_output", _filler_words(n, text), "words")
    return None


def _normalise(text: str) -> str:
    return " ".join(text.lower().translate(_PUNCTUATION).split())


def is_right(task: Task, answer: str) -> bool:
    """Return True if ``answer`` is a right answer to ``task``."""
    if task.check == "number":
        found = _INTEGER.findall(answer.replace(",", ""))
        return bool(found) and int(found[-1]) == int(task.answer)
    if task.check == "words":
        return len(answer.split()) == len(task.answer.split())
    return _normalise(answer) == _normalise(task.answer)


def wrong_answer(task: Task, pick: int, *, prompt: str = "") -> str:
    """Return a plausible wrong answer to ``task``; ``pick`` varies which one.

    ``prompt`` is the question's text, which some mistakes repeat (the word not
    reversed, the smaller number).
    """
    if task.check == "words":
        words = task.answer.split()
        return " ".join(words[: len(words) // 2])
    if task.category == "reasoning" and task.check == "exact":
        return "even" if task.answer == "odd" else "odd"
    if m := TEMPLATES["larger"].fullmatch(prompt.strip()):
        return str(min(int(m[1]), int(m[2])))
    if task.check == "number":
        delta = 1 + pick % 9
        return str(int(task.answer) + (delta if pick & 16 else -delta))
    forward = TEMPLATES["reverse"].fullmatch(prompt.strip())
    if forward and _normalise(forward[1]) != _normalise(task.answer):
        return forward[1]  # forgot to reverse it
    others = [w for w in _OTHER_WORDS if w != _normalise(task.answer)]
    return others[pick % len(others)]


def read_judge_prompt(text: str) -> JudgePrompt | None:
    """Return the question and answers of a judge prompt, or None if it is none."""
    m = _JUDGE.search(text)
    if m is None:
        return None
    return JudgePrompt(m["question"], m["a"], m["b"])


def judge_truth(prompt: JudgePrompt) -> str:
    """Return the right verdict: ``a`` or ``b`` when only that answer is right,
    ``tie`` when both or neither are, or the question is not one the oracle knows."""
    # The judge template puts the final user message last, after a blank line.
    question = prompt.question.rsplit("\n\n", 1)[-1]
    task = recognise(question)
    if task is None:
        return "tie"
    a_right = is_right(task, prompt.answer_a)
    b_right = is_right(task, prompt.answer_b)
    if a_right == b_right:
        return "tie"
    return "a" if a_right else "b"


def _draw(seed: int, prompt: str, salt: str) -> int:
    digest = hashlib.blake2b(
        f"{seed}\0{salt}\0{prompt}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big")


def _is_right_this_time(quality: float, seed: int, prompt: str) -> bool:
    return _draw(seed, prompt, "right") / 2**64 < quality


def reply(
    messages: Sequence[Mapping[str, Any]],
    *,
    quality: float,
    seed: int,
    quality_by_category: Mapping[str, float] | None = None,
) -> str | None:
    """Return the answer to a recognised prompt or judge prompt, else None.

    Right with probability ``quality``, decided by a hash of the rendered prompt
    and ``seed`` (module docstring). ``quality_by_category`` overrides it for a
    task's category (``maths``, ``reasoning``, ``general``, ``long_output``): a
    quantized model that lost its arithmetic but kept the rest. The judge's
    verdicts keep ``quality``.
    """
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        return None
    text = tokens.message_text(users[-1].get("content"))
    prompt = tokens.render_chat(messages)
    pick = _draw(seed, prompt, "pick")
    judged = read_judge_prompt(text)
    task = None if judged is not None else recognise(text)
    if task is not None and quality_by_category:
        quality = quality_by_category.get(task.category, quality)
    right = _is_right_this_time(quality, seed, prompt)
    if judged is not None:
        truth = judge_truth(judged)
        if right:
            return _VERDICT_TEXT[truth]
        others = [v for v in ("a", "b", "tie") if v != truth]
        return _VERDICT_TEXT[others[pick % 2]]
    if task is None:
        return None
    return task.answer if right else wrong_answer(task, pick, prompt=text)


def answer_pieces(text: str) -> list[str]:
    """Return ``text`` cut into the tokenizer's pieces, one token each.

    Invariant: ``"".join(answer_pieces(t)) == t`` and ``len(answer_pieces(t)) ==
    len(tokens.encode(t))``.
    """
    return list(_PIECE_RE.findall(text))

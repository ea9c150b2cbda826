"""``manage.py make_load_trace``: write the chat trace the load-test gate replays.

The shipped trace is ``platform/traces/chat-650-250.jsonl``, written by

    manage.py make_load_trace --seed 0 --out platform/traces/chat-650-250.jsonl

(the defaults). Deterministic for a seed: the same flags write the same bytes.

**Shape** (the profiles' calibration, 650-token prompts and 250-token answers, as
conversations that share prefixes):

- One line per request, sorted by ``t`` (seconds; conversations start as Poisson
  arrivals so that requests come at ``--rate`` req/s), each with ``conversation``,
  ``max_tokens`` (the answer's length: every answer is ``--answer-tokens`` long)
  and ``messages`` with real text, counted by the platform's tokenizer
  (``simengine.domain.tokens``: about 4 characters a token).
- Every conversation opens with the same short system prompt (22 tokens with its
  chat markers: one whole 16-token KV block, which every request shares).
- A conversation goes on after each turn with probability ``--follow-up`` (at most
  ``--max-turns`` turns). A later turn's messages are the earlier turns as logged
  (the user's messages and the answers that were given) and a new user message of
  about ``--follow-up-tokens`` tokens, so its prompt starts with the whole previous
  prompt: the prefix a replica that served the previous turn holds. It comes
  after the previous answer streamed (at 30 tokens/s) and a pause (exponential,
  ``--think-s`` on average).
- First user messages are lognormal in length (CV 0.35), scaled so that the mean
  prompt over all lines is ``--prompt-tokens`` (650).

With the defaults: 640 requests in 590 conversations (1.6 MB), 7.8% of them
later turns; prompt tokens that lie on a shared prefix (the system prompt's block,
and later turns' previous prompts, in whole 16-token blocks) are 9.6% of all.
A replay adds its tag (9 tokens) to every prompt
(``drills.domain.capacity_test.replay_tag``). The command prints these figures
for the file it wrote.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from simengine.domain import tokens

DEFAULT_OUT = Path("platform/traces/chat-650-250.jsonl")
SYSTEM_PROMPT = "You are the support assistant of Acme Cloud. Answer briefly."
_KV_BLOCK = 16  # vLLM's default block size: what a replica can share
_FIRST_MESSAGE_CV = 0.35
_FOLLOW_UP_CV = 0.5
_MIN_MESSAGE_TOKENS = 8

# Words of a support chat; longer words are several tokens (4 characters a piece).
_WORD_SOURCE = (
    "account access add after again alert all also always api app are area ask "
    "back backup bill billing bucket build but cache can card change check cli "
    "client cloud cluster code config connect console cost could cpu create "
    "credit data database deploy disk dns does domain down each email enable "
    "end error event every file find first fix for from get gpu group has have "
    "help how image instance invoice issue job just key keys last latency limit "
    "list load log logs make many memory metric migrate model more network new "
    "node not now off old only order our out page plan please policy port price "
    "project quota rate read region reset restart role rule run running same "
    "scale secret server service set setup should show size slow some start "
    "still stop storage support sure team than that the them then there this "
    "time token traffic try update upgrade usage use user using very volume want "
    "was way what when where which while why will with work would write wrong "
    "yesterday you your zone"
)
_WORDS = tuple(_WORD_SOURCE.split())


@dataclass(frozen=True, slots=True)
class TraceShape:
    """What ``make_load_trace`` generates (its flags)."""

    requests: int = 640
    rate: float = 10.0
    prompt_tokens: int = 650
    answer_tokens: int = 250
    follow_up: float = 0.08
    follow_up_tokens: int = 60
    max_turns: int = 4
    think_s: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.rate <= 0 or self.think_s < 0:
            raise ValueError("requests and rate must be positive, think_s >= 0")
        if self.answer_tokens < 1 or self.follow_up_tokens < _MIN_MESSAGE_TOKENS:
            raise ValueError(
                f"answers need a token, follow-ups at least {_MIN_MESSAGE_TOKENS}"
            )
        if not 0.0 <= self.follow_up < 1.0 or self.max_turns < 1:
            raise ValueError("follow_up must be in [0, 1) and max_turns >= 1")


class _Text:
    """Text of an exact token count, from a seeded stream of words."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.cost = {word: len(tokens.encode(" " + word)) for word in _WORDS}
        self.short = [word for word, cost in self.cost.items() if cost == 1]

    def make(self, n_tokens: int) -> str:
        """Return sentences of exactly ``n_tokens`` tokens (a space-separated run of
        words; a period is one token)."""
        parts: list[str] = []
        left = n_tokens
        in_sentence = 0
        while left > 0:
            if in_sentence >= 6 and left >= 2 and self.rng.random() < 0.15:
                parts[-1] += "."
                left -= 1
                in_sentence = 0
                continue
            word = self.rng.choice(_WORDS)
            if self.cost[word] > left:
                word = self.rng.choice(self.short)
            if in_sentence == 0:
                word = word.capitalize()
            parts.append(word)
            left -= self.cost[word.lower()]
            in_sentence += 1
        return " ".join(parts)


def _lognormal(rng: random.Random, mean: float, cv: float) -> float:
    sigma = math.sqrt(math.log(1.0 + cv * cv))
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def _turn_counts(shape: TraceShape, rng: random.Random) -> list[int]:
    counts: list[int] = []
    total = 0
    while total < shape.requests:
        turns = 1
        while turns < shape.max_turns and rng.random() < shape.follow_up:
            turns += 1
        turns = min(turns, shape.requests - total)
        counts.append(turns)
        total += turns
    return counts


def build_trace(shape: TraceShape) -> list[dict[str, Any]]:
    """Return the trace's lines (JSON objects), sorted by time."""
    rng = random.Random(f"load-trace:{shape.seed}")
    text = _Text(random.Random(f"load-trace-text:{shape.seed}"))
    counts = _turn_counts(shape, rng)
    overhead = _chat_overheads()
    # Raw draws first; the first messages are scaled afterwards to the mean prompt.
    first_draws = [_lognormal(rng, 1.0, _FIRST_MESSAGE_CV) for _ in counts]
    follow_ups = [
        [
            max(
                _MIN_MESSAGE_TOKENS,
                round(_lognormal(rng, shape.follow_up_tokens, _FOLLOW_UP_CV)),
            )
            for _ in range(turns - 1)
        ]
        for turns in counts
    ]
    # A turn j (0-based) prompt: system, j + 1 user messages, j answers, the tail.
    fixed = 0.0
    scaled = 0.0
    for draw, extra, turns in zip(first_draws, follow_ups, counts, strict=True):
        for j in range(turns):
            fixed += (
                overhead.system
                + (j + 1) * overhead.message
                + j * (overhead.message + shape.answer_tokens)
                + sum(extra[:j])
                + overhead.tail
            )
            scaled += draw
    scale = (shape.prompt_tokens * shape.requests - fixed) / scaled
    if scale < _MIN_MESSAGE_TOKENS:
        raise ValueError("prompt_tokens is too small for this shape")
    starts_rate = shape.rate * len(counts) / shape.requests
    answer_s = shape.answer_tokens / 30.0
    lines: list[dict[str, Any]] = []
    at = 0.0
    for number, (draw, extra, turns) in enumerate(
        zip(first_draws, follow_ups, counts, strict=True)
    ):
        at += rng.expovariate(starts_rate)
        messages: list[dict[str, str]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {
                "role": "user",
                "content": text.make(max(_MIN_MESSAGE_TOKENS, round(scale * draw))),
            },
        ]
        t = at
        for j in range(turns):
            if j:
                messages.append(
                    {"role": "assistant", "content": text.make(shape.answer_tokens)}
                )
                messages.append({"role": "user", "content": text.make(extra[j - 1])})
                t += answer_s + rng.expovariate(1.0 / shape.think_s)
            lines.append(
                {
                    "t": round(t, 3),
                    "conversation": f"c{number:05d}",
                    "max_tokens": shape.answer_tokens,
                    "messages": [dict(m) for m in messages],
                }
            )
    lines.sort(key=lambda line: line["t"])
    return lines


@dataclass(frozen=True, slots=True)
class _Overheads:
    system: int
    message: int
    tail: int


def _chat_overheads() -> _Overheads:
    """Tokens the chat template adds: the system message (with its text), another
    message around its text, and the prompt's tail (``<|assistant|>``)."""
    system = [{"role": "system", "content": SYSTEM_PROMPT}]
    with_user = [*system, {"role": "user", "content": "word"}]
    return _Overheads(
        system=tokens.count_chat_tokens(system) - tokens.count_chat_tokens([]),
        message=tokens.count_chat_tokens(with_user)
        - tokens.count_chat_tokens(system)
        - 1,
        tail=tokens.count_chat_tokens([]),
    )


def trace_figures(lines: list[dict[str, Any]]) -> dict[str, float]:
    """Return the shape of ``lines`` as a replica sees it: prompt tokens, the share
    of later turns, and the share of prompt tokens on a shared prefix (whole KV
    blocks of the system prompt or of the conversation's previous prompt)."""
    previous: dict[str, list[int]] = {}
    system_ids = tokens.encode(tokens.render_chat(lines[0]["messages"][:1]))
    prompts = shared = later = 0
    for line in lines:
        ids = tokens.encode(tokens.render_chat(line["messages"]))
        before = previous.get(line["conversation"])
        if before is None:
            common = _common(ids, system_ids)
        else:
            later += 1
            common = _common(ids, before)
        # vLLM never serves the prompt's last token from the cache.
        shared += min(common, len(ids) - 1) // _KV_BLOCK * _KV_BLOCK
        prompts += len(ids)
        previous[line["conversation"]] = ids
    return {
        "requests": len(lines),
        "conversations": len(previous),
        "mean_prompt_tokens": prompts / len(lines),
        "later_turn_share": later / len(lines),
        "shared_prefix_share": shared / prompts,
    }


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Command(BaseCommand):
    help = (
        "Write a JSONL chat trace for the load-test gate: conversations with a "
        "shared system prompt and earlier turns, 650-token prompts on average and "
        "250-token answers (see the module docstring for the shape)."
    )
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        defaults = TraceShape()
        parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
        parser.add_argument("--seed", type=int, default=defaults.seed)
        parser.add_argument("--requests", type=int, default=defaults.requests)
        parser.add_argument(
            "--rate", type=float, default=defaults.rate, help="requests/s of `t`"
        )
        parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
        parser.add_argument("--answer-tokens", type=int, default=defaults.answer_tokens)
        parser.add_argument(
            "--follow-up",
            type=float,
            default=defaults.follow_up,
            help="probability that a conversation goes on after a turn",
        )
        parser.add_argument(
            "--follow-up-tokens", type=int, default=defaults.follow_up_tokens
        )
        parser.add_argument("--max-turns", type=int, default=defaults.max_turns)
        parser.add_argument("--think-s", type=float, default=defaults.think_s)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            shape = TraceShape(
                requests=options["requests"],
                rate=options["rate"],
                prompt_tokens=options["prompt_tokens"],
                answer_tokens=options["answer_tokens"],
                follow_up=options["follow_up"],
                follow_up_tokens=options["follow_up_tokens"],
                max_turns=options["max_turns"],
                think_s=options["think_s"],
                seed=options["seed"],
            )
            lines = build_trace(shape)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        out: Path = options["out"]
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(json.dumps(line, separators=(",", ":")) + "\n")
        figures = trace_figures(lines)
        self.stdout.write(
            f"{out}: {figures['requests']:.0f} requests in "
            f"{figures['conversations']:.0f} conversations, "
            f"{out.stat().st_size / 1e6:.2f} MB; mean prompt "
            f"{figures['mean_prompt_tokens']:.1f} tokens, answers "
            f"{shape.answer_tokens} tokens; later turns "
            f"{figures['later_turn_share']:.1%}; prompt tokens on a shared prefix "
            f"{figures['shared_prefix_share']:.1%}"
        )

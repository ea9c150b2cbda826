"""How often the live-answer judge says the candidate won, lost or tied.

Public surface: ``judge_rates``, ``gradable_prompts``.

The rollout drill cannot afford to run an oracle per judged pair over 240
eight-hour rollouts, so it measures the rates once per set of qualities with
the code the platform runs: prompts the simulated replica can grade
(``simengine.domain.oracle.TEMPLATES``), the candidate's and live's answers from
``oracle.reply`` (each version its own seed, so their mistakes are their own,
as two models' are), the gateway's judge body and the reading of its reply
(``routing.domain.live_judge``), and the simulated judge's verdict at its own
quality. The drill then draws each slice's verdicts from these rates.

Pure: no I/O; the same arguments give the same rates.
"""

from __future__ import annotations

import functools
import json
import random

from routing.domain.live_judge import judge_body, pair_outcome
from simengine.domain import oracle

__all__ = ["gradable_prompts", "judge_rates"]

_WORDS = ("lantern", "harbor", "copper", "maple", "violet", "thunder", "pebble")
_NAMES = ("Sam", "Ana", "Lee", "Kofi", "Mia")


def gradable_prompts(count: int, seed: int) -> list[str]:
    """Return ``count`` prompts of the oracle's templates (maths, reasoning,
    general), drawn with ``seed``."""
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        kind = rng.randrange(6)
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        if kind == 0:
            op = rng.choice("+-x")
            prompts.append(f"What is {a} {op} {b}? Answer with the number.")
        elif kind == 1:
            prompts.append(f"Is {a} even or odd? Answer with one word.")
        elif kind == 2 and a != b:
            prompts.append(f"Which is larger, {a} or {b}? Answer with the number.")
        elif kind == 3:
            prompts.append(f"Reply with exactly this word: {rng.choice(_WORDS)}")
        elif kind == 4:
            word = rng.choice(_WORDS)
            prompts.append(f"Spell the word {word} backwards. Answer with the word.")
        elif kind == 5:
            name = rng.choice(_NAMES)
            got, more = rng.randint(5, 40), rng.randint(1, 20)
            away = rng.randint(0, got)
            prompts.append(
                f"{name} has {got} apples and buys {more} more, then gives away "
                f"{away}. How many apples does {name} have now? Answer with the "
                "number."
            )
    return prompts


@functools.lru_cache(maxsize=32)
def judge_rates(
    candidate_quality: float,
    live_quality: float,
    judge_quality: float,
    *,
    pairs: int = 3000,
    seed: int = 0,
) -> tuple[tuple[str, float], ...]:
    """Return ((outcome, share), ...) for ``win``, ``loss``, ``tie``,
    ``unreadable`` over ``pairs`` gradable prompts."""
    counts = {"win": 0, "loss": 0, "tie": 0, "unreadable": 0}
    for index, prompt in enumerate(gradable_prompts(pairs, seed)):
        messages = [{"role": "user", "content": prompt}]
        ours = oracle.reply(messages, quality=candidate_quality, seed=seed + 1)
        theirs = oracle.reply(messages, quality=live_quality, seed=seed + 2)
        assert ours is not None and theirs is not None
        raw, swapped = judge_body(
            "judge", messages, ours, theirs, pair_key=f"pair-{seed}-{index}"
        )
        shown = json.loads(raw)["messages"]
        verdict = oracle.reply(shown, quality=judge_quality, seed=seed + 3)
        counts[pair_outcome(verdict, swapped=swapped)] += 1
    return tuple((name, counts[name] / pairs) for name in counts)

"""Write the default chat eval set: items whose right answer the prompt determines.

Public surface: ``Command``, ``build_eval_set``, ``eval_set_lines``,
``DEFAULT_ITEMS``, ``DEFAULT_LABELLED``, ``DEFAULT_SEED``, ``DEFAULT_OUTPUT``.

``manage.py make_eval_set [--seed 15] [--items 200] [--labelled 40] [--output
platform/evals/chat-default.jsonl]`` writes the same bytes for the same flags. The
shipped ``platform/evals/chat-default.jsonl`` is its output with the defaults
(a test holds the two equal).

The prompts are the simulated replica's templates (``simengine.domain.oracle``;
a test there checks that it recognises every item and that its right answer
scores 1 against the reference), so a simulated version's quality shows in the
gate. Per category:

- maths: ``What is 37 + 48? Answer with the number.`` (``+``, ``-``, ``x``);
- general: ``Reply with exactly this word: lantern`` and ``Spell the word lantern
  backwards. Answer with the word.``;
- reasoning: parity, the larger of two numbers, a short word problem;
- long_output: ``Write exactly N words about X.`` (N from 20 to 80), whose
  reference is N words (only its length counts).

Every fifth item opens with a system message, so judge prompts carry one too.

**Size: 200 items per category.** A category passes when the bootstrap interval
of the mean paired difference (candidate minus live) stays above -0.05. An
equally good candidate still differs from live on some share d of the items
(answers that flip either way), and the interval must absorb that noise. With
the gate's own arithmetic (BCa, 95%; 300 to 400 simulated draws each) a candidate as
good as live passes with these odds:

=========  ========  ========  ========  ========
items      d = 2%    d = 3%    d = 4%    d = 5%
=========  ========  ========  ========  ========
100        0.81      0.75      0.67      0.66
150        0.92      0.87      0.81      0.74
200        0.99      0.95      0.92      0.88
=========  ========  ========  ========  ========

At 100 items (or 60) a single net lost item already fails (one loss in 100:
interval -0.051 to 0), so 200 is the size that works for a candidate that flips
up to about 4% of its answers. A simulated candidate of live's quality and seed
answers exactly as live does (d = 0) and passes at any size; with another seed
at quality 0.98 it differs on about 4% (passes 0.92 of the time at 200). The
judge's preference is held to the same threshold; the runner asks it only where
the two answers differ, so it adds no noise where they agree.

**Labelled pairs: 40**, ten per category (``min_labels`` defaults to 30): the first
items of each category carry a fixed pair of answers and the right verdict as the
human label: the right answer against a wrong one (``a`` or ``b``, 40% each) or
two right or two wrong answers (``tie``, 10% each), in a fixed rotation.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

DEFAULT_SEED = 15
DEFAULT_ITEMS = 200
DEFAULT_LABELLED = 40
DEFAULT_OUTPUT = "platform/evals/chat-default.jsonl"

_WORDS = (
    "lantern",
    "harbor",
    "violet",
    "compass",
    "thunder",
    "marble",
    "orchard",
    "falcon",
    "saddle",
    "copper",
    "pillow",
    "glacier",
    "basket",
    "cinder",
    "meadowlark",
    "timber",
    "quartz",
    "ribbon",
    "walnut",
    "beacon",
    "anchor",
    "pebble",
    "canyon",
    "feather",
    "mirror",
    "tunnel",
    "velvet",
    "cobalt",
    "juniper",
    "kettle",
)
_OTHER_WORDS = ("candle", "river", "window", "pepper", "garden", "silver")
_NAMES = ("Sam", "Ava", "Noor", "Kenji", "Lena", "Omar", "Ruth", "Tariq")
_THINGS = ("apples", "stamps", "marbles", "pencils", "shells", "coins")
_TOPICS = (
    "rivers",
    "winter mornings",
    "bread",
    "old maps",
    "bees",
    "lighthouses",
    "trains",
    "tea",
)
_FILLER = (
    "calm",
    "water",
    "moves",
    "past",
    "the",
    "old",
    "stone",
    "wall",
    "and",
    "light",
    "stays",
    "warm",
    "on",
    "hill",
    "while",
    "small",
    "birds",
    "rest",
    "near",
    "quiet",
    "road",
    "at",
    "end",
    "of",
    "day",
)
_SYSTEM = "You are a careful assistant. Answer briefly."
_CANNOT = "I cannot tell."


def _words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_FILLER) for _ in range(n))


def _maths(rng: random.Random) -> tuple[str, str, list[str], list[str]]:
    op = rng.choice("+-x")
    if op == "x":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        value = a * b
    else:
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        value = a + b if op == "+" else a - b
    delta = rng.randint(1, 9)
    rights = [str(value), f"The answer is {value}."]
    wrongs = [str(value + delta), str(value - delta - 1)]
    return f"What is {a} {op} {b}? Answer with the number.", str(value), rights, wrongs


def _general(rng: random.Random) -> tuple[str, str, list[str], list[str]]:
    word = rng.choice(_WORDS)
    other = rng.choice(_OTHER_WORDS)
    if rng.random() < 0.5:
        rights = [word, f"{word.capitalize()}."]
        return f"Reply with exactly this word: {word}", word, rights, [other, _CANNOT]
    reverse = word[::-1]
    prompt = f"Spell the word {word} backwards. Answer with the word."
    return prompt, reverse, [reverse, f"{reverse.capitalize()}."], [word, other]


def _reasoning(rng: random.Random) -> tuple[str, str, list[str], list[str]]:
    kind = rng.choice(("parity", "larger", "story"))
    if kind == "parity":
        n = rng.randint(1, 9999)
        right = "odd" if n % 2 else "even"
        wrong = "even" if n % 2 else "odd"
        prompt = f"Is {n} even or odd? Answer with one word."
        return prompt, right, [right, f"{right.capitalize()}."], [wrong, _CANNOT]
    if kind == "larger":
        a, b = rng.sample(range(-500, 1000), 2)
        prompt = f"Which is larger, {a} or {b}? Answer with the number."
        big, small = str(max(a, b)), str(min(a, b))
        return prompt, big, [big, f"{big}."], [small, _CANNOT]
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    have, buys = rng.randint(2, 60), rng.randint(1, 40)
    gives = rng.randint(1, have + buys)
    value = have + buys - gives
    prompt = (
        f"{name} has {have} {things} and buys {buys} more, then gives away "
        f"{gives}. How many {things} does {name} have now? Answer with the number."
    )
    wrongs = [str(have + buys + gives), _CANNOT]
    return prompt, str(value), [str(value), f"{value}."], wrongs


def _long_output(rng: random.Random) -> tuple[str, str, list[str], list[str]]:
    n = rng.randint(20, 80)
    prompt = f"Write exactly {n} words about {rng.choice(_TOPICS)}."
    reference = _words(n, rng)
    rights = [reference, _words(n, rng)]
    wrongs = [_words(n // 2, rng), _words(n - 5, rng)]  # cut short
    return prompt, reference, rights, wrongs


_BUILDERS = {
    "reasoning": _reasoning,
    "maths": _maths,
    "long_output": _long_output,
    "general": _general,
}


# Which pair the n-th labelled item gets, in turn: the right answer first or
# second (40% each), two right or two wrong answers (ties, 10% each).
_PAIR_KINDS = ("a", "b", "a", "b", "both right", "b", "a", "b", "a", "both wrong")


def _labelled_pair(
    rights: list[str], wrongs: list[str], kind: str
) -> tuple[dict[str, str], str]:
    """Return a fixed pair and the right verdict on it (the human label)."""
    if kind == "a":
        return {"a": rights[0], "b": wrongs[0]}, "a"
    if kind == "b":
        return {"a": wrongs[0], "b": rights[0]}, "b"
    if kind == "both right":
        return {"a": rights[0], "b": rights[1]}, "tie"
    return {"a": wrongs[0], "b": wrongs[1]}, "tie"


def build_eval_set(
    *,
    seed: int = DEFAULT_SEED,
    items: int = DEFAULT_ITEMS,
    labelled: int = DEFAULT_LABELLED,
) -> list[dict[str, Any]]:
    """Return the eval set's items (module docstring); the same for the same args.

    ``items`` per category; ``labelled`` pairs spread over the categories' first
    items, round robin.
    """
    if items < 1 or labelled < 0 or labelled > items * len(_BUILDERS):
        raise ValueError(
            "need at least one item per category and at most one labelled pair per item"
        )
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    per_category = {c: labelled // len(_BUILDERS) for c in _BUILDERS}
    for extra in list(_BUILDERS)[: labelled % len(_BUILDERS)]:
        per_category[extra] += 1
    labelled_so_far = 0
    for category, build in _BUILDERS.items():
        for n in range(items):
            prompt, reference, rights, wrongs = build(rng)
            messages = [{"role": "user", "content": prompt}]
            if n % 5 == 4:
                messages.insert(0, {"role": "system", "content": _SYSTEM})
            item: dict[str, Any] = {
                "id": f"{category}-{n:03d}",
                "category": category,
                "messages": messages,
                "reference": reference,
            }
            if n < per_category[category]:
                kind = _PAIR_KINDS[labelled_so_far % len(_PAIR_KINDS)]
                labelled_so_far += 1
                pair, label = _labelled_pair(rights, wrongs, kind)
                item["labelled_pair"] = pair
                item["human_label"] = label
            out.append(item)
    return out


def eval_set_lines(items: list[dict[str, Any]]) -> str:
    """Return the JSONL text of ``items``: one compact object a line, keys sorted."""
    return "".join(
        json.dumps(item, sort_keys=True, ensure_ascii=False) + "\n" for item in items
    )


class Command(BaseCommand):
    help = "Write the default chat eval set (deterministic for a seed)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
        parser.add_argument(
            "--items", type=int, default=DEFAULT_ITEMS, help="Items per category."
        )
        parser.add_argument(
            "--labelled",
            type=int,
            default=DEFAULT_LABELLED,
            help="Items that carry a labelled pair to check the judge.",
        )
        parser.add_argument("--output", default=DEFAULT_OUTPUT)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            items = build_eval_set(
                seed=options["seed"],
                items=options["items"],
                labelled=options["labelled"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        path = Path(options["output"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(eval_set_lines(items), encoding="utf-8")
        labelled = sum("human_label" in item for item in items)
        self.stdout.write(f"{path}: {len(items)} items, {labelled} labelled pairs")

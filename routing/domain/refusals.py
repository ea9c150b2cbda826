"""The refusal detector of the rollout guards: does an answer open with a refusal?

Public surface: ``RefusalDetector``, ``DEFAULT_REFUSAL_PATTERNS``,
``HEAD_CHARS``, ``parse_refusal_patterns``.

A version served with a broken chat template (or a bad fine-tune) answers "I am
sorry, I cannot help with that" to prompts the live version answers. The guards
compare the share of such answers between a canary and the live version, so the
detector only has to be the same on both sides, not perfect: each pattern is a
regular expression matched case-insensitively at the start of the answer, after
leading whitespace, on its first ``HEAD_CHARS`` characters (the gateway keeps only
the head of an answer it relays). Straight and curly apostrophes both match in the
defaults, as models write either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

__all__ = [
    "DEFAULT_REFUSAL_PATTERNS",
    "HEAD_CHARS",
    "RefusalDetector",
    "parse_refusal_patterns",
]

DEFAULT_REFUSAL_PATTERNS: tuple[str, ...] = (
    r"I\s+am\s+sorry",
    r"I['\u2019]m\s+sorry",
    r"I\s+cannot",
    r"I\s+can['\u2019]t",
    r"I\s+am\s+unable",
    r"I['\u2019]m\s+unable",
    r"As\s+an\s+AI\b",
)

# How much of an answer's text the detector reads: a refusal says so at once.
HEAD_CHARS = 256


def parse_refusal_patterns(raw: str) -> tuple[str, ...]:
    """Return the patterns of a JSON list of regular expressions (a setting).

    Raises:
        ValueError: not a JSON list of non-empty strings, or a pattern that is
            not a valid regular expression (the message names it and why).
    """
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(
            f'must be a JSON list of regular expressions (["I am sorry", ...]): {exc}'
        ) from None
    if not isinstance(value, list) or not all(
        isinstance(item, str) and item for item in value
    ):
        raise ValueError(
            "must be a JSON list of non-empty strings (regular expressions), "
            f"got {raw!r}"
        )
    patterns = tuple(value)
    for index, pattern in enumerate(patterns):
        try:
            re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise ValueError(
                f"pattern {index} ({pattern!r}) is not a valid regular expression: "
                f"{exc}"
            ) from None
    return patterns


class RefusalDetector:
    """Tell refusals from answers by how they begin.

    Built once (one compiled alternation of every pattern); ``is_refusal`` is one
    regex match on at most ``HEAD_CHARS`` characters.
    """

    __slots__ = ("_regex", "patterns")

    def __init__(self, patterns: Sequence[str] = DEFAULT_REFUSAL_PATTERNS) -> None:
        """Compile ``patterns``; an empty sequence detects nothing.

        Raises:
            re.error: a pattern is not a valid regular expression.
        """
        self.patterns = tuple(patterns)
        self._regex = (
            re.compile(
                r"\s*(?:"
                + "|".join(f"(?:{pattern})" for pattern in self.patterns)
                + ")",
                re.IGNORECASE,
            )
            if self.patterns
            else None
        )

    def is_refusal(self, text: str) -> bool:
        """Return True if ``text`` opens (after whitespace) with a refusal."""
        if self._regex is None:
            return False
        return self._regex.match(text, 0, HEAD_CHARS) is not None

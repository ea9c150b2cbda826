"""The one naming rule for teams, models and regions.

Public surface: ``is_valid_slug``, ``SLUG_RULE``.
"""

from __future__ import annotations

import re

__all__ = ["SLUG_PATTERN", "SLUG_RULE", "is_valid_slug"]

# \Z, not $: "$" also matches before a trailing newline ("chat-7b\n").
SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}\Z"
SLUG_RULE = (
    "1-64 lowercase letters, digits, '.', '-' or '_', starting with a letter or digit"
)
_SLUG = re.compile(SLUG_PATTERN)


def is_valid_slug(name: str) -> bool:
    """Return True for a name that follows the slug rule (so never contains '@')."""
    return _SLUG.fullmatch(name) is not None

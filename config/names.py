"""The naming rules of the API's paths and records: teams, models, regions, versions.

Public surface: ``is_valid_slug``, ``SLUG_PATTERN``, ``SLUG_RULE``,
``is_valid_version_label``, ``VERSION_PATTERN``.

Part of config's ground: the fields, the API base and every app name things by
these rules, so they live below all of them and import nothing of the platform.
"""

from __future__ import annotations

import re

__all__ = [
    "SLUG_PATTERN",
    "SLUG_RULE",
    "VERSION_PATTERN",
    "is_valid_slug",
    "is_valid_version_label",
]

# \Z, not $: "$" also matches before a trailing newline ("chat-7b\n").
SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}\Z"
SLUG_RULE = (
    "1-64 lowercase letters, digits, '.', '-' or '_', starting with a letter or digit"
)
VERSION_PATTERN = r"^v[1-9][0-9]{0,8}\Z"
_SLUG = re.compile(SLUG_PATTERN)
_VERSION = re.compile(VERSION_PATTERN)


def is_valid_slug(name: str) -> bool:
    """Return True for a name that follows the slug rule (so never contains '@')."""
    return _SLUG.fullmatch(name) is not None


def is_valid_version_label(label: str) -> bool:
    """Return True for ``v1``, ``v2``, ... ``v13`` ...: versions are numbered, never reused."""
    return _VERSION.fullmatch(label) is not None

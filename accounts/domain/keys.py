"""Secret generation and hashing for team API keys and admin tokens.

Public surface: ``KeyKind``, ``new_secret``, ``hash_secret``, ``display_prefix``,
``kind_of``.

Only the SHA-256 of a secret and a short display prefix are ever stored. A key is
shown once, when it is created. SHA-256 without a salt is right here (unlike for
passwords): the secrets carry 256 bits of randomness, so there is nothing to
brute-force, and an unsalted digest can be looked up with one index probe on the
hot path.
"""

from __future__ import annotations

import enum
import hashlib
import secrets

__all__ = [
    "DISPLAY_PREFIX_LEN",
    "SHA256_PATTERN",
    "KeyKind",
    "display_prefix",
    "hash_secret",
    "kind_of",
    "new_secret",
]

DISPLAY_PREFIX_LEN = 12
# Lowercase hex SHA-256; \Z so that a trailing newline does not pass. Also used
# by database check constraints (PostgreSQL's regex syntax knows \Z too).
SHA256_PATTERN = r"^[0-9a-f]{64}\Z"


class KeyKind(enum.StrEnum):
    """What a bearer secret opens: the OpenAI API for a team, or the control plane."""

    TEAM = "sk-team-"
    ADMIN = "sk-admin-"


def new_secret(kind: KeyKind) -> str:
    """Return a fresh secret of ``kind``: its marker followed by 43 url-safe characters."""
    return f"{kind.value}{secrets.token_urlsafe(32)}"


def hash_secret(secret: str) -> str:
    """Return the lowercase hex SHA-256 of ``secret``, the only form stored."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def display_prefix(secret: str) -> str:
    """Return the part of a secret that may be shown again: marker plus a few chars."""
    for kind in KeyKind:
        if secret.startswith(kind.value):
            return secret[: len(kind.value) + 4]
    return secret[:DISPLAY_PREFIX_LEN]


def kind_of(secret: str) -> KeyKind | None:
    """Return which kind of secret this looks like, or None for a foreign string."""
    for kind in KeyKind:
        if secret.startswith(kind.value):
            return kind
    return None

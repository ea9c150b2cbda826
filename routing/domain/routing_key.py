"""The key that pins a conversation to a replica, and stable fractions of a key.

Public surface: ``routing_key``, ``stable_fraction``.

Invariants:

- ``routing_key`` is ``"conv:" + conversation_id`` when the client sends one;
  otherwise ``"open:" + 32 hex digits`` hashed from the conversation's *opening*:
  every system/developer message before the first user message, plus that first
  user message. Later turns only append messages, so every turn of one chat gets
  the same key without an id, and two chats that open with the same system prompt
  and first question share a key (and so a warm prefix cache).
- ``stable_fraction`` depends only on its arguments (BLAKE2b, not ``hash()``), so
  every gateway process puts a conversation on the same side of a canary split.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

__all__ = ["routing_key", "stable_fraction"]

_OPENING_ROLES = frozenset({"system", "developer"})
_TWO_TO_53 = float(2**53)


def routing_key(conversation_id: str | None, messages: Sequence[object]) -> str:
    """Return the routing key of a chat request (see the module invariants).

    A conversation id is stripped; blank counts as absent. Message content may be a
    string, None, or a list of parts of which only ``{"type": "text"}`` parts count
    (images and other parts are ignored). Messages that are not mappings, and roles
    other than system/developer/user before the first user message, are ignored, so
    malformed input still yields a key rather than an error.
    """
    if conversation_id is not None:
        stripped = conversation_id.strip()
        if stripped:
            return "conv:" + stripped
    opening: list[tuple[str, str]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role == "user":
            opening.append(("user", _text_of(message.get("content"))))
            break
        if role in _OPENING_ROLES:
            opening.append((role, _text_of(message.get("content"))))
    # JSON of (role, text) pairs is unambiguous: no choice of texts can make two
    # different openings encode to the same bytes.
    encoded = json.dumps(opening, ensure_ascii=False, separators=(",", ":"))
    digest = hashlib.blake2b(encoded.encode("utf-8"), digest_size=16).hexdigest()
    return "open:" + digest


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


def stable_fraction(key: str, salt: str = "") -> float:
    """Return a number in [0, 1) fixed by ``key`` and ``salt``, spread uniformly.

    Different salts give independent fractions for the same key (a canary split
    and a shadow sample must not pick the same conversations).
    """
    data = f"{salt}\x00{key}".encode()
    digest = hashlib.blake2b(data, digest_size=8).digest()
    # 64 bits divided by 2**64 can round up to 1.0 in a double; keep 53 bits.
    return (int.from_bytes(digest, "big") >> 11) / _TWO_TO_53

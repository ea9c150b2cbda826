"""Where the gateways remember each conversation's version during a rollout.

Public surface: ``ConversationVersions`` (the protocol), ``RedisConversationVersions``,
``MemoryConversationVersions``, ``sticky_key``.

One key per model and conversation, ``<prefix>:sticky:<model>:<digest>`` (the
digest of the routing key, so a long conversation id makes a short key), holding
the version label, refreshed on every turn and gone ``ttl_s`` after the last one.
``choose`` is one Lua script: keep the remembered version if it may still take the
conversation, else remember what ``routing.domain.sticky.first_choice`` says (the
split's choice on a first turn, the live version for a chat under way), with
whether it was fresh. So every gateway process
sends a conversation's turns to one version (``routing.domain.sticky``). Only
models with a rollout on pay the round trip; when Redis fails the split's choice
stands (the hash split alone), and the failure is logged once per outage.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import redis
import redis.asyncio

from routing.domain.sticky import Remembered

logger = logging.getLogger(__name__)

__all__ = [
    "ConversationVersions",
    "MemoryConversationVersions",
    "RedisConversationVersions",
    "sticky_key",
]

# A conversation idle for this long starts again from the split.
DEFAULT_TTL_S = 3600
# After a failure, how long Redis is left alone (the split alone decides).
RETRY_AFTER_S = 1.0


def sticky_key(prefix: str, model: str, routing_key: str) -> str:
    """Return the Redis key remembering ``routing_key``'s version of ``model``."""
    digest = hashlib.blake2b(routing_key.encode(), digest_size=16).hexdigest()
    return f"{prefix}:sticky:{model}:{digest}"


class ConversationVersions(Protocol):
    """Remember a conversation's version; answer the one its turn goes to."""

    async def choose(
        self, model: str, routing_key: str, first: Remembered, allowed: Sequence[str]
    ) -> Remembered | None: ...


# KEYS: the conversation's key; ARGV: ttl, what to remember for a conversation
# seen the first time ("v3|f"), then the versions that may take it.
_CHOOSE = """
local remembered = redis.call('GET', KEYS[1])
if remembered then
  local version = string.match(remembered, '^(.*)|[bo]$')
  for i = 3, #ARGV do
    if ARGV[i] == version then
      redis.call('EXPIRE', KEYS[1], ARGV[1])
      return remembered
    end
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[1])
return ARGV[2]
"""


class RedisConversationVersions:
    """Conversation versions in the region's Redis, shared by its gateways."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        prefix: str,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._script = client.register_script(_CHOOSE)
        self._clock = clock
        self._failing = False
        self._retry_at = 0.0

    async def choose(
        self, model: str, routing_key: str, first: Remembered, allowed: Sequence[str]
    ) -> Remembered | None:
        """Return the conversation's remembered version if it is allowed, else
        remember ``first`` and return it.

        Never raises for Redis: None then, and the split alone decides (a
        conversation keeps its version at a fixed share, as before the memory).
        After a failure Redis is left alone for ``RETRY_AFTER_S``, so an outage
        costs no timeout per request.
        """
        if self._failing and self._clock() < self._retry_at:
            return None
        try:
            value = await self._script(
                keys=[sticky_key(self.prefix, model, routing_key)],
                args=[self.ttl_s, first.encode(), *allowed],
            )
        except (redis.RedisError, OSError) as exc:
            if not self._failing:
                logger.warning(
                    "conversation versions unavailable (%s): the canary split "
                    "alone decides until Redis answers",
                    type(exc).__name__,
                )
            self._failing = True
            self._retry_at = self._clock() + RETRY_AFTER_S
            return None
        self._failing = False
        text = value.decode() if isinstance(value, bytes) else str(value)
        remembered = Remembered.decode(text)
        if remembered is None or remembered.version not in allowed:
            return first
        return remembered


class MemoryConversationVersions:
    """Conversation versions in this process (the embedded default, one gateway).

    Bounded: past ``max_entries`` the least recently seen conversation is
    forgotten (its next turn counts as under way: the live version).
    """

    def __init__(self, *, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, str], Remembered] = OrderedDict()

    async def choose(
        self, model: str, routing_key: str, first: Remembered, allowed: Sequence[str]
    ) -> Remembered:
        key = (model, routing_key)
        remembered = self._seen.get(key)
        if remembered is not None and remembered.version in allowed:
            self._seen.move_to_end(key)
            return remembered
        self._seen[key] = first
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return first

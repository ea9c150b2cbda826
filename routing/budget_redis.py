"""Budget counters in Redis, shared by a region's gateways.

Public surface: ``RedisBudgetStore``.

The twin of ``routing.domain.budget.BudgetLedger``: the same reserve and adjust,
one Lua script each, atomic over every budget a request counts against (a team's
budget on all models and its budget on the model: both reserved or neither).
A counter is the string ``{prefix}:budget:{team}:{model or *}:{YYYY-MM}``, integer
nano-dollars (spend settled plus reservations in flight), kept until a day past
its month. Lua reads the counters as doubles: exact below 2^53 nano-dollars
(9 million USD), a few nano-dollars off above.
``routing/tests/test_budget_store.py`` holds this store equal to the ledger on
random histories.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from routing.domain.budget import BudgetLine, Reserved

__all__ = ["RedisBudgetStore"]

# KEYS: the counters; ARGV: amount, ttl_ms, then a seed and a limit per key.
_RESERVE_LUA = """
local amount = tonumber(ARGV[1])
local spent = {}
local texts = {}
local existed = {}
local refused = -1
for i = 1, #KEYS do
  local value = redis.call('GET', KEYS[i])
  existed[i] = value and true or false
  if value then spent[i] = tonumber(value) else spent[i] = tonumber(ARGV[1 + 2 * i]) end
  texts[i] = string.format('%d', spent[i])
  if refused < 0 and spent[i] + amount > tonumber(ARGV[2 + 2 * i]) then
    refused = i - 1
  end
end
if refused >= 0 then return {0, refused, texts} end
for i = 1, #KEYS do
  local total = string.format('%d', spent[i] + amount)
  if existed[i] then
    redis.call('SET', KEYS[i], total, 'KEEPTTL')
  else
    redis.call('SET', KEYS[i], total, 'PX', ARGV[2])
  end
end
return {1, -1, texts}
"""

# KEYS: the counters; ARGV: delta. An absent counter is left to its seed.
_ADJUST_LUA = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('INCRBY', KEYS[i], ARGV[1])
  end
end
return 1
"""


class RedisBudgetStore:
    """Reserve and settle budgets in Redis (one round trip each)."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._reserve = client.register_script(_RESERVE_LUA)
        self._adjust = client.register_script(_ADJUST_LUA)

    def counter_key(self, key: str) -> str:
        """Return the Redis key of a budget line's counter."""
        return f"{self.prefix}:budget:{key}"

    async def reserve(
        self, lines: Sequence[BudgetLine], amount: int, *, ttl_s: int
    ) -> Reserved:
        """Add ``amount`` to every line's counter unless one would pass its limit.

        ``ttl_s`` is how long a counter made now lives (to a day past its month).

        Raises:
            redis.RedisError: Redis is unreachable; the caller decides.
        """
        args: list[str] = [str(amount), str(ttl_s * 1000)]
        for line in lines:
            args += [str(line.seed_nano), str(line.limit_nano)]
        allowed, refused, texts = await self._reserve(
            keys=[self.counter_key(line.key) for line in lines], args=args
        )
        return Reserved(
            allowed=allowed == 1,
            spent_nano=tuple(int(text) for text in texts),
            refused=int(refused),
        )

    async def adjust(self, keys: Sequence[str], delta: int) -> None:
        """Add ``delta`` to the counters that exist."""
        if delta == 0 or not keys:
            return
        await self._adjust(
            keys=[self.counter_key(key) for key in keys], args=[str(delta)]
        )

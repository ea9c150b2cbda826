"""vLLM V1's KV block pool with automatic prefix caching (research spec §3).

Public surface: ``BlockPool``, ``HostBlockCache`` (the CPU offloading tier),
``host_blocks``, ``NONE_HASH``, ``hash_block_tokens``, ``hash_full_blocks``,
``max_cache_hit_blocks``.

- KV lives in blocks of ``block_size`` tokens. Block 0 is vLLM's *null block*: never
  allocated, never free, which is why usage divides by ``num_blocks - 1``.
- Only full blocks are hashed. A block's hash chains its parent's:
  ``H(parent_hash, tokens)`` where ``H`` is blake2b with an 8-byte digest over the
  parent as 8 little-endian bytes followed by the token ids as 8-byte signed
  little-endian integers, read back as an unsigned int. The first block's parent is
  ``NONE_HASH = H("vllm-none-hash")``. Equal content after a different prefix gives a
  different hash, so a hit is always a whole shared prefix. (vLLM's default is
  sha256 over a pickle; the hashes differ but the chaining and the hits are the same.)
- The free queue is an LRU ordered dict of block ids: allocation pops the head;
  ``free`` walks a request's blocks **last block first** and appends each block whose
  ref count drops to 0 to the tail, so a prefix's tail is evicted before its head.
  A freed block keeps its hash and stays hittable until it is popped; popping a block
  that still has a hash *evicts* it from the hash map (vLLM's ``BlockRemoved``).
- Touching a cached block (a hit) raises its ref count and takes it out of the free
  queue in O(1).
- At most one block per hash is in the map. A second block with the same content
  (two requests computing the same prefix in the same step) stays unhashed and is
  simply reused when freed; vLLM keeps both, which only matters if the first copy is
  evicted while the second survives.

KV events (``enable_kv_events``): the pool records what vLLM's block pool queues
for its publisher: ``BlockStored`` for each run of blocks ``cache_blocks``
registers (parent: the block before the run, None for a prompt's first block;
with the run's token ids), ``BlockRemoved`` for each hashed block ``allocate``
evicts, ``AllBlocksCleared`` on a reset. ``take_events`` hands them over and
empties the list; with events off nothing is recorded.

Invariants: ``0 <= num_free_blocks <= num_blocks - 1``; a block is in the free queue
iff its ref count is 0; every hash in the map names a block holding that hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from simengine.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

__all__ = [
    "NONE_HASH",
    "BlockPool",
    "HostBlockCache",
    "hash_block_tokens",
    "hash_full_blocks",
    "host_blocks",
    "max_cache_hit_blocks",
]

_NULL_BLOCK_ID = 0


def _digest_int(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


NONE_HASH: int = _digest_int(b"vllm-none-hash")


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Return the hash of one full block whose parent hashed to ``parent_hash``."""
    return _digest_int(
        parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    )


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int = NONE_HASH
) -> list[int]:
    """Return the chained hashes of every full block of ``token_ids`` (partial tail
    excluded)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(
            parent_hash, token_ids[start : start + block_size]
        )
        hashes.append(parent_hash)
    return hashes


def max_cache_hit_blocks(num_tokens: int, block_size: int) -> int:
    """Return the most blocks a request of ``num_tokens`` may take from the cache.

    The last token is always recomputed to get logits, so the hit is at most
    ``floor((num_tokens - 1) / block_size)`` blocks.
    """
    return max(num_tokens - 1, 0) // block_size


class BlockPool:
    """Allocate, share, free and evict KV blocks exactly as vLLM V1's block pool."""

    __slots__ = (
        "_block_hash",
        "_cached",
        "_events",
        "_free",
        "_ref_cnt",
        "block_size",
        "blocks_stored",
        "enable_caching",
        "evictions",
        "num_blocks",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (one is the null block)")
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._ref_cnt[_NULL_BLOCK_ID] = 1  # the null block is never free
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.evictions = 0  # cached blocks dropped from the map on reuse
        self.blocks_stored = 0  # blocks inserted into the map
        self._events: list[KVEvent] | None = [] if enable_kv_events else None

    # -- read-only state ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now, including cached blocks nobody references."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by hash (referenced or not)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Return ``kv_cache_usage_perc``: ``1 - free / (num_blocks - 1)``, in [0, 1].

        Cached blocks with ref count 0 count as free, so a warm idle cache reads 0.
        """
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def ref_count(self, block_id: int) -> int:
        """Return the number of requests holding ``block_id``."""
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """Return the hash ``block_id`` is cached under, or None."""
        return self._block_hash[block_id]

    def free_queue(self) -> list[int]:
        """Return the free block ids, head (next evicted) first. O(num_blocks)."""
        return list(self._free)

    # -- prefix lookup -----------------------------------------------------------------

    def cached_block_ids(
        self, block_hashes: Sequence[int], max_blocks: int | None = None
    ) -> list[int]:
        """Return the ids of the leading blocks of ``block_hashes`` that are cached.

        The walk stops at the first miss and after ``max_blocks`` blocks. Nothing is
        touched: call ``touch`` once the request is actually scheduled.
        """
        if not self.enable_caching:
            return []
        limit = len(block_hashes) if max_blocks is None else max_blocks
        cached = self._cached
        hits = []
        for block_hash in block_hashes[:limit]:
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def lookup(self, block_hashes: Sequence[int], num_tokens: int | None = None) -> int:
        """Return the number of leading cached blocks a request may reuse.

        With ``num_tokens`` (the request's token count), the hit is capped at
        ``max_cache_hit_blocks(num_tokens)``, i.e. ``floor((n - 1) / B) * B`` tokens.
        """
        limit = None
        if num_tokens is not None:
            limit = max_cache_hit_blocks(num_tokens, self.block_size)
        return len(self.cached_block_ids(block_hashes, limit))

    def num_evictable(self, block_ids: Iterable[int]) -> int:
        """Return how many of ``block_ids`` sit in the free queue (touching them will
        use up free blocks)."""
        ref_cnt = self._ref_cnt
        return sum(1 for block_id in block_ids if ref_cnt[block_id] == 0)

    # -- allocation --------------------------------------------------------------------

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each block, pulling unreferenced ones off the free
        queue."""
        ref_cnt = self._ref_cnt
        free = self._free
        for block_id in block_ids:
            if ref_cnt[block_id] == 0:
                del free[block_id]
            ref_cnt[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the free-queue head, each with ref count 1.

        A popped block that still carries a hash is evicted from the hash map first.

        Raises:
            ValueError: fewer than ``num_blocks`` blocks are free (check first).
        """
        free = self._free
        if num_blocks > len(free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(free)} free")
        ref_cnt = self._ref_cnt
        block_hash = self._block_hash
        allocated = []
        for _ in range(num_blocks):
            block_id = free.popitem(last=False)[0]
            old_hash = block_hash[block_id]
            if old_hash is not None:
                block_hash[block_id] = None
                if self._cached.get(old_hash) == block_id:
                    del self._cached[old_hash]
                    self.evictions += 1
                    if self._events is not None:
                        self._events.append(BlockRemoved((old_hash,)))
            ref_cnt[block_id] = 1
            allocated.append(block_id)
        return allocated

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each of a request's blocks, last block first; blocks
        reaching ref count 0 go to the free-queue tail, keeping their hash."""
        ref_cnt = self._ref_cnt
        free = self._free
        for block_id in reversed(block_ids):
            count = ref_cnt[block_id] - 1
            ref_cnt[block_id] = count
            if count == 0:
                free[block_id] = None
            elif count < 0:
                raise ValueError(f"block {block_id} freed more often than taken")

    def free_first(self, block_ids: Sequence[int]) -> None:
        """``free``, with one difference: blocks reaching ref count 0 that hold no
        hash go to the free-queue head, to be reused before any cached block (a
        request whose KV no one can match, such as a batch line, then recycles
        its own blocks instead of evicting others' cached prefixes)."""
        self.free(block_ids)
        free = self._free
        block_hash = self._block_hash
        for block_id in block_ids:
            if block_id in free and block_hash[block_id] is None:
                free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full, computed block under ``block_hash``.

        Returns False (and leaves the block unhashed) when caching is off, the block
        already has a hash, or another block already holds this hash.
        """
        if not self.enable_caching or self._block_hash[block_id] is not None:
            return False
        if block_hash in self._cached:
            return False
        self._block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        self.blocks_stored += 1
        return True

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        start: int,
        stop: int,
        token_ids: Sequence[int],
    ) -> int:
        """Register a request's full blocks ``start..stop-1`` (``cache_block`` each);
        return how many were new.

        ``token_ids`` are those blocks' tokens (``(stop - start) * block_size``);
        they are read only with events on, where each run of newly registered
        blocks is one ``BlockStored`` chained to the block before it.
        """
        events = self._events
        stored = 0
        run_start = -1
        for k in range(start, stop):
            if self.cache_block(block_ids[k], block_hashes[k]):
                stored += 1
                if run_start < 0:
                    run_start = k
                continue
            if events is not None and run_start >= 0:
                self._record_stored(block_hashes, run_start, k, start, token_ids)
            run_start = -1
        if events is not None and run_start >= 0:
            self._record_stored(block_hashes, run_start, stop, start, token_ids)
        return stored

    def _record_stored(
        self,
        block_hashes: Sequence[int],
        first: int,
        stop: int,
        offset: int,
        token_ids: Sequence[int],
    ) -> None:
        assert self._events is not None
        size = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=tuple(block_hashes[first:stop]),
                parent_block_hash=block_hashes[first - 1] if first else None,
                token_ids=tuple(
                    token_ids[(first - offset) * size : (stop - offset) * size]
                ),
                block_size=size,
            )
        )

    def take_events(self) -> list[KVEvent]:
        """Return the KV events recorded since the last call (none with events
        off) and forget them."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, as vLLM's ``reset_prefix_cache``; only when no block is
        referenced. Returns whether it reset."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True


class HostBlockCache:
    """vLLM's CPU offloading tier: KV blocks copied to host memory, found by hash.

    What vLLM 0.32 does with ``--kv-offloading-size N`` (``--kv-offloading-backend
    native``: its ``OffloadingConnector`` with the CPU manager and the LRU policy),
    reduced to what decides hits:

    - ``num_blocks`` host blocks (``N`` GiB over ``block_size`` tokens times the
      model's KV bytes per token: ``host_blocks``); an LRU of block hashes.
    - Every full block a request computes (prompt and answer) is stored once it is
      computed (``store``); a block already there moves to the tail instead. Storing
      past capacity evicts from the head.
    - A request that misses in the GPU pool looks up the blocks that follow its GPU
      hit (``lookup``): the run of consecutive stored hashes is loaded into its
      freshly allocated GPU blocks before it prefills the rest, and those blocks
      move to the tail (``touch``).

    Blocks no later request can match (the fleet simulator hashes only the blocks
    on a conversation's stream) still take host space: ``store_unmatched`` adds
    that many entries no lookup finds. Counters: ``blocks_stored``,
    ``blocks_loaded``, ``evictions``. ``evicted_log`` (None unless a caller that
    publishes KV events sets a list) gets every evicted hash, anonymous ones too.

    Invariant: ``len(self) <= num_blocks``.
    """

    __slots__ = (
        "_blocks",
        "_next_anonymous",
        "blocks_loaded",
        "blocks_stored",
        "evicted_log",
        "evictions",
        "num_blocks",
    )

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("a host cache needs at least one block")
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._next_anonymous = -1  # keys below 0 are never looked up
        self.blocks_stored = 0
        self.blocks_loaded = 0
        self.evictions = 0
        self.evicted_log: list[int] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def lookup(self, block_hashes: Sequence[int], start: int, stop: int) -> int:
        """Return how many of ``block_hashes[start:stop]``, from ``start`` on, are
        stored without a gap. Nothing moves."""
        blocks = self._blocks
        found = 0
        for block_hash in block_hashes[start:stop]:
            if block_hash not in blocks:
                break
            found += 1
        return found

    def touch(self, block_hashes: Iterable[int]) -> None:
        """Move stored blocks to the tail (loaded by a request) and count them."""
        blocks = self._blocks
        for block_hash in block_hashes:
            blocks.move_to_end(block_hash)
            self.blocks_loaded += 1

    def store(self, block_hashes: Iterable[int]) -> int:
        """Store computed blocks (a stored one moves to the tail); return how many
        were new."""
        blocks = self._blocks
        new = 0
        for block_hash in block_hashes:
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
                continue
            blocks[block_hash] = None
            new += 1
        self.blocks_stored += new
        self._evict()
        return new

    def store_unmatched(self, count: int) -> None:
        """Store ``count`` blocks no lookup will ever find (space, not hits)."""
        if count <= 0:
            return
        blocks = self._blocks
        key = self._next_anonymous
        for _ in range(count):
            blocks[key] = None
            key -= 1
        self._next_anonymous = key
        self.blocks_stored += count
        self._evict()

    def _evict(self) -> None:
        blocks = self._blocks
        over = len(blocks) - self.num_blocks
        log = self.evicted_log
        for _ in range(over):
            evicted = blocks.popitem(last=False)[0]
            if log is not None:
                log.append(evicted)
        if over > 0:
            self.evictions += over


def host_blocks(offload_gib: float, block_size: int, kv_bytes_per_token: int) -> int:
    """Return the host blocks ``--kv-offloading-size offload_gib`` holds."""
    if offload_gib < 0 or block_size < 1 or kv_bytes_per_token < 1:
        raise ValueError("offload size, block size and KV bytes must be positive")
    return int(offload_gib * (1 << 30) // (block_size * kv_bytes_per_token))

"""Which replica of a pool holds which prompt blocks, learned from its KV events.

Public surface: ``PrefixIndex``, ``prompt_block_keys``.

One index per pool (model, version). Replicas publish what their prefix caches
store and evict (``simengine.domain.kv_events``); the index keeps, per block
*key*, the set of replicas that hold it, and answers one question on the request
path: for this prompt's chain of block keys, how many leading tokens does each
replica hold (``match``)?

- **Keys from content.** A ``BlockStored`` event carries the blocks' token ids, so
  a block's key is Python's ``hash((parent_key, *block tokens))``, chained from
  ``ROOT_KEY``: the same function the gateway applies to a tokenized prompt
  (``prompt_block_keys``), so the index never needs the engine's hash function
  (vLLM's is sha256 over a pickle, seeded per process). Tuples of ints hash the
  same in every process (no ``PYTHONHASHSEED`` salt), at a fifth of a blake2b
  chain's cost; a collision (64 bits) could only misroute, never mis-serve. The engine's hash of each
  block is remembered per replica only to resolve a later event's parent and its
  removals. An event without token ids (the fleet simulator's synthetic blocks)
  keys its blocks by the engine's hashes themselves, which the caller then
  computes the same way for its requests.
- **A block whose parent is unknown is not indexed**, nor are the blocks after it
  in the event: its key depends on a prefix the index never saw (lost events, or a
  subscription that began mid-stream). Such blocks are under-counted, never
  invented.
- **Lost events cannot leave phantoms for long.** Every batch carries the
  publisher's sequence number. A gap (a batch lost) clears the replica's entries:
  a lost ``BlockRemoved`` would otherwise leave blocks the replica no longer has.
  A number at or below the last one means the publisher restarted (its cache is
  empty): the entries go too. ``forget`` drops a replica that left the pool, and
  ``expire`` one not heard from for a while, for callers that want it.
- **Bounded.** Each replica keeps at most ``max_blocks_per_replica`` entries; past
  that its oldest entries are dropped first (an engine's cache is finite, so the
  cap only bites when removals were lost).
- **Cheap lookups.** Holders are a bit mask per key (one bit per replica), so
  ``match`` walks the prompt's keys once, AND-ing masks, and stops when no
  replica holds the next block.

Media: a block stored on the host tier (``medium`` "CPU", vLLM's offloading) is
held as well as one on the GPU; a replica holds a block while it has it in any
medium. Not thread-safe: one index per event loop.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from simengine.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

__all__ = ["ROOT_KEY", "PrefixIndex", "prompt_block_keys"]

# The parent key of a prompt's first block.
ROOT_KEY = 0

# Upper bound on a replica's entries (blocks x media): ~32M tokens of 16-token
# blocks, more than any one replica's GPU and host caches hold.
DEFAULT_MAX_BLOCKS_PER_REPLICA = 1 << 21


def prompt_block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Return the chained keys of the full blocks of ``token_ids``."""
    keys = []
    parent = ROOT_KEY
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start : start + block_size]))
        keys.append(parent)
    return keys


class _Replica:
    __slots__ = ("bit", "blocks", "heard_at", "media", "seq")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        # (medium, engine hash) -> key, in the order stored (oldest first).
        self.blocks: dict[tuple[str, int], int] = {}
        self.media: list[str] = ["GPU"]  # every medium it has stored in
        self.seq: int | None = None
        self.heard_at = 0.0


class PrefixIndex:
    """One pool's block keys and the replicas that hold them.

    Invariants: ``_holders[key]`` has replica ``r``'s bit iff some entry of
    ``r.blocks`` maps to ``key``; the counts in ``_refs`` are the number of such
    entries per (bit, key); no key maps to an empty mask.
    """

    def __init__(
        self, *, max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA
    ) -> None:
        if max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be positive")
        self.max_blocks_per_replica = max_blocks_per_replica
        self.block_size: int | None = None
        self._replicas: dict[str, _Replica] = {}
        self._holders: dict[int, int] = {}
        # (bit, key) -> entries of that replica with that key (one per medium).
        self._refs: dict[tuple[int, int], int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self.cleared = 0  # replicas' entries dropped for a gap or a restart

    # -- reading ----------------------------------------------------------------------

    @property
    def replicas(self) -> frozenset[str]:
        """Return the replicas the index has heard from."""
        return frozenset(self._replicas)

    def blocks(self, replica_id: str | None = None) -> int:
        """Return how many entries (blocks x media) a replica has in the index;
        without one, every replica's."""
        if replica_id is None:
            return sum(len(replica.blocks) for replica in self._replicas.values())
        replica = self._replicas.get(replica_id)
        return len(replica.blocks) if replica is not None else 0

    def match(self, keys: Sequence[int], prompt_tokens: int) -> dict[str, int]:
        """Return each replica's cached leading tokens of a prompt with ``keys``.

        At most ``(prompt_tokens - 1) // block_size`` blocks count, as an engine
        always computes the last prompt token. Replicas holding none are left out.
        """
        block_size = self.block_size
        if block_size is None or not keys or not self._replicas:
            return {}
        limit = min(len(keys), max(prompt_tokens - 1, 0) // block_size)
        holders = self._holders
        matched: dict[int, int] = {}  # bit -> blocks
        mask = -1
        depth = 0
        while depth < limit:
            held = holders.get(keys[depth], 0)
            lost = mask & ~held if depth else 0
            if lost:
                _settle(matched, lost, depth)
            mask = held if not depth else mask & held
            if not mask:
                break
            depth += 1
        if mask > 0 and depth:
            _settle(matched, mask, depth)
        if not matched:
            return {}
        by_bit = {replica.bit: rid for rid, replica in self._replicas.items()}
        return {
            by_bit[bit]: blocks * block_size
            for bit, blocks in matched.items()
            if bit in by_bit
        }

    # -- writing ----------------------------------------------------------------------

    def apply(self, replica_id: str, seq: int, batch: EventBatch, now: float) -> None:
        """Apply one published batch of a replica (sequence number ``seq``)."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            replica = self._replicas[replica_id] = _Replica(self._take_bit())
        elif replica.seq is not None and seq != replica.seq + 1:
            # A lost batch (or a restarted publisher): what it held is unknown.
            self._clear(replica)
            self.cleared += 1
        replica.seq = seq
        replica.heard_at = now
        for event in batch.events:
            self._apply_event(replica, event)

    def forget(self, replica_id: str) -> None:
        """Drop a replica and everything it held (it left the pool)."""
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            return
        self._clear(replica)
        self._free_bits.append(replica.bit)

    def retain(self, replica_ids: Collection[str]) -> None:
        """Forget every replica not in ``replica_ids``."""
        for replica_id in [r for r in self._replicas if r not in replica_ids]:
            self.forget(replica_id)

    def expire(self, now: float, silent_s: float) -> list[str]:
        """Forget the replicas not heard from in ``silent_s``; return their ids."""
        gone = [r for r, rep in self._replicas.items() if now - rep.heard_at > silent_s]
        for replica_id in gone:
            self.forget(replica_id)
        return gone

    # -- internals --------------------------------------------------------------------

    def _take_bit(self) -> int:
        if self._free_bits:
            return self._free_bits.pop()
        self._next_bit += 1
        return self._next_bit - 1

    def _apply_event(self, replica: _Replica, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._stored(replica, event)
        elif isinstance(event, BlockRemoved):
            medium = event.medium or "GPU"
            for engine_hash in event.block_hashes:
                key = replica.blocks.pop((medium, engine_hash), None)
                if key is not None:
                    self._unhold(replica.bit, key)
        elif isinstance(event, AllBlocksCleared):
            self._clear(replica)

    def _stored(self, replica: _Replica, event: BlockStored) -> None:
        parent = self._first_parent(replica, event)
        if parent is None:
            return
        block_size = event.block_size
        medium = event.medium or "GPU"
        if medium not in replica.media:
            replica.media.append(medium)
        tokens = event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            if tokens:
                key = hash((parent, *tokens[i * block_size : (i + 1) * block_size]))
            else:
                key = engine_hash
            entry = (medium, engine_hash)
            old = replica.blocks.pop(entry, None)
            if old is not None:
                self._unhold(replica.bit, old)
            replica.blocks[entry] = key
            self._hold(replica.bit, key)
            parent = key
        while len(replica.blocks) > self.max_blocks_per_replica:
            oldest = next(iter(replica.blocks))
            self._unhold(replica.bit, replica.blocks.pop(oldest))

    def _first_parent(self, replica: _Replica, event: BlockStored) -> int | None:
        """Return the key the event's first block chains from; None: skip the event
        (a stray block size, too few token ids, or a parent the index never saw)."""
        block_size = event.block_size
        if block_size < 1:
            return None
        if self.block_size is None:
            self.block_size = block_size
        elif block_size != self.block_size:
            return None  # a pool's engines share one block size
        tokens = event.token_ids
        if tokens and len(tokens) < block_size * len(event.block_hashes):
            return None
        if event.parent_block_hash is None:
            return ROOT_KEY
        known = _find(replica, event.parent_block_hash)
        if known is not None:
            return known
        # Keyed by content, the key depends on a prefix the index never saw;
        # keyed by engine hashes, the parent's own hash is its key.
        return None if tokens else event.parent_block_hash

    def _hold(self, bit: int, key: int) -> None:
        ref = (bit, key)
        count = self._refs.get(ref, 0)
        self._refs[ref] = count + 1
        if not count:
            self._holders[key] = self._holders.get(key, 0) | (1 << bit)

    def _unhold(self, bit: int, key: int) -> None:
        ref = (bit, key)
        count = self._refs.get(ref, 0)
        if count > 1:
            self._refs[ref] = count - 1
            return
        self._refs.pop(ref, None)
        left = self._holders.get(key, 0) & ~(1 << bit)
        if left:
            self._holders[key] = left
        else:
            self._holders.pop(key, None)

    def _clear(self, replica: _Replica) -> None:
        for key in replica.blocks.values():
            self._unhold(replica.bit, key)
        replica.blocks.clear()


def _find(replica: _Replica, engine_hash: int) -> int | None:
    """Return the key of a replica's block by its engine hash, in any medium."""
    for medium in replica.media:
        key = replica.blocks.get((medium, engine_hash))
        if key is not None:
            return key
    return None


def _settle(matched: dict[int, int], bits: int, depth: int) -> None:
    """Record ``depth`` matched blocks for every replica bit set in ``bits``."""
    while bits:
        low = bits & -bits
        matched[low.bit_length() - 1] = depth
        bits ^= low

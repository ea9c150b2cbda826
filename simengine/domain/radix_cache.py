"""SGLang's radix-tree prefix cache (``RadixCache``, page size 1), as a pure model.

Public surface: ``RadixCache``, ``RadixNode``, ``Match``.

SGLang keeps every cached token sequence in one radix tree
(``python/sglang/srt/mem_cache/radix_cache.py``): each edge holds a run of token
ids and their KV slots, children are found by their first token, and a request
reuses the longest cached prefix of its input *to the token*, not to a 16-token
block as vLLM's block cache does. This model keeps the tree's behaviour and
counts tokens; the KV slots themselves are the caller's:

- **Match.** ``match_prefix(key)`` walks from the root and returns how many
  leading tokens are cached and the deepest node of the match. A match that ends
  inside an edge *splits* it there (SGLang's ``_split_node``), so the node
  returned covers exactly the match and can be locked. Every node on the path
  gets a new access tick (SGLang's ``last_access_time``; a counter here, so the
  model is deterministic).
- **Insert.** ``insert(key)`` adds the part of ``key`` not yet in the tree as a
  new leaf and returns the length that was already there: SGLang frees the
  caller's copies of those tokens (another request cached them first) and keeps
  the rest in the tree. SGLang inserts a request's prompt when it is computed
  and all of its tokens when it finishes.
- **Locks.** A running request locks the node of its match
  (``lock``/``unlock``: SGLang's ``inc_lock_ref``/``dec_lock_ref``, up to the
  root). Locked tokens are *protected*, the rest *evictable*.
- **Evict.** ``evict(n)`` removes unlocked leaves, least recently used first,
  until ``n`` tokens are gone (whole nodes, so it may free a few more); a parent
  left without children becomes a leaf and a candidate in turn. SGLang scans the
  tree for leaves on every call; a heap of candidates kept as the tree changes
  gives the same order in O(log n).

Keys are sequences of ints: tuples of token ids (lists are copied to tuples),
or ``range`` objects for synthetic token streams (the fleet simulator's: a
range compares and slices in O(1)). One tree holds one kind; a tuple never
equals a range.

KV events (``kv_block_size``: SGLang's ``--kv-events-config``, which publishes
pages): the tree's tokens are read as blocks of ``kv_block_size`` from the root,
chained as vLLM's block hashes are (``prefix_cache.hash_full_blocks``). An insert
records one ``BlockStored`` for the full blocks it completes (parent: the block
before them, None at the root); deleting a leaf records one ``BlockRemoved`` for
the announced blocks that had a token in it; ``reset`` records
``AllBlocksCleared`` alone. ``take_events`` hands them over.

Invariants: ``total_size == evictable_size + protected_size``; a node's
``lock_ref`` is at least each child's; every leaf with ``lock_ref == 0`` is in
the candidate heap.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from simengine.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from simengine.domain.prefix_cache import hash_full_blocks

__all__ = ["Match", "RadixCache", "RadixNode"]

Key = tuple[int, ...] | range


class RadixNode:
    """One edge of the tree and the node it leads to."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "node_id", "parent")

    def __init__(self, key: Key, parent: RadixNode | None, node_id: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.node_id = node_id

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True, slots=True)
class Match:
    """A prefix match: ``length`` leading tokens cached, ending at ``node``."""

    length: int
    node: RadixNode


def _as_key(tokens: Sequence[int]) -> Key:
    if isinstance(tokens, range | tuple):
        return tokens
    return tuple(tokens)


def _common_prefix(a: Key, b: Key) -> int:
    """Return the length of the longest common prefix of ``a`` and ``b``.

    A binary search on slice equality: O(log n) comparisons, each done in C (and
    O(1) for ranges), instead of a Python loop over every token.
    """
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixCache:
    """A radix tree of cached token sequences with SGLang's match, insert, lock
    and LRU-leaf eviction.

    Read-only counters: ``total_size`` (tokens in the tree), ``evictable_size``,
    ``protected_size``, ``evicted_tokens`` and ``inserted_tokens``.
    """

    def __init__(self, *, kv_block_size: int | None = None) -> None:
        if kv_block_size is not None and kv_block_size < 1:
            raise ValueError("kv_block_size must be positive")
        self.kv_block_size = kv_block_size
        self._events: list[KVEvent] | None = [] if kv_block_size else None
        self._ids = itertools.count()
        self.root = RadixNode((), None, next(self._ids))
        self.root.lock_ref = 1  # the root is never evicted
        self._tick = 0
        self.total_size = 0
        self.evictable_size = 0
        self.protected_size = 0
        self.evicted_tokens = 0
        self.inserted_tokens = 0
        # Eviction candidates: (last access, node id, node); stale entries are
        # skipped when popped.
        self._leaves: list[tuple[int, int, RadixNode]] = []

    # -- reads -------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int]) -> Match:
        """Return the longest cached prefix of ``tokens``, splitting the edge it
        ends in; every node on the path is touched."""
        key = _as_key(tokens)
        tick = self._next_tick()
        node = self.root
        node.last_access = tick
        matched = 0
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            n = _common_prefix(child.key, key[matched:])
            inside = n < len(child.key)
            if inside:
                child = self._split(child, n)
            child.last_access = tick
            self._candidate(child)
            node = child
            matched += n
            if inside:
                break
        return Match(matched, node)

    def nodes(self) -> Iterator[RadixNode]:
        """Yield every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- writes ------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int]) -> int:
        """Add ``tokens`` to the tree; return how many leading tokens it already held
        (the caller's copies of those are duplicates, freed)."""
        key = _as_key(tokens)
        tick = self._next_tick()
        node = self.root
        matched = 0
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            n = _common_prefix(child.key, key[matched:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            self._candidate(child)
            node = child
            matched += n
        if matched < len(key):
            leaf = RadixNode(key[matched:], node, next(self._ids))
            leaf.last_access = tick
            node.children[leaf.key[0]] = leaf
            size = len(leaf.key)
            self.total_size += size
            self.inserted_tokens += size
            # A new leaf is unlocked (its parent may be locked; locks go rootward).
            self.evictable_size += size
            self._candidate(leaf)
            if self._events is not None:
                self._record_stored(key, matched)
        return matched

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (a request uses them)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            parent = node.parent
            assert parent is not None
            node = parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
                self._candidate(node)
            parent = node.parent
            assert parent is not None
            node = parent

    def evict(self, num_tokens: int) -> int:
        """Remove unlocked leaves, least recently used first, until ``num_tokens``
        tokens are gone or none is left; return the tokens removed."""
        evicted = 0
        leaves = self._leaves
        while evicted < num_tokens and leaves:
            access, _, node = heapq.heappop(leaves)
            if (
                node.parent is None  # removed already
                or node.children
                or node.lock_ref > 0
                or node.last_access != access
            ):
                continue
            evicted += self._delete_leaf(node)
        self.evicted_tokens += evicted
        return evicted

    def reset(self) -> bool:
        """Drop every unlocked token (SGLang's ``/flush_cache``); False if a
        request still holds part of the tree, as SGLang refuses then."""
        if self.protected_size:
            return False
        events = self._events
        recorded = len(events) if events is not None else 0
        self.evict(self.total_size)
        if events is not None:
            del events[recorded:]  # one AllBlocksCleared stands for them
            events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Return the KV events recorded since the last call and forget them."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    # -- internals ---------------------------------------------------------------------

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _candidate(self, node: RadixNode) -> None:
        if not node.children and node.lock_ref == 0 and node.parent is not None:
            heapq.heappush(self._leaves, (node.last_access, node.node_id, node))

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Split ``child``'s edge after ``at`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper = RadixNode(child.key[:at], parent, next(self._ids))
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _record_stored(self, key: Key, cached: int) -> None:
        """Record the full blocks of ``key`` past its first ``cached`` tokens."""
        size = self.kv_block_size
        assert self._events is not None and size is not None
        first, stop = cached // size, len(key) // size
        if stop <= first:
            return
        hashes = hash_full_blocks(key[: stop * size], size)
        self._events.append(
            BlockStored(
                block_hashes=tuple(hashes[first:]),
                parent_block_hash=hashes[first - 1] if first else None,
                token_ids=tuple(key[first * size : stop * size]),
                block_size=size,
            )
        )

    def _record_removed(self, node: RadixNode) -> None:
        """Record the announced blocks with a token in leaf ``node``."""
        size = self.kv_block_size
        assert self._events is not None and size is not None
        keys = []
        walk: RadixNode | None = node
        while walk is not None and walk is not self.root:
            keys.append(walk.key)
            walk = walk.parent
        path = tuple(itertools.chain.from_iterable(reversed(keys)))
        start = len(path) - len(node.key)
        first, stop = start // size, len(path) // size
        if stop <= first:
            return
        hashes = hash_full_blocks(path[: stop * size], size)
        self._events.append(BlockRemoved(tuple(hashes[first:])))

    def _delete_leaf(self, node: RadixNode) -> int:
        parent = node.parent
        assert parent is not None
        if self._events is not None:
            self._record_removed(node)
        del parent.children[node.key[0]]
        node.parent = None
        size = len(node.key)
        self.total_size -= size
        self.evictable_size -= size
        self._candidate(parent)
        return size

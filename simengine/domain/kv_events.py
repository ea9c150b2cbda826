"""vLLM's KV-cache events: what a replica says it stored in and dropped from its
prefix cache, as typed values (the wire codec lives beside them).

Public surface: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
``KVEvent``, ``EventBatch``, ``KVEventError``.

vLLM (``--kv-events-config``) and SGLang publish one batch per scheduler step that
had events, over ZMQ PUB as three frames: the topic, the sequence number (8 bytes,
big-endian) and the msgpack batch ``[ts, events, data_parallel_rank]``
(research: sim-engine.md section 4.8, vllm-cpu.md). The simulated replica
publishes the same, and the gateway's prefix index reads it.

- ``BlockStored``: full blocks that became cached, in order; the first one's parent
  is ``parent_block_hash`` (None: the first block of a prompt), each later block's
  parent is the one before it. ``token_ids`` are the tokens of all the blocks
  (``block_size`` each), so a reader can key the blocks by content without the
  engine's hash function.
- ``BlockRemoved``: cached blocks evicted (a finished request does not remove its
  blocks; eviction on reuse does).
- ``AllBlocksCleared``: the prefix cache was reset.

Hashes are integers: vLLM sends the low 64 bits of its digest by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); a reader turns byte hashes into
integers the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "KVEventError",
]


class KVEventError(ValueError):
    """A frame or batch that is not a KV event batch (the message says why)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became cached, first block's parent given, in chain order."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = "GPU"
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks evicted from ``medium``."""

    block_hashes: tuple[int, ...]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The replica's prefix cache was emptied."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One scheduler step's events, as published."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None

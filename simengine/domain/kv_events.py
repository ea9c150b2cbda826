"""vLLM's KV-cache events: what a replica says it stored in and dropped from its
prefix cache, as typed values (the wire codec lives beside them).

Public surface: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
``KVEvent``, ``EventBatch``, ``KVEventError``, ``encode_batch``, ``decode_batch``,
``pack_frames``, ``unpack_frames``.

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

The codec writes what vLLM 0.32 writes: the batch as an array, each event as a map
tagged by ``"type"`` with vLLM's keys in vLLM's order, the fields we do not model
at vLLM's values (``lora_id`` None, ``extra_keys`` one None per block, ``group_idx``
0, ``kv_cache_spec_kind`` ``"full_attention"``). It reads that and the older
array-encoded events (``["BlockStored", hashes, parent, ...]``); event types it
does not know are skipped, anything else malformed is a ``KVEventError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "KVEventError",
    "decode_batch",
    "encode_batch",
    "pack_frames",
    "unpack_frames",
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


_ENCODER = msgspec.msgpack.Encoder()
_U64 = (1 << 64) - 1


def _stored_map(event: BlockStored) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(event.block_hashes),
        "parent_block_hash": event.parent_block_hash,
        "token_ids": list(event.token_ids),
        "block_size": event.block_size,
        "lora_id": None,
        "medium": event.medium,
        "lora_name": event.lora_name,
        "extra_keys": [None] * len(event.block_hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def _event_map(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return _stored_map(event)
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
            "group_idx": 0,
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    """Return ``batch`` as vLLM 0.32's msgpack payload.

    The batch is the array ``[ts, events, data_parallel_rank]``; a None rank is
    left off, as msgspec's ``omit_defaults`` leaves off a trailing default.
    """
    body: list[Any] = [float(batch.ts), [_event_map(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return _ENCODER.encode(body)


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVEventError(f"{what} must be an integer, not {type(value).__name__}")
    return value


def _hash(value: object, what: str) -> int:
    """Return a block hash as vLLM's int mode does (low 64 bits, big-endian)."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & _U64
    return _int(value, what)


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise KVEventError(f"{what} must be an array, not {type(value).__name__}")
    return value


def _optional_str(value: object, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise KVEventError(f"{what} must be a string or nil")
    return value


def _stored(
    hashes: object,
    parent: object,
    token_ids: object,
    block_size: object,
    medium: object,
    lora_name: object,
) -> BlockStored:
    size = _int(block_size, "BlockStored.block_size")
    if size < 1:
        raise KVEventError(f"BlockStored.block_size must be positive, not {size}")
    return BlockStored(
        block_hashes=tuple(
            _hash(h, "BlockStored.block_hashes[]")
            for h in _list(hashes, "BlockStored.block_hashes")
        ),
        parent_block_hash=(
            None if parent is None else _hash(parent, "BlockStored.parent_block_hash")
        ),
        token_ids=tuple(
            _int(t, "BlockStored.token_ids[]")
            for t in _list(token_ids, "BlockStored.token_ids")
        ),
        block_size=size,
        medium=_optional_str(medium, "BlockStored.medium"),
        lora_name=_optional_str(lora_name, "BlockStored.lora_name"),
    )


def _removed(hashes: object, medium: object) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=tuple(
            _hash(h, "BlockRemoved.block_hashes[]")
            for h in _list(hashes, "BlockRemoved.block_hashes")
        ),
        medium=_optional_str(medium, "BlockRemoved.medium"),
    )


def _from_map(raw: dict[Any, Any]) -> KVEvent | None:
    kind = raw.get("type")
    try:
        if kind == "BlockStored":
            return _stored(
                raw["block_hashes"],
                raw["parent_block_hash"],
                raw["token_ids"],
                raw["block_size"],
                raw.get("medium"),
                raw.get("lora_name"),
            )
        if kind == "BlockRemoved":
            return _removed(raw["block_hashes"], raw.get("medium"))
    except KeyError as exc:
        raise KVEventError(f"{kind} event lacks the field {exc.args[0]!r}") from None
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(kind, str):
        raise KVEventError("an event map needs a string 'type' tag")
    return None  # a newer event type: skipped


def _from_array(raw: list[Any]) -> KVEvent | None:
    if not raw or not isinstance(raw[0], str):
        raise KVEventError("an array event must start with its type name")
    kind, fields = raw[0], raw[1:]
    if kind == "BlockStored":
        if len(fields) < 4:
            raise KVEventError("a legacy BlockStored needs at least 4 fields")
        medium = fields[5] if len(fields) > 5 else "GPU"
        lora_name = fields[6] if len(fields) > 6 else None
        return _stored(fields[0], fields[1], fields[2], fields[3], medium, lora_name)
    if kind == "BlockRemoved":
        if not fields:
            raise KVEventError("a legacy BlockRemoved needs its block hashes")
        return _removed(fields[0], fields[1] if len(fields) > 1 else "GPU")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """Return the batch in a msgpack payload (map-tagged or legacy array events).

    Raises:
        KVEventError: not msgpack, or not shaped as a KV event batch.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, TypeError) as exc:
        raise KVEventError(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise KVEventError("a batch must be the array [ts, events, dp_rank]")
    ts = raw[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVEventError("a batch's ts must be a number")
    rank = raw[2] if len(raw) == 3 else None
    if rank is not None:
        rank = _int(rank, "data_parallel_rank")
    events: list[KVEvent] = []
    for item in _list(raw[1], "a batch's events"):
        if isinstance(item, dict):
            event = _from_map(item)
        elif isinstance(item, list):
            event = _from_array(item)
        else:
            raise KVEventError(f"an event must be a map or an array, not {item!r}")
        if event is not None:
            events.append(event)
    return EventBatch(ts=float(ts), events=tuple(events), data_parallel_rank=rank)


def pack_frames(topic: str, seq: int, batch: EventBatch) -> list[bytes]:
    """Return the three ZMQ frames vLLM publishes: topic, seq (8 bytes, big-endian),
    payload."""
    if not 0 <= seq < 1 << 63:
        raise ValueError(f"seq must be in [0, 2**63), not {seq}")
    return [topic.encode(), seq.to_bytes(8, "big"), encode_batch(batch)]


def unpack_frames(frames: Sequence[bytes]) -> tuple[str, int, EventBatch]:
    """Return (topic, seq, batch) from one published multipart message.

    Raises:
        KVEventError: not three frames, a seq frame not 8 bytes, a topic not
            UTF-8, or a payload that is not a batch.
    """
    if len(frames) != 3:
        raise KVEventError(f"a KV event message has 3 frames, not {len(frames)}")
    topic, seq, payload = (bytes(frame) for frame in frames)
    if len(seq) != 8:
        raise KVEventError(f"the seq frame has 8 bytes, not {len(seq)}")
    try:
        name = topic.decode()
    except UnicodeDecodeError:
        raise KVEventError("the topic frame is not UTF-8") from None
    return name, int.from_bytes(seq, "big"), decode_batch(payload)

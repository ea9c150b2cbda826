"""Replica heartbeats as they travel through Redis: record shape and key names.

Public surface: ``ReplicaBeat``, ``beat_key``, ``region_index_key``, ``encode_beat``,
``decode_beat``.

Each beat is a Redis hash under ``<prefix>:beat:<replica_id>`` that expires after
the missed-beat window, so a replica that stops beating disappears from Redis by
itself; ``<prefix>:beats:<region>`` is a set indexing the replica ids of a region
(readers drop members whose hash has expired).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

__all__ = ["ReplicaBeat", "beat_key", "decode_beat", "encode_beat", "region_index_key"]


@dataclass(frozen=True, slots=True)
class ReplicaBeat:
    """What a node agent reports for one replica, every beat."""

    replica_id: str
    model: str
    version: str
    region: str
    node: str
    url: str
    state: str
    queue_depth: int
    num_running: int
    tokens_in_flight: int
    kv_cache_usage_perc: float
    beat_at: float  # unix seconds


def beat_key(prefix: str, replica_id: str) -> str:
    """Return the Redis key of a replica's latest beat."""
    return f"{prefix}:beat:{replica_id}"


def region_index_key(prefix: str, region: str) -> str:
    """Return the Redis key of the set of replica ids beating in a region."""
    return f"{prefix}:beats:{region}"


def encode_beat(beat: ReplicaBeat) -> dict[str, str]:
    """Return the beat as a flat mapping of strings (a Redis hash)."""
    return {key: str(value) for key, value in asdict(beat).items()}


_INTS = {"queue_depth", "num_running", "tokens_in_flight"}
_FLOATS = {"kv_cache_usage_perc", "beat_at"}


def decode_beat(raw: Mapping[str | bytes, str | bytes]) -> ReplicaBeat | None:
    """Return the beat stored in a Redis hash, or None if it is incomplete."""
    values: dict[str, object] = {}
    text = {
        (k.decode() if isinstance(k, bytes) else k): (
            v.decode() if isinstance(v, bytes) else v
        )
        for k, v in raw.items()
    }
    for field_ in fields(ReplicaBeat):
        if field_.name not in text:
            return None
        value = text[field_.name]
        try:
            if field_.name in _INTS:
                values[field_.name] = int(value)
            elif field_.name in _FLOATS:
                values[field_.name] = float(value)
            else:
                values[field_.name] = value
        except ValueError:
            return None
    return ReplicaBeat(**values)  # type: ignore[arg-type]

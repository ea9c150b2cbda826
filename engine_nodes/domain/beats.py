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
from dataclasses import asdict, dataclass

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


def decode_beat(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> ReplicaBeat | None:
    """Return the beat stored in a Redis hash, or None if it is incomplete.

    ``raw`` is the hash as redis-py reads it: bytes, or text with
    ``decode_responses``.
    """
    text = {
        (k.decode() if isinstance(k, bytes) else k): (
            v.decode() if isinstance(v, bytes) else v
        )
        for k, v in raw.items()
    }
    try:
        return ReplicaBeat(
            replica_id=text["replica_id"],
            model=text["model"],
            version=text["version"],
            region=text["region"],
            node=text["node"],
            url=text["url"],
            state=text["state"],
            queue_depth=int(text["queue_depth"]),
            num_running=int(text["num_running"]),
            tokens_in_flight=int(text["tokens_in_flight"]),
            kv_cache_usage_perc=float(text["kv_cache_usage_perc"]),
            beat_at=float(text["beat_at"]),
        )
    except (KeyError, ValueError):
        return None

"""A replica beat as Redis stores it: encoded to strings, read back typed."""

from __future__ import annotations

import pytest

from engine_nodes.domain.beats import ReplicaBeat, decode_beat, encode_beat

BEAT = ReplicaBeat(
    replica_id="chat-7b-v1-local-0",
    model="chat-7b",
    version="v1",
    region="local",
    node="node-a",
    url="http://127.0.0.1:8001",
    state="serving",
    queue_depth=3,
    num_running=5,
    tokens_in_flight=1200,
    kv_cache_usage_perc=0.25,
    beat_at=1_740_830_400.5,
)


def stored(beat: ReplicaBeat) -> dict[bytes, bytes]:
    """Return the hash as redis-py reads it back: bytes keys and values."""
    return {k.encode(): v.encode() for k, v in encode_beat(beat).items()}


def test_a_beat_reads_back_equal_from_bytes_or_text() -> None:
    assert decode_beat(stored(BEAT)) == BEAT
    assert decode_beat(encode_beat(BEAT)) == BEAT


def test_a_beat_missing_a_field_reads_as_none() -> None:
    raw = stored(BEAT)
    del raw[b"tokens_in_flight"]
    assert decode_beat(raw) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("queue_depth", b"3.5"), ("num_running", b"many"), ("beat_at", b"")],
)
def test_a_beat_with_a_malformed_number_reads_as_none(field: str, value: bytes) -> None:
    raw = stored(BEAT)
    raw[field.encode()] = value
    assert decode_beat(raw) is None

"""Figures keys and the embedded recorder: names, buckets, sums, distinct conversations."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metering.domain.figures import Role, VersionFigures, one_request
from metering.figures import (
    FigureKey,
    MemoryFigureRecorder,
    figures_conversations_key,
    figures_hash_key,
    figures_index_key,
    parse_figures_hash_key,
)

BUCKET = 1_740_830_400  # 2025-03-01 12:00 UTC
KEY = FigureKey("chat-7b", "v2", Role.CANARY, BUCKET, 60)
OK = one_request(ttft_s=0.2, output_tokens=12)

slugs = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)


def test_hash_key_names_every_part() -> None:
    assert figures_hash_key("p", KEY) == f"p:figures:60:{BUCKET}:canary:chat-7b:v2"
    assert figures_index_key("p") == "p:figures:index"
    assert figures_conversations_key("h") == "h:conv"
    assert KEY.bucket_start == datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
    assert KEY.bucket_end_epoch == BUCKET + 60


@given(
    model=slugs,
    version=slugs,
    role=st.sampled_from(list(Role)),
    bucket_s=st.integers(1, 3600),
    n=st.integers(0, 10**7),
)
def test_hash_key_round_trips(
    model: str, version: str, role: Role, bucket_s: int, n: int
) -> None:
    key = FigureKey(model, version, role.value, n * bucket_s, bucket_s)
    assert parse_figures_hash_key("pre:fix", figures_hash_key("pre:fix", key)) == key


@pytest.mark.parametrize(
    "name",
    [
        "p:figures:index",
        f"p:figures:60:{BUCKET}:canary:chat-7b",  # a part missing
        f"p:figures:60:{BUCKET}:canary:chat-7b:v2:conv",  # the HyperLogLog
        f"p:figures:060:{BUCKET}:canary:chat-7b:v2",  # not canonical
        f"p:figures:60:{BUCKET + 1}:canary:chat-7b:v2",  # not on a bucket
        f"p:figures:60:{BUCKET}:pinned:chat-7b:v2",  # no such role
        f"p:figures:60:{BUCKET}:canary:Chat:v2",  # not a slug
        f"q:figures:60:{BUCKET}:canary:chat-7b:v2",  # another prefix
    ],
)
def test_parse_refuses_malformed_names(name: str) -> None:
    assert parse_figures_hash_key("p", name) is None


@pytest.mark.parametrize(
    "key",
    [
        FigureKey("chat:7b", "v1", "live", BUCKET),
        FigureKey("chat-7b", "v1", "pinned", BUCKET),
        FigureKey("chat-7b", "v1", "live", BUCKET + 30),
        FigureKey("chat-7b", "v1", "live", BUCKET, 0),
    ],
)
def test_invalid_keys_have_no_name(key: FigureKey) -> None:
    with pytest.raises(ValueError):
        figures_hash_key("p", key)


@given(at=st.floats(0, 4e9), bucket_s=st.integers(1, 3600))
def test_from_time_holds_the_time_in_its_bucket(at: float, bucket_s: int) -> None:
    key = FigureKey.from_time("m", "v1", "live", at, bucket_s)
    key.check()
    assert key.bucket_epoch <= at < key.bucket_end_epoch


def _add(
    recorder: MemoryFigureRecorder,
    key: FigureKey,
    figures: VersionFigures,
    conversation: str | None,
) -> None:
    asyncio.run(recorder.add(key, figures, conversation))


def test_memory_recorder_sums_per_bucket() -> None:
    recorder = MemoryFigureRecorder()
    other = FigureKey("chat-7b", "v1", Role.LIVE, BUCKET, 60)
    failed = one_request(ttft_s=None, output_tokens=None, error_kind="upstream")
    _add(recorder, KEY, OK, "a")
    _add(recorder, KEY, failed, "b")
    _add(recorder, other, OK, None)
    assert len(recorder) == 2
    drained = recorder.drain(BUCKET + 10)
    assert drained[KEY] == OK + failed + VersionFigures(conversations=2)
    assert drained[other] == OK
    assert recorder.drain(BUCKET + 10) == {}


def test_memory_recorder_counts_a_conversation_once_per_bucket() -> None:
    recorder = MemoryFigureRecorder()
    for conversation in ("a", "b", "a"):
        _add(recorder, KEY, OK, conversation)
    assert recorder.drain(BUCKET + 10)[KEY].conversations == 2
    # Drained while the bucket is open: "a" and "b" are still known.
    _add(recorder, KEY, OK, "a")
    _add(recorder, KEY, OK, "c")
    assert recorder.drain(BUCKET + 70)[KEY].conversations == 1
    # The bucket ended: what it saw is forgotten, the next bucket counts anew.
    later = FigureKey("chat-7b", "v2", Role.CANARY, BUCKET + 60, 60)
    _add(recorder, later, OK, "a")
    assert recorder.drain(BUCKET + 70)[later].conversations == 1


def test_memory_recorder_restores_a_failed_flush() -> None:
    recorder = MemoryFigureRecorder()
    _add(recorder, KEY, OK, "a")
    drained = recorder.drain(BUCKET)
    _add(recorder, KEY, OK, "b")
    recorder.restore(drained)
    assert recorder.drain(BUCKET)[KEY] == OK + OK + VersionFigures(conversations=2)


def test_memory_recorder_drops_invalid_keys() -> None:
    recorder = MemoryFigureRecorder()
    _add(recorder, FigureKey("chat-7b", "v1", "pinned", BUCKET), OK, "a")
    assert len(recorder) == 0

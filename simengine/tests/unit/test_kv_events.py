"""The KV event codec: round trips, vLLM's two event encodings, malformed input."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simengine.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventError,
    decode_batch,
    encode_batch,
    pack_frames,
    unpack_frames,
)

U64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
MEDIUM = st.one_of(st.none(), st.sampled_from(["GPU", "CPU"]))


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    size = draw(st.integers(min_value=1, max_value=8))
    hashes = draw(st.lists(U64, min_size=1, max_size=4))
    tokens = draw(
        st.lists(
            st.integers(min_value=0, max_value=200_000),
            min_size=size * len(hashes),
            max_size=size * len(hashes),
        )
    )
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=draw(st.one_of(st.none(), U64)),
        token_ids=tuple(tokens),
        block_size=size,
        medium=draw(MEDIUM),
        lora_name=draw(st.one_of(st.none(), st.text(max_size=8))),
    )


EVENTS = st.one_of(
    stored(),
    st.builds(
        BlockRemoved,
        block_hashes=st.lists(U64, max_size=4).map(tuple),
        medium=MEDIUM,
    ),
    st.just(AllBlocksCleared()),
)
BATCHES = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(EVENTS, max_size=5).map(tuple),
    data_parallel_rank=st.one_of(st.none(), st.integers(min_value=0, max_value=64)),
)


@given(BATCHES)
def test_decode_batch_inverts_encode_batch(batch: EventBatch) -> None:
    assert decode_batch(encode_batch(batch)) == batch


@given(BATCHES, st.text(max_size=20), st.integers(min_value=0, max_value=2**63 - 1))
def test_unpack_frames_inverts_pack_frames(
    batch: EventBatch, topic: str, seq: int
) -> None:
    frames = pack_frames(topic, seq, batch)
    assert len(frames[1]) == 8
    assert unpack_frames(frames) == (topic, seq, batch)


def test_encode_batch_writes_vllm_032_keys_in_order() -> None:
    batch = EventBatch(
        ts=1.5,
        events=(
            BlockStored((7, 8), None, (1, 2, 3, 4), 2),
            BlockRemoved((7,)),
            AllBlocksCleared(),
        ),
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [7, 8],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None, None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            },
            {
                "type": "BlockRemoved",
                "block_hashes": [7],
                "medium": "GPU",
                "group_idx": 0,
            },
            {"type": "AllBlocksCleared"},
        ],
    ]
    assert list(raw[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ]


def test_decode_batch_reads_legacy_array_events() -> None:
    payload = msgspec.msgpack.encode(
        [
            2.0,
            [
                ["BlockStored", [5], 4, [9, 9], 2, None, "GPU"],
                ["BlockStored", [6], None, [1], 1, None],
                ["BlockRemoved", [5], "GPU"],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )
    assert decode_batch(payload) == EventBatch(
        ts=2.0,
        events=(
            BlockStored((5,), 4, (9, 9), 2),
            BlockStored((6,), None, (1,), 1),
            BlockRemoved((5,)),
            AllBlocksCleared(),
        ),
        data_parallel_rank=0,
    )


def test_decode_batch_turns_byte_hashes_into_low_64_bits() -> None:
    digest = bytes(range(32))
    payload = msgspec.msgpack.encode(
        [0.0, [{"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"}]]
    )
    (event,) = decode_batch(payload).events
    assert event == BlockRemoved((int.from_bytes(digest[-8:], "big"),))


def test_decode_batch_skips_unknown_event_types() -> None:
    payload = msgspec.msgpack.encode(
        [
            0.0,
            [
                {"type": "BlockMoved", "x": 1},
                ["SomethingNew", 1],
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    assert decode_batch(payload).events == (AllBlocksCleared(),)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"ts": 1}, "array"),
        ([1.0], "array"),
        (["now", []], "ts must be a number"),
        ([1.0, {}], "events"),
        ([1.0, [3]], "map or an array"),
        ([1.0, [{"no": "type"}]], "type"),
        ([1.0, [{"type": "BlockStored", "block_hashes": [1]}]], "lacks the field"),
        ([1.0, [["BlockStored", [1], None]]], "at least 4 fields"),
        ([1.0, [[]]], "type name"),
        ([1.0, [["BlockRemoved", ["x"]]]], "integer"),
        ([1.0, [["BlockStored", [1], None, [True], 1]]], "integer"),
        ([1.0, [["BlockStored", [1], None, [1], 0]]], "positive"),
        ([1.0, [["BlockStored", [1], None, [1], 1, None, 3]]], "medium"),
        ([1.0, [], "rank"], "data_parallel_rank"),
    ],
)
def test_decode_batch_rejects_malformed_batches(raw: object, message: str) -> None:
    with pytest.raises(KVEventError, match=message):
        decode_batch(msgspec.msgpack.encode(raw))


MSGPACK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids"])
            | st.text(max_size=4),
            inner,
            max_size=6,
        )
    ),
    max_leaves=30,
)


@given(st.binary(max_size=64) | MSGPACK.map(msgspec.msgpack.encode))
def test_decode_batch_raises_only_kv_event_error(payload: bytes) -> None:
    with contextlib.suppress(KVEventError):
        decode_batch(payload)


@given(st.lists(MSGPACK, max_size=6))
def test_decode_batch_raises_only_kv_event_error_on_odd_events(
    events: list[object],
) -> None:
    with contextlib.suppress(KVEventError):
        decode_batch(msgspec.msgpack.encode([1.0, events]))


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"kv", b"\0" * 8], "3 frames"),
        ([b"kv", b"\0" * 4, encode_batch(EventBatch(0.0, ()))], "8 bytes"),
        ([b"\xff", b"\0" * 8, encode_batch(EventBatch(0.0, ()))], "UTF-8"),
        ([b"kv", b"\0" * 8, b"\xc1"], "not msgpack"),
    ],
)
def test_unpack_frames_rejects_malformed_messages(
    frames: list[bytes], message: str
) -> None:
    with pytest.raises(KVEventError, match=message):
        unpack_frames(frames)

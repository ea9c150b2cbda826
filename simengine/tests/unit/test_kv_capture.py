"""Our KV event codec against a capture of real vLLM 0.32 (``simengine.kv_capture``).

Every captured frame decodes; our encoder writes each captured batch back byte for
byte (so the map keys, their order, the value types and the frame layout are
vLLM's); the captured events chain; and an index rebuilt from the announced
token ids predicts each request's ``cached_tokens``.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import pytest

from simengine.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    pack_frames,
    unpack_frames,
)
from simengine.kv_capture import read_kv_capture

CAPTURE = read_kv_capture()
STEPS: list[dict[str, Any]] = CAPTURE["steps"]


def raw_frames() -> list[list[bytes]]:
    return [
        [base64.b64decode(part) for part in frame]
        for step in STEPS
        for frame in step["frames"]
    ]


def batches(step: dict[str, Any]) -> list[EventBatch]:
    return [
        unpack_frames([base64.b64decode(part) for part in frame])[2]
        for frame in step["frames"]
    ]


def shape(value: object) -> object:
    """Keys in order and value types, recursively (lists by their first item)."""
    if isinstance(value, dict):
        return [(key, shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return ["list", *(shape(value[0]) for _ in value[:1])]
    return type(value).__name__


def test_capture_covers_stores_removals_and_a_clear() -> None:
    events = [e for step in STEPS for b in batches(step) for e in b.events]
    kinds = {type(e) for e in events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}


def test_every_captured_frame_decodes_with_the_topic_and_counted_seqs() -> None:
    seqs = []
    for frames in raw_frames():
        topic, seq, _ = unpack_frames(frames)
        assert topic == CAPTURE["topic"]
        seqs.append(seq)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


@pytest.mark.parametrize("frames", raw_frames())
def test_encoder_writes_captured_batches_byte_for_byte(frames: list[bytes]) -> None:
    topic, seq, batch = unpack_frames(frames)
    ours = pack_frames(topic, seq, batch)
    assert shape(msgspec.msgpack.decode(ours[2])) == shape(
        msgspec.msgpack.decode(frames[2])
    )
    assert ours == frames


def test_encoder_event_keys_match_vllm_for_each_kind() -> None:
    captured: dict[str, object] = {}
    for frames in raw_frames():
        for event in msgspec.msgpack.decode(frames[2])[1]:
            captured.setdefault(event["type"], shape(event))
    ours = msgspec.msgpack.decode(
        encode_batch(
            EventBatch(
                0.0,
                (BlockStored((1,), None, tuple(range(32)), 32), BlockRemoved((1,))),
                0,
            )
        )
    )[1]
    assert [shape(event) for event in ours] == [
        captured["BlockStored"],
        captured["BlockRemoved"],
    ]


def test_captured_stores_chain_to_stored_blocks() -> None:
    block_size = CAPTURE["block_size"]
    stored: set[int] = set()
    for step in STEPS:
        for batch in batches(step):
            for event in batch.events:
                if not isinstance(event, BlockStored):
                    continue
                assert event.block_size == block_size
                assert len(event.token_ids) == block_size * len(event.block_hashes)
                if event.parent_block_hash is not None:
                    assert event.parent_block_hash in stored
                stored.update(event.block_hashes)


def test_index_from_events_predicts_cached_tokens() -> None:
    """GIVEN an index keyed by block content after its parent, fed every event
    WHEN each request's prompt is looked up before its own events apply
    THEN the hit (capped at (n - 1) // block_size blocks) is its cached_tokens."""
    block_size = CAPTURE["block_size"]
    by_hash: dict[int, tuple[int, ...]] = {}  # engine hash -> content key
    keys: set[tuple[int, ...]] = set()
    checked = 0
    for step in STEPS:
        prompt = step.get("prompt_token_ids")
        if prompt is not None:
            limit = (len(prompt) - 1) // block_size
            hit = 0
            while hit < limit and tuple(prompt[: (hit + 1) * block_size]) in keys:
                hit += 1
            cached = step["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert hit * block_size == cached, step["step"]
            checked += 1
        for batch in batches(step):
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    by_hash.clear()
                    keys.clear()
                elif isinstance(event, BlockRemoved):
                    # A block of the batch lost before the subscription
                    # reached vLLM (seq 0) was never known.
                    for block_hash in event.block_hashes:
                        keys.discard(by_hash.pop(block_hash, ()))
                else:
                    parent = (
                        ()
                        if event.parent_block_hash is None
                        else by_hash[event.parent_block_hash]
                    )
                    for i, block_hash in enumerate(event.block_hashes):
                        start = i * block_size
                        key = parent + event.token_ids[start : start + block_size]
                        by_hash[block_hash] = key
                        keys.add(key)
                        parent = key
    assert checked == sum(1 for step in STEPS if "prompt_token_ids" in step)
    assert any(
        s["usage"]["prompt_tokens_details"]["cached_tokens"]
        for s in STEPS
        if "usage" in s
    )

"""The simulated replica publishes vLLM's KV events over ZMQ (a real process)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import zmq

from localrun.processes import Process, free_port, sim_replica
from simengine.domain import tokens
from simengine.domain.kv_events import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    unpack_frames,
)

BLOCK_SIZE = 16
TOPIC = "kv@sim-1@chat-7b"
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def sub_and_replica(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[zmq.Socket[bytes], Process]]:
    # The SUB binds and the replica connects to it (a concrete host: vLLM's
    # connect mode), so the address is known before the replica starts.
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.LINGER, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "topic": TOPIC,
    }
    try:
        with pytest.MonkeyPatch.context() as env:
            # vLLM's dev mode serves POST /reset_prefix_cache.
            env.setenv("VLLM_SERVER_DEV_MODE", "1")
            with sim_replica(
                tmp_path_factory.mktemp("sim-kv"),
                "--enable-prompt-tokens-details",
                "--block-size",
                str(BLOCK_SIZE),
                "--kv-events-config",
                json.dumps(config),
            ) as process:
                yield sub, process
    finally:
        sub.close()


def receive(sub: zmq.Socket[bytes], timeout_s: float) -> list[tuple[int, EventBatch]]:
    """Return the batches that arrive within ``timeout_s`` of each other."""
    batches = []
    while sub.poll(int(timeout_s * 1000)):
        topic, seq, batch = unpack_frames(sub.recv_multipart())
        assert topic == TOPIC
        batches.append((seq, batch))
        timeout_s = 0.2
    return batches


def chat(process: Process, messages: list[dict[str, str]]) -> int:
    """Send one chat request; return its usage's cached tokens."""
    client = openai.OpenAI(
        base_url=f"{process.url}/v1", api_key="unused", max_retries=0
    )
    answer = client.chat.completions.create(
        model="chat-7b",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert answer.usage is not None
    details = answer.usage.prompt_tokens_details
    return details.cached_tokens or 0 if details is not None else 0


def joined(sub: zmq.Socket[bytes], process: Process) -> int:
    """Send distinct warm-up requests until a batch arrives (a PUB drops what it
    publishes before the subscription reaches it); return the last seq seen."""
    deadline = time.monotonic() + DEADLINE_S
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        words = " ".join(f"warm{attempt}x{i}" for i in range(40))
        chat(process, [{"role": "user", "content": words}])
        batches = receive(sub, 1.0)
        if batches:
            return batches[-1][0]
    raise AssertionError(f"no KV event batch in {DEADLINE_S} s")


def stored_blocks(
    sub: zmq.Socket[bytes], want: int, last_seq: int
) -> tuple[list[BlockStored], int]:
    """Receive until ``want`` blocks were announced stored (deadline)."""
    stored: list[BlockStored] = []
    deadline = time.monotonic() + DEADLINE_S
    while sum(len(e.block_hashes) for e in stored) < want:
        assert time.monotonic() < deadline, stored
        for seq, batch in receive(sub, 1.0):
            assert seq == last_seq + 1
            last_seq = seq
            stored.extend(e for e in batch.events if isinstance(e, BlockStored))
    return stored, last_seq


def test_replica_announces_the_prompt_blocks_a_second_request_hits(
    sub_and_replica: tuple[zmq.Socket[bytes], Process],
) -> None:
    """GIVEN a replica publishing KV events and a subscriber that has joined
    WHEN a chat request runs
    THEN its full prompt blocks are announced with the stand-in tokenizer's ids,
    chained from no parent, and a second request sharing the first message hits
    exactly the announced blocks (capped to leave its last token)."""
    sub, process = sub_and_replica
    last_seq = joined(sub, process)
    first = [{"role": "user", "content": " ".join(f"w{i}" for i in range(90))}]
    ids = tokens.encode(tokens.render_chat(first))
    full = len(ids) // BLOCK_SIZE
    assert chat(process, first) == 0
    stored, last_seq = stored_blocks(sub, full, last_seq)

    assert stored[0].parent_block_hash is None
    for before, after in itertools.pairwise(stored):
        assert after.parent_block_hash == before.block_hashes[-1]
    announced = [t for e in stored for t in e.token_ids]
    assert announced == ids[: full * BLOCK_SIZE]
    assert all(e.block_size == BLOCK_SIZE for e in stored)

    second = [
        *first,
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ]
    second_ids = tokens.encode(tokens.render_chat(second))
    shared = 0
    while (
        shared < full
        and second_ids[: (shared + 1) * BLOCK_SIZE] == ids[: (shared + 1) * BLOCK_SIZE]
    ):
        shared += 1
    cap = (len(second_ids) - 1) // BLOCK_SIZE
    assert shared > 0
    assert chat(process, second) == min(shared, cap) * BLOCK_SIZE


def test_reset_prefix_cache_clears_with_the_next_steps_batch(
    sub_and_replica: tuple[zmq.Socket[bytes], Process],
) -> None:
    """GIVEN a replica whose cache holds a prompt's blocks
    WHEN the prefix cache is reset and the prompt comes again
    THEN nothing is hit, and the next batch starts with AllBlocksCleared, then
    stores the prompt's blocks again (vLLM publishes the clear with its next
    step, not on its own)."""
    sub, process = sub_and_replica
    last_seq = joined(sub, process)
    messages = [{"role": "user", "content": " ".join(f"r{i}" for i in range(60))}]
    chat(process, messages)
    full = len(tokens.encode(tokens.render_chat(messages))) // BLOCK_SIZE
    _, last_seq = stored_blocks(sub, full, last_seq)
    answer = httpx.post(f"{process.url}/reset_prefix_cache")
    assert answer.json() == {"success": True}
    assert chat(process, messages) == 0
    deadline = time.monotonic() + DEADLINE_S
    batches: list[tuple[int, EventBatch]] = []
    while not batches:
        assert time.monotonic() < deadline, "no batch after the reset"
        batches = receive(sub, 1.0)
    seq, batch = batches[0]
    assert seq == last_seq + 1
    assert batch.events[0] == AllBlocksCleared()
    assert isinstance(batch.events[1], BlockStored)
    assert batch.events[1].parent_block_hash is None


def test_sglang_replica_announces_its_radix_trees_blocks(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """GIVEN a simulated SGLang replica with SGLang's --kv-events-config (a bind)
    WHEN a chat request runs
    THEN its prompt's full blocks are announced, chained from no parent."""
    port = free_port()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{port}",
        "topic": TOPIC,
    }
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.LINGER, 0)
    try:
        with sim_replica(
            tmp_path_factory.mktemp("sim-sglang-kv"),
            "--sim-engine",
            "sglang",
            "--kv-events-config",
            json.dumps(config),
        ) as process:
            sub.connect(f"tcp://127.0.0.1:{port}")
            last_seq = joined(sub, process)
            messages = [
                {"role": "user", "content": " ".join(f"s{i}" for i in range(70))}
            ]
            ids = tokens.encode(tokens.render_chat(messages))
            full = len(ids) // BLOCK_SIZE
            chat(process, messages)
            stored, _ = stored_blocks(sub, full, last_seq)
    finally:
        sub.close()
    assert stored[0].parent_block_hash is None
    assert [t for e in stored for t in e.token_ids] == ids[: full * BLOCK_SIZE]

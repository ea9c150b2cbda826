"""Publish the simulated engine's KV-cache events over ZMQ, as vLLM does.

Public surface: ``KVEventsConfig``, ``parse_kv_events_config``,
``is_bind_endpoint``, ``KVEventPublisher``.

``--kv-events-config`` takes vLLM's JSON (``enable_kv_cache_events``,
``publisher``, ``endpoint``, ``topic``, ``hwm``; ``replay_endpoint``,
``buffer_steps`` and ``max_queue_size`` are accepted and not simulated: no replay
socket). The PUB socket binds when the endpoint has ``*`` or ``::`` or is
``ipc://``/``inproc://``, and connects otherwise (vLLM's rule). Each step's
events go out as one batch, ``[topic, seq, msgpack]`` with ``seq`` counting
batches from 0 (``kv_events.pack_frames``).

Sends never block the engine's event loop: ``NOBLOCK``, and a PUB drops what a
subscriber past its high-water mark cannot take (``dropped`` counts the batches
ZMQ refused outright). The sequence number still advances, so a subscriber
sees the gap.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from simengine.domain.kv_events import EventBatch, KVEvent, pack_frames

__all__ = [
    "KVEventPublisher",
    "KVEventsConfig",
    "is_bind_endpoint",
    "parse_kv_events_config",
]

# vLLM's KVEventsConfig fields; the ones this publisher does not act on are
# accepted so a version's engine_config works on both.
_KNOWN_KEYS = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
}


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config``, the part the simulated replica acts on."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000

    @property
    def is_enabled(self) -> bool:
        """Whether events are published (vLLM: enabled and a zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Return the config in ``text`` (a JSON object of vLLM's keys).

    vLLM defaults ``publisher`` to ``"zmq"`` when events are enabled and no
    publisher is named.

    Raises:
        ValueError: not a JSON object, an unknown key or a value of the wrong type.
    """
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown keys {unknown}")
    enabled = raw.get("enable_kv_cache_events", False)
    publisher = raw.get("publisher", "zmq" if enabled else None)
    endpoint = raw.get("endpoint", "tcp://*:5557")
    topic = raw.get("topic", "")
    hwm = raw.get("hwm", 100_000)
    if not isinstance(enabled, bool):
        raise ValueError("enable_kv_cache_events must be true or false")
    if publisher not in (None, "null", "zmq"):
        raise ValueError(f"publisher must be 'zmq' or 'null', not {publisher!r}")
    if not isinstance(endpoint, str) or not endpoint:
        raise ValueError("endpoint must be a ZMQ address such as tcp://*:5557")
    if not isinstance(topic, str):
        raise ValueError("topic must be a string")
    if isinstance(hwm, bool) or not isinstance(hwm, int) or hwm < 0:
        raise ValueError("hwm must be a non-negative integer")
    return KVEventsConfig(
        enable_kv_cache_events=enabled,
        publisher=publisher,
        endpoint=endpoint,
        topic=topic,
        hwm=hwm,
    )


def is_bind_endpoint(endpoint: str) -> bool:
    """Whether vLLM binds ``endpoint`` (wildcard, IPv6 any, ipc, inproc) rather
    than connecting to it."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    )


class KVEventPublisher:
    """A PUB socket sending one batch per call; ``close`` when done."""

    def __init__(
        self, config: KVEventsConfig, *, context: zmq.Context[Any] | None = None
    ) -> None:
        self.config = config
        self.seq = 0  # the next batch's sequence number
        self.dropped = 0
        ctx = context if context is not None else zmq.Context.instance()
        self._socket: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(config.endpoint):
            self._socket.bind(config.endpoint)
        else:
            self._socket.connect(config.endpoint)

    def publish(
        self, events: Sequence[KVEvent], ts: float, data_parallel_rank: int = 0
    ) -> None:
        """Send ``events`` as one batch stamped ``ts`` (nothing when empty)."""
        if not events:
            return
        batch = EventBatch(ts, tuple(events), data_parallel_rank)
        frames = pack_frames(self.config.topic, self.seq, batch)
        self.seq += 1
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        """Close the socket (pending batches are dropped: LINGER 0)."""
        self._socket.close()

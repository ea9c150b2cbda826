"""The traffic twin's live probes (``manage.py twin_check``): what the simulator
does not model, measured.

Public surface: ``Probe``, ``PROBE_EVERY_S``, ``stream_chat``, ``probe_conversation``,
``probe_during``, ``measure_overhead``, ``measure_replica_residual``.

The gateway's overhead is a pair's TTFT through the gateway less a like
request's straight to a replica (``Probe.pair``): at idle before the load
(``measure_overhead``) and a pair a second during it (``probe_during``, on the
load's event loop, so what the client adds is in it too). The replica's own
time beyond its profile is its TTFT for the load's prompt size less the
profile's (``measure_replica_residual``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from drills.domain.twin_check import probe_text
from simengine.domain.perf import PROFILES, step_time_ms

__all__ = [
    "PROBE_EVERY_S",
    "Probe",
    "measure_overhead",
    "measure_replica_residual",
    "probe_conversation",
    "probe_during",
    "stream_chat",
]

_PROBES = 30  # pairs measured
_WARM_PROBES = 5  # pairs dropped first
# Each probe's prompt, in words: short, so that the probes sent during the load
# (left out of its trace) add no prefill worth replaying. The gateway's overhead
# at idle read the same with 180 words (3.0 ms) as with a few (2.4-4.1 ms). The
# two sides of a pair send different words: neither hits the other's blocks.
_PROBE_WORDS = 8
PROBE_EVERY_S = 1.0  # a pair this often during the load
# The replica's own probes: about the load's median prompt (about 250 tokens in
# the runs of 2026-12-06), since the replica's work grows with the prompt.
_RESIDUAL_WORDS = 180


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
) -> tuple[float | None, str, dict[str, Any] | None, int]:
    """Send one streaming chat; return (TTFT, answer text, usage, status); a
    refusal's text is its error code."""
    started = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raw = await response.aread()
            with contextlib.suppress(ValueError, KeyError, TypeError):
                code = json.loads(raw)["error"]["code"]
                return None, str(code), None, response.status_code
            return None, "", None, response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    parts.append(text)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return ttft, "".join(parts), usage, 200


@dataclass(frozen=True)
class Probe:
    """Where the probes go: the gateway (with a team's key) and one replica of
    ``model`` straight (with the engines' key); ``profile`` is its replicas'."""

    model: str
    profile: str
    gateway_url: str
    key: str
    replica_url: str
    engine_key: str

    def body(self, i: int, side: str) -> dict[str, Any]:
        text = probe_text(f"probe {i} {side}", _PROBE_WORDS)
        messages = [{"role": "user", "content": text}]
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": 1,
            "stream": True,
        }

    async def pair(self, client: httpx.AsyncClient, i: int) -> float | None:
        """Return one pair's TTFT through the gateway less straight to the
        replica (the order alternating with ``i``); None if either failed."""

        async def through() -> float | None:
            headers = {
                "Authorization": f"Bearer {self.key}",
                "x-conversation-id": probe_conversation(i),
            }
            url = f"{self.gateway_url}/v1/chat/completions"
            return (await stream_chat(client, url, headers, self.body(i, "through")))[0]

        async def direct() -> float | None:
            headers = {"Authorization": f"Bearer {self.engine_key}"}
            url = f"{self.replica_url}/v1/chat/completions"
            return (await stream_chat(client, url, headers, self.body(i, "direct")))[0]

        try:
            if i % 2:
                d, t = await direct(), await through()
            else:
                t, d = await through(), await direct()
        except httpx.HTTPError:
            return None
        return None if t is None or d is None else t - d


def probe_conversation(i: int) -> str:
    """The conversation id of probe ``i`` (its records leave the trace)."""
    return f"twin-probe-{i}"


async def probe_during(
    probe: Probe, done: asyncio.Event, *, every_s: float = PROBE_EVERY_S
) -> tuple[list[float], int]:
    """Send a probe pair every ``every_s`` until ``done``; return the differences
    and the number of the first pair not sent."""
    differences: list[float] = []
    async with httpx.AsyncClient(timeout=30) as client:
        i = 0
        while not done.is_set():  # numbered after the idle probes
            difference = await probe.pair(client, _WARM_PROBES + _PROBES + i)
            if difference is not None:
                differences.append(difference)
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=every_s)
    return differences, _WARM_PROBES + _PROBES + i


def _idle_median(
    measure: Callable[[httpx.AsyncClient, int], Awaitable[float | None]], what: str
) -> float:
    """Return the median of ``measure`` over the idle probes, the first
    ``_WARM_PROBES`` (which warm the paths) dropped; at least 0."""

    async def values() -> list[float]:
        found = []
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(_WARM_PROBES + _PROBES):
                value = await measure(client, i)
                if value is None:
                    raise RuntimeError(f"{what} failed")
                if i >= _WARM_PROBES:
                    found.append(value)
        return found

    return max(0.0, statistics.median(asyncio.run(values())))


def measure_overhead(probe: Probe) -> float:
    """Return the gateway's TTFT overhead at idle: the median, over pairs, of the
    same-sized one-token request through the gateway less straight to a replica.

    The first pairs warm both paths and are dropped; the order within a pair
    alternates, so neither path always runs just after the other. Paired
    differences, not a difference of medians: the shared machine's slow moments
    then cancel within a pair instead of landing on one side.
    """
    return _idle_median(probe.pair, "an idle probe")


def measure_replica_residual(probe: Probe) -> float:
    """Return what a replica takes at idle beyond its profile for a prompt of
    the load's size: the median, over probes sent straight to it (each its own
    words, so no hit), of the TTFT less the profile's (its frontend and one
    prefill step of the prompt's tokens). The profile models the GPU's time; a
    simulated replica also spends its process's own on each request."""
    profile = PROFILES[probe.profile]
    headers = {"Authorization": f"Bearer {probe.engine_key}"}
    url = f"{probe.replica_url}/v1/chat/completions"

    async def residual(client: httpx.AsyncClient, i: int) -> float | None:
        text = probe_text(f"residual {i}", _RESIDUAL_WORDS)
        body = {
            "model": probe.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        ttft, _, usage, _ = await stream_chat(client, url, headers, body)
        if ttft is None or usage is None:
            return None
        step_ms = step_time_ms(
            profile,
            decode_seqs=0,
            kv_tokens=0,
            prefill_chunks=[(int(usage["prompt_tokens"]), 0)],
        )
        return ttft - (profile.frontend_ms + step_ms) / 1000.0

    return _idle_median(residual, "a replica probe")

"""The fault suite's load and its health watch: what the clients and /healthz saw.

Public surface: ``Answer``, ``Load``, ``HealthWatch``, ``told_usage``, ``outcomes``.

``Load`` runs a few streaming clients of the ``openai`` SDK on an event loop in a
thread of its own, each request with a deadline, and keeps every request's end
as one ``Answer``; ``HealthWatch`` samples a gateway's ``/healthz`` meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import openai

__all__ = ["Answer", "HealthWatch", "Load", "outcomes", "told_usage"]

MODEL = "chat-7b"


@dataclass
class Answer:
    """One request of the load, as its client saw it."""

    started: float
    ended: float
    outcome: str  # "ok", "hung", "cut", "<status>:<code>" or the exception's name
    first_token_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


class Load:
    """``streams`` concurrent clients, each sending one streamed chat after another.

    Runs on an event loop in a thread of its own from ``start`` until ``stop``;
    every request has a deadline (``deadline_s``): one that passes it is an answer
    of outcome "hung". Every request ends as one ``Answer``.
    """

    def __init__(
        self,
        url: str,
        key: str,
        *,
        streams: int = 3,
        max_tokens: int = 12,
        deadline_s: float = 20.0,
        pause_s: float = 0.1,
    ) -> None:
        self.url = url
        self.key = key
        self.streams = streams
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s
        self.pause_s = pause_s
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Load:
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),))
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sending; return once every request in flight has ended."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(self.deadline_s + 30)
            assert not self._thread.is_alive(), "the load did not stop"
            self._thread = None

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)

    def count_ok_since(self, since: float) -> int:
        return sum(1 for a in self.snapshot() if a.outcome == "ok" and a.ended >= since)

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.key,
            max_retries=0,
            timeout=self.deadline_s,
        )
        async with client:
            await asyncio.gather(
                *(self._client(client, n) for n in range(self.streams))
            )

    async def _client(self, client: openai.AsyncOpenAI, n: int) -> None:
        while not self._stopping.is_set():
            answer = await self._one(client, n)
            with self._lock:
                self.answers.append(answer)
            # Pacing between requests (a client's think time), not a wait.
            await asyncio.sleep(self.pause_s)

    async def _one(self, client: openai.AsyncOpenAI, n: int) -> Answer:
        started = time.monotonic()
        answer = Answer(started=started, ended=started, outcome="cut")
        try:
            async with asyncio.timeout(self.deadline_s):
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[
                        {"role": "user", "content": f"fault drill {n} {started}"}
                    ],
                    max_tokens=self.max_tokens,
                    stream=True,
                )
                async for chunk in stream:
                    if answer.first_token_s is None and chunk.choices:
                        answer.first_token_s = time.monotonic() - started
                    if chunk.usage is not None:
                        details = chunk.usage.prompt_tokens_details
                        answer.prompt_tokens = chunk.usage.prompt_tokens
                        answer.output_tokens = chunk.usage.completion_tokens
                        answer.cached_tokens = (
                            (details.cached_tokens or 0) if details else 0
                        )
                        answer.outcome = "ok"
        except TimeoutError:
            answer.outcome = "hung"
        except openai.APIStatusError as exc:
            code = getattr(exc, "code", None) or ""
            answer.outcome = f"{exc.status_code}:{code}"
        except openai.APIError as exc:
            answer.outcome = type(exc).__name__
        answer.ended = time.monotonic()
        return answer


class HealthWatch:
    """Samples the gateway's ``/healthz`` every ``interval_s`` in a thread."""

    def __init__(self, url: str, *, interval_s: float = 0.25) -> None:
        self.url = url
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, dict[str, Any]]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopping.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stopping.is_set():
                at = time.monotonic()
                try:
                    response = client.get(f"{self.url}/healthz")
                    body = response.json()
                    self.samples.append((at, response.status_code, body))
                except (httpx.HTTPError, ValueError) as exc:
                    self.samples.append((at, 0, {"error": type(exc).__name__}))
                self._stopping.wait(self.interval_s)

    def not_ready(self) -> list[tuple[float, int, dict[str, Any]]]:
        return [s for s in self.samples if s[1] != 200]


def told_usage(answers: list[Answer]) -> dict[str, int]:
    """What the clients were told: the sums of the answers' usage, and their 429s."""
    ok = [a for a in answers if a.outcome == "ok"]
    return {
        "requests": len(ok),
        "prompt_tokens": sum(a.prompt_tokens for a in ok),
        "cached_tokens": sum(a.cached_tokens for a in ok),
        "output_tokens": sum(a.output_tokens for a in ok),
        "rate_limited": sum(1 for a in answers if a.outcome.startswith("429:")),
    }


def outcomes(answers: list[Answer]) -> dict[str, int]:
    return dict(Counter(a.outcome for a in answers))

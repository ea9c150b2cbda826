"""The load-test gate's measurement: a stepped replay of a trace against one replica.

Public surface: ``LoadTestError``, ``LoadTestSettings``, ``SHORT_SETTINGS``,
``LoadTestResult``, ``ClientFigures``, ``run_load_test``, ``load_test``.

One replica, reached directly at its base URL (a staging replica outside the
serving ring: no gateway, no admission), gets the trace replayed at fixed arrival
rates, stepped up. What a step sends, which rates run and how a step is judged
are ``models_registry.domain.load_test``'s, the same code the modelled capacity test
(``manage.py capacity_test --sim --trace``) runs in virtual time: Poisson
arrivals at the rate (``arrival_times``), the trace's requests in order, cycling
and tagged per lap (``replay_turns``), the judge (``judge_step``) and the search
(``next_rate``, ``capacity_answer``). This module only measures.

**A step** (``warmup_s``, then the window of ``duration_s``, then the drain):
every request is a streaming chat completion (``stream: true``, ``max_tokens`` =
the trace's answer length with ``ignore_eos``, so answers have that length, and
streaming usage on). Per request: TTFT (sent to first content event), and its
stream rate once finished (``(completion_tokens - 1) / (last - first event)``, that
is ``1 / TPOT``). The requests that arrive in the window are judged; arrivals go
on at the same rate after it until every one of them has finished, or
``drain_s`` ran out (those without a first token then count as never started);
then whatever still runs is cancelled (the replica frees its KV blocks), so each
step starts from an idle replica, as each modelled step does. The replica's
``/metrics`` (vLLM's names, ``engine_nodes.domain.scrape``) is read when the window
opens and when it closes, for the output tokens/s it produced in the window
(``vllm:generation_tokens_total``) and the prefix-cache hit rate
(``prefix_cache_hits / prefix_cache_queries``), and every ``sample_interval_s``
within it for the KV tokens in use (blocks in use x block size). Alongside, the
client's own view of tokens in flight (prompt + ``max_tokens`` - tokens received,
over the requests it has open: the gateway's load measure) is sampled.

**The answer** is the search's: the highest output tokens/s of a step that held,
with that step's mean KV tokens in use as ``tokens_in_flight`` (the client's
figure where the replica exports no KV usage) and its prefix hit rate.

**The client** is one asyncio task per request on an ``httpx.AsyncClient``
(HTTP/1.1, a keep-alive pool as large as ``max_connections``); the event stream is
read as raw bytes and cut at event boundaries; a content event is found by a byte
search and only the usage event is parsed as JSON; ``load_test`` runs it on uvloop
where installed. Measured on this 2-CPU machine at 2,450 output tokens/s (a
step's warm-up, window and drain): the client used 0.27 of one core on uvloop
(0.33 on asyncio's loop), the simulated replica 0.14; arrivals went out 1 ms
late on average, 15 ms at worst. ``LoadTestResult.client`` reports the same for
every run (CPU seconds, the share of one core, the send lag: if the lag grows,
the client, not the replica, was the limit).

**Errors** end the test with ``LoadTestError``, whose message names the cause and
never the engine key: a replica that cannot be reached or does not serve the
model, any answer other than 200 (or an error event in a stream), a broken
stream, an empty or unreadable trace. A request that runs past
``request_timeout_s`` is abandoned and counts as unfinished, not as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from engine_nodes.domain.scrape import EngineStats, parse_metrics_text
from models_registry.domain.load_test import (
    CapacityCriteria,
    CapacityStep,
    ReplayRequest,
    ReplayTurn,
    arrival_times,
    capacity_answer,
    check_search,
    judge_step,
    mean_output_tokens,
    next_rate,
    read_replay_trace,
    replay_turns,
    step_rates,
)

__all__ = [
    "SHORT_SETTINGS",
    "ClientFigures",
    "LoadTestError",
    "LoadTestResult",
    "LoadTestSettings",
    "load_test",
    "run_load_test",
]

logger = logging.getLogger(__name__)

_CONTENT = b'"delta":{"content":'
_EVENT_END = b"\n\n"
_ERROR_EVENT = b'{"error"'
_USAGE = b'"usage"'
_DONE = b"data: [DONE]"
_ERROR_TEXT_MAX = 200


class LoadTestError(Exception):
    """The load test could not run; the message says why (never a secret)."""


@dataclass(frozen=True, slots=True)
class LoadTestSettings:
    """How the gate steps and measures (defaults: a real GPU, minutes per step).

    The arrival rates are ``rates`` (requests/s) when given, else those offering
    ``start_tokens_per_s``, ``+ step_tokens_per_s``, ... up to
    ``max_tokens_per_s`` output tokens/s for the trace's mean answer length. Each
    step is ``warmup_s`` + ``duration_s`` (measured) + a drain of at most
    ``drain_s``; the search stops after ``stop_after_failures`` failing steps in a
    row. With the defaults a replica of about 2,500 tokens/s takes 11 steps of
    under 3 minutes each (half an hour); ``drain_s`` must leave time for the
    window's last requests to end (answer length / 30 tokens/s, and some).
    """

    rates: tuple[float, ...] = ()
    start_tokens_per_s: float = 500.0
    step_tokens_per_s: float = 250.0
    max_tokens_per_s: float = 12_000.0
    warmup_s: float = 30.0
    duration_s: float = 120.0
    drain_s: float = 120.0
    stop_after_failures: int = 2
    criteria: CapacityCriteria = field(default_factory=CapacityCriteria)
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    sample_interval_s: float = 1.0
    max_connections: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.warmup_s < 0 or self.duration_s <= 0 or self.drain_s < 0:
            raise ValueError("duration_s must be positive, warmup_s and drain_s >= 0")
        if min(self.request_timeout_s, self.connect_timeout_s) <= 0:
            raise ValueError("the timeouts must be positive")
        if self.sample_interval_s <= 0 or self.max_connections < 1:
            raise ValueError("sample_interval_s and max_connections must be positive")
        if self.stop_after_failures < 1:
            raise ValueError("stop_after_failures must be at least 1")

    @classmethod
    def from_overrides(
        cls, overrides: Mapping[str, float], base: LoadTestSettings | None = None
    ) -> LoadTestSettings:
        """Return ``base`` (the defaults) with numeric fields replaced by name
        (``Model.gate_config.load_test``).

        Raises:
            ValueError: an unknown name, or values the settings refuse.
        """
        base = base or cls()
        numeric = {
            f.name
            for f in fields(cls)
            if f.name not in ("rates", "criteria", "stop_after_failures")
        }
        changes: dict[str, Any] = {}
        for name, value in overrides.items():
            if name == "stop_after_failures":
                changes[name] = int(value)
            elif name in numeric:
                changes[name] = type(getattr(base, name))(value)
            else:
                raise ValueError(f"{name!r} is not a load-test setting")
        return replace(base, **changes)

    def arrival_rates(self, answer_tokens: float) -> list[float]:
        """Return the steps' arrival rates (requests/s), in increasing order."""
        if self.rates:
            return sorted(self.rates)
        return step_rates(
            start_tokens_per_s=self.start_tokens_per_s,
            step_tokens_per_s=self.step_tokens_per_s,
            max_tokens_per_s=self.max_tokens_per_s,
            answer_tokens=answer_tokens,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "rates": list(self.rates),
            "start_tokens_per_s": self.start_tokens_per_s,
            "step_tokens_per_s": self.step_tokens_per_s,
            "max_tokens_per_s": self.max_tokens_per_s,
            "warmup_s": self.warmup_s,
            "duration_s": self.duration_s,
            "drain_s": self.drain_s,
            "stop_after_failures": self.stop_after_failures,
            "request_timeout_s": self.request_timeout_s,
            "sample_interval_s": self.sample_interval_s,
            "seed": self.seed,
        }


# The short setting the tests use: a 10 s warm-up (a step starts idle, and a stream
# of 250 tokens lasts about 8 s at the knee, so the replica is full by then) and a
# 40 s window (at about 10 req/s, 400 requests: the knee found within a step of
# 0.5 req/s). About a minute per step, drain included.
SHORT_SETTINGS = LoadTestSettings(
    warmup_s=10.0, duration_s=40.0, drain_s=30.0, request_timeout_s=60.0
)


@dataclass(frozen=True, slots=True)
class ClientFigures:
    """What the load generator itself cost: is it the bottleneck?"""

    cpu_s: float
    wall_s: float
    max_send_lag_s: float
    mean_send_lag_s: float

    @property
    def cpu_share(self) -> float:
        """CPU seconds per second of wall time (1.0 is one core)."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "cpu_s": round(self.cpu_s, 3),
            "wall_s": round(self.wall_s, 3),
            "cpu_share": round(self.cpu_share, 4),
            "max_send_lag_s": round(self.max_send_lag_s, 4),
            "mean_send_lag_s": round(self.mean_send_lag_s, 5),
        }


@dataclass(frozen=True, slots=True)
class LoadTestResult:
    """Every step run and the replica's capacity: what the gate stores.

    ``tokens_in_flight`` is the passing step's mean KV tokens in use
    (``tokens_in_flight_source`` "kv"), or the client's figure ("client") where the
    replica's ``/metrics`` has no KV usage; None when no step held.
    """

    steps: tuple[CapacityStep, ...]
    criteria: CapacityCriteria
    tokens_per_s: float | None
    tokens_in_flight: int | None
    tokens_in_flight_source: str | None
    prefix_hit_rate: float | None
    arrival_rate: float | None
    strict_tokens_per_s: float | None
    settings: LoadTestSettings
    trace_requests: int
    client: ClientFigures

    def as_dict(self) -> dict[str, Any]:
        """Return the result as JSON-ready values (the gate row's and the API's)."""
        return {
            "tokens_per_s": self.tokens_per_s,
            "tokens_in_flight": self.tokens_in_flight,
            "tokens_in_flight_source": self.tokens_in_flight_source,
            "prefix_hit_rate": self.prefix_hit_rate,
            "arrival_rate": self.arrival_rate,
            "strict_tokens_per_s": self.strict_tokens_per_s,
            "criteria": self.criteria.as_dict(),
            "steps": [step.as_dict() for step in self.steps],
            "settings": self.settings.as_dict(),
            "trace_requests": self.trace_requests,
            "client": self.client.as_dict(),
        }


# -- one request ------------------------------------------------------------------


class _Request:
    """One replayed request's timings and tokens (one writer: its own task)."""

    __slots__ = (
        "done",
        "first_at",
        "in_window",
        "last_at",
        "max_tokens",
        "prompt_tokens",
        "received",
        "sent_at",
        "usage_tokens",
    )

    def __init__(self, *, in_window: bool, prompt_tokens: int, max_tokens: int) -> None:
        self.in_window = in_window
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.sent_at = 0.0
        self.first_at: float | None = None
        self.last_at = 0.0
        self.received = 0  # content events so far
        self.usage_tokens: int | None = None
        self.done = False

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.received

    @property
    def stream_rate(self) -> float | None:
        """Output tokens after the first per second (1 / TPOT), once finished."""
        if not self.done or self.first_at is None or self.tokens < 2:
            return None
        elapsed = self.last_at - self.first_at
        return (self.tokens - 1) / elapsed if elapsed > 0 else None


def _safe_url(url: str) -> str:
    """Return ``url`` without credentials or query, for messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _error_text(body: bytes) -> str:
    """Return the error message of a vLLM error body, shortened."""
    try:
        error = json.loads(body).get("error")
        text = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        text = None
    text = str(
        text if text is not None else body[:_ERROR_TEXT_MAX].decode(errors="replace")
    )
    return text[:_ERROR_TEXT_MAX]


def _usage_tokens(events: bytes) -> int | None:
    for event in reversed(events.split(_EVENT_END)):
        if _USAGE in event and event.startswith(b"data: {"):
            try:
                usage = json.loads(event[6:]).get("usage") or {}
            except ValueError:
                return None
            value = usage.get("completion_tokens")
            return value if isinstance(value, int) else None
    return None


@dataclass(slots=True)
class _Step:
    """The shared state of one step: its window, its open requests, its failure."""

    window_start: float
    window_end: float
    requests: list[_Request] = field(default_factory=list)
    open: set[_Request] = field(default_factory=set)
    window_pending: int = 0
    window_closed: bool = False
    window_tokens: int = 0  # content events received inside the window
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    failure: LoadTestError | None = None
    send_lags: list[float] = field(default_factory=list)

    def fail(self, error: LoadTestError) -> None:
        if self.failure is None:
            self.failure = error
        self.failed.set()

    def finished(self, request: _Request) -> None:
        self.open.discard(request)
        if request.in_window:
            self.window_pending -= 1
            if self.window_closed and self.window_pending == 0:
                self.drained.set()


class _Replica:
    """The replica's HTTP surface, as the gate uses it."""

    def __init__(
        self, url: str, model: str, api_key: str | None, settings: LoadTestSettings
    ) -> None:
        self.url = url.rstrip("/")
        self.safe_url = _safe_url(self.url)
        self.model = model
        self.settings = settings
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
            # vLLM keeps idle connections 5 s: never reuse one it may be closing.
            keepalive_expiry=4.0,
        )
        timeout = httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.request_timeout_s,
            write=settings.connect_timeout_s,
            pool=settings.request_timeout_s,
        )
        self.client = httpx.AsyncClient(
            base_url=self.url, headers=headers, limits=limits, timeout=timeout
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def check(self) -> None:
        """Fail unless the replica answers and serves the model."""
        try:
            response = await self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise LoadTestError(
                f"cannot reach the replica at {self.safe_url}: {type(exc).__name__}"
            ) from None
        if response.status_code != 200:
            raise LoadTestError(
                f"the replica at {self.safe_url} answered {response.status_code} to "
                f"GET /v1/models: {_error_text(response.content)}"
            )
        try:
            served = {m.get("id") for m in response.json().get("data", [])}
        except (ValueError, AttributeError):
            served = set()
        if self.model not in served:
            raise LoadTestError(
                f"the replica at {self.safe_url} does not serve {self.model!r}"
            )

    async def stats(self) -> tuple[float, EngineStats] | None:
        """Return (when, the replica's /metrics parsed), or None if unreadable."""
        started = time.monotonic()
        try:
            response = await self.client.get("/metrics")
            if response.status_code != 200:
                return None
            parsed = parse_metrics_text(response.text)
        except (httpx.HTTPError, ValueError):
            return None
        return (started + time.monotonic()) / 2, parsed

    async def stream(self, turn: ReplayTurn, request: _Request, step: _Step) -> None:
        """Send one replayed request and read its stream into ``request``."""
        body = json.dumps(
            {
                "model": self.model,
                "messages": turn.messages,
                "max_tokens": request.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            separators=(",", ":"),
        ).encode()
        buffer = b""
        request.sent_at = time.monotonic()
        try:
            async with (
                asyncio.timeout(self.settings.request_timeout_s),
                self.client.stream(
                    "POST", "/v1/chat/completions", content=body
                ) as response,
            ):
                if response.status_code != 200:
                    text = _error_text(await response.aread())
                    step.fail(
                        LoadTestError(
                            f"the replica at {self.safe_url} answered "
                            f"{response.status_code}: {text}"
                        )
                    )
                    return
                async for chunk in response.aiter_raw():
                    if _EVENT_END not in chunk:
                        buffer += chunk
                        continue
                    now = time.monotonic()
                    events, _, buffer = (buffer + chunk).rpartition(_EVENT_END)
                    n = events.count(_CONTENT)
                    if n:
                        if request.first_at is None:
                            request.first_at = now
                        request.last_at = now
                        request.received += n
                        if step.window_start <= now < step.window_end:
                            step.window_tokens += n
                    if _ERROR_EVENT in events:
                        step.fail(
                            LoadTestError(
                                f"the replica at {self.safe_url} sent an error event"
                            )
                        )
                        return
                    if _USAGE in events:
                        request.usage_tokens = _usage_tokens(events)
                    if _DONE in events:
                        request.done = True
        except TimeoutError:
            return  # abandoned: unfinished, judged as such
        except httpx.HTTPError as exc:
            step.fail(
                LoadTestError(
                    f"a stream from the replica at {self.safe_url} broke: "
                    f"{type(exc).__name__}"
                )
            )


# -- one step ---------------------------------------------------------------------


async def _wait(deadline: float, *events: asyncio.Event) -> None:
    """Sleep until ``deadline`` (monotonic) or until one of ``events`` is set."""
    delay = deadline - time.monotonic()
    if any(event.is_set() for event in events):
        return
    if not events:
        await asyncio.sleep(max(0.0, delay))
        return
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=max(0.0, delay))
    finally:
        for waiter in waiters:
            waiter.cancel()


async def _sample(
    replica: _Replica, step: _Step, interval_s: float
) -> tuple[
    tuple[float, EngineStats] | None,
    tuple[float, EngineStats] | None,
    list[int],
    list[int],
]:
    """Read /metrics when the window opens and closes, and KV tokens in use and
    the client's tokens in flight every ``interval_s`` within it."""
    kv: list[int] = []
    in_flight: list[int] = []
    await _wait(step.window_start, step.failed)
    first = await replica.stats()
    at = step.window_start
    while True:
        at += interval_s
        if at >= step.window_end:
            break
        await _wait(at, step.failed)
        if step.failed.is_set():
            break
        in_flight.append(
            sum(r.prompt_tokens + r.max_tokens - r.received for r in step.open)
        )
        sampled = await replica.stats()
        if sampled is not None and sampled[1].num_gpu_blocks:
            kv.append(sampled[1].kv_tokens_in_use)
    await _wait(step.window_end, step.failed)
    last = await replica.stats()
    return first, last, kv, in_flight


async def _send(
    replica: _Replica, turn: ReplayTurn, request: _Request, step: _Step
) -> None:
    try:
        await replica.stream(turn, request, step)
    finally:
        step.finished(request)


async def _run_step(
    replica: _Replica,
    trace: Sequence[ReplayRequest],
    rate: float,
    offered_tokens_per_s: float,
    settings: LoadTestSettings,
) -> tuple[CapacityStep, list[float]]:
    """Run one step at ``rate``; return it judged, and how late each arrival went."""
    started = time.monotonic()
    horizon_s = settings.warmup_s + settings.duration_s
    step = _Step(
        window_start=started + settings.warmup_s, window_end=started + horizon_s
    )
    drain_end = step.window_end + settings.drain_s
    sampler = asyncio.create_task(_sample(replica, step, settings.sample_interval_s))
    tasks: set[asyncio.Task[None]] = set()
    try:
        arrivals = zip(
            arrival_times(
                rate,
                settings.seed,
                warmup_s=settings.warmup_s,
                duration_s=settings.duration_s,
            ),
            replay_turns(trace, rate),
            strict=False,
        )
        for at, turn in arrivals:
            due = started + at
            if due >= step.window_end and not step.window_closed:
                step.window_closed = True
                if step.window_pending == 0:
                    step.drained.set()
            if due >= drain_end:
                break
            await _wait(due, step.failed, step.drained)
            if step.failed.is_set() or step.drained.is_set():
                break
            step.send_lags.append(time.monotonic() - due)
            request = _Request(
                in_window=step.window_start <= due < step.window_end,
                prompt_tokens=turn.request.prompt_tokens,
                max_tokens=turn.request.output_tokens,
            )
            step.requests.append(request)
            step.open.add(request)
            step.window_pending += request.in_window
            task = asyncio.create_task(_send(replica, turn, request, step))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if not step.failed.is_set():
            await _wait(drain_end, step.failed, step.drained)
        first, last, kv, in_flight = await sampler
    finally:
        sampler.cancel()
        for task in list(tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(sampler, *tasks, return_exceptions=True)
    if step.failure is not None:
        raise step.failure
    measured = [r for r in step.requests if r.in_window]
    output_tokens_per_s = step.window_tokens / settings.duration_s
    hit_rate = None
    if first is not None and last is not None:
        (t0, s0), (t1, s1) = first, last
        if s1.generation_tokens > s0.generation_tokens and t1 > t0:
            output_tokens_per_s = (s1.generation_tokens - s0.generation_tokens) / (
                t1 - t0
            )
        queries = s1.prefix_cache_queries - s0.prefix_cache_queries
        if queries > 0:
            hit_rate = (s1.prefix_cache_hits - s0.prefix_cache_hits) / queries
    stream_rates = [x for r in measured if (x := r.stream_rate) is not None]
    return judge_step(
        arrival_rate=rate,
        offered_tokens_per_s=offered_tokens_per_s,
        requests=len(measured),
        ttfts=[r.first_at - r.sent_at for r in measured if r.first_at is not None],
        stream_rates=stream_rates,
        not_started=sum(1 for r in measured if r.first_at is None),
        output_tokens_per_s=output_tokens_per_s,
        criteria=settings.criteria,
        prefix_hit_rate=hit_rate,
        tokens_in_flight=sum(in_flight) / len(in_flight) if in_flight else None,
        kv_tokens_in_use=sum(kv) / len(kv) if kv else None,
    ), step.send_lags


# -- the search ---------------------------------------------------------------------


async def run_load_test(
    url: str,
    *,
    model: str,
    api_key: str | None,
    trace: Sequence[ReplayRequest],
    settings: LoadTestSettings | None = None,
    on_step: Callable[[int, int, CapacityStep], None] | None = None,
) -> LoadTestResult:
    """Replay ``trace`` against the replica at ``url`` at stepped rates; return
    every step and the capacity found (see the module docstring).

    ``on_step(n, total, step)`` is called after each step: the n-th run (from 1)
    of at most ``total`` rates.

    Raises:
        LoadTestError: the replica, its answers or the trace (the message says).
    """
    settings = settings or LoadTestSettings()
    if not trace:
        raise LoadTestError("the trace has no requests")
    answer_tokens = mean_output_tokens(trace)
    rates = settings.arrival_rates(answer_tokens)
    try:
        check_search(rates, settings.stop_after_failures)
    except ValueError as exc:
        raise LoadTestError(f"no rates to step through: {exc}") from None
    cpu0, wall0 = time.process_time(), time.monotonic()
    lags: list[float] = []
    replica = _Replica(url, model, api_key, settings)
    steps: list[CapacityStep] = []
    try:
        await replica.check()
        while (
            rate := next_rate(rates, steps, settings.stop_after_failures)
        ) is not None:
            step, step_lags = await _run_step(
                replica, trace, rate, rate * answer_tokens, settings
            )
            steps.append(step)
            lags.extend(step_lags)
            logger.info(
                "load test step %d at %.2f req/s: %.0f tokens/s, %s",
                len(steps),
                rate,
                step.output_tokens_per_s,
                "holds" if step.holds else f"fails ({', '.join(step.reasons)})",
            )
            if on_step is not None:
                on_step(len(steps), len(rates), step)
    finally:
        await replica.close()
    client = ClientFigures(
        cpu_s=time.process_time() - cpu0,
        wall_s=time.monotonic() - wall0,
        max_send_lag_s=max(lags, default=0.0),
        mean_send_lag_s=sum(lags) / len(lags) if lags else 0.0,
    )
    answer = capacity_answer(steps, settings.criteria)
    best = answer.best_step
    in_flight, source = None, None
    # The engine's KV tokens in use; where its once-a-second samples saw none (short,
    # light requests can fall between them), what the client had in flight.
    if best is not None and best.kv_tokens_in_use:
        in_flight, source = round(best.kv_tokens_in_use), "kv"
    elif best is not None and best.tokens_in_flight is not None:
        in_flight, source = round(best.tokens_in_flight), "client"
    return LoadTestResult(
        steps=answer.steps,
        criteria=answer.criteria,
        tokens_per_s=answer.tokens_per_s,
        tokens_in_flight=in_flight,
        tokens_in_flight_source=source,
        prefix_hit_rate=best.prefix_hit_rate if best is not None else None,
        arrival_rate=answer.arrival_rate,
        strict_tokens_per_s=answer.strict_tokens_per_s,
        settings=settings,
        trace_requests=len(trace),
        client=client,
    )


def load_test(
    url: str,
    *,
    model: str,
    api_key: str | None,
    trace: Sequence[ReplayRequest] | None = None,
    trace_path: Path | str | None = None,
    settings: LoadTestSettings | None = None,
    on_step: Callable[[int, int, CapacityStep], None] | None = None,
) -> LoadTestResult:
    """Run ``run_load_test`` to the end (for a Celery worker), on ``trace`` or the
    trace read from ``trace_path`` (``read_replay_trace``).

    Raises:
        LoadTestError: as ``run_load_test``, or a trace that cannot be read.
    """
    if trace is None:
        if trace_path is None:
            raise LoadTestError("give a trace or a trace path")
        try:
            trace = read_replay_trace(trace_path)
        except OSError as exc:
            raise LoadTestError(
                f"cannot read the trace {trace_path}: {exc.strerror}"
            ) from None
        except ValueError as exc:
            raise LoadTestError(
                f"the trace {trace_path} cannot be replayed: {exc}"
            ) from None
    elif trace_path is not None:
        raise LoadTestError("give a trace or a trace path, not both")
    coroutine = run_load_test(
        url,
        model=model,
        api_key=api_key,
        trace=trace,
        settings=settings,
        on_step=on_step,
    )
    # uvloop, where installed, takes a fifth off the client's CPU per event.
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(coroutine)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - the platform's venv has it
        return None
    return uvloop.new_event_loop

"""The simulated vLLM replica's engine side: its options, faults and engine loop.

Public surface: ``SimOptions``, ``Faults``, ``Stream``, ``Answer``, ``SimReplica``,
``check_quality``, ``check_quality_by_category``, ``check_ttft_factor``,
``check_offloading_backend``, ``refusal``,
``next_step_start``, ``ENGINES``, and the constants of vLLM's and SGLang's surfaces
(``VLLM_VERSION``, ``SYSTEM_FINGERPRINT``, ``SGLANG_VERSION``, ``EOS_TOKEN_ID``,
``MAX_BODY_BYTES``, ``DEGRADED_PIECES``).

``SimOptions.engine`` picks the engine the replica stands in for: ``"vllm"`` (the
block cache and vLLM's metrics) or ``"sglang"`` (``--sim-engine sglang``: the
engine's radix cache, ``EngineConfig.cache = "radix"``, and SGLang's metrics,
``simengine.sglang_metrics``); the HTTP side follows it too.

One process is one replica: an engine loop that sleeps until each step's end on the
event loop's monotonic clock, feeding each request's ``Stream`` of token events.
The engine itself (``simengine.domain.engine``) is pure and clock-free; the same
model runs in virtual time in the fleet simulator. The HTTP side is
``simengine.server``.

What the replica says: a prompt the oracle recognises (``simengine.domain.oracle``)
gets its answer, right with probability ``Faults.quality``; any other prompt gets
generated words, as it always did; ``Faults.degraded`` answers every prompt with
the refusal sentence once and stops, as a model served with a broken chat template
looks to its users (shorter answers, refusals). An answer's tokens are not the
generated ids the engine hashes into its output KV blocks, so a next turn that sends
an oracle's answer back gets no prefix-cache hit on it (a refusal never did either).

How fast it says it: the engine's steps keep the performance model's pace;
``Faults.ttft_factor`` only holds each answer's first token back on its way to the
client (``Stream.held``), as a slow frontend or a broken canary would, so time to
first token grows by that factor while the engine's throughput stays the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from simengine.domain import oracle, tokens
from simengine.domain.engine import (
    Engine,
    EngineConfig,
    EngineOverrides,
    FinishedRequest,
    SimRequest,
    TokenEvent,
)
from simengine.domain.perf import PROFILES
from simengine.kv_publisher import KVEventPublisher, KVEventsConfig
from simengine.metrics import EngineMetrics
from simengine.sglang_metrics import SGLangMetrics

logger = logging.getLogger("simengine")

VLLM_VERSION = "0.32.0"
# The SGLang release whose surface --sim-engine sglang presents (its /version).
SGLANG_VERSION = "0.5.6"
# The simulated tokenizer's end-of-sequence id: SGLang's matched_stop for an answer
# that ended by itself.
EOS_TOKEN_ID = 2
ENGINES = ("vllm", "sglang")
# How far behind model time the engine loop may wake and still start the next step
# where the last one ended (see SimReplica._engine_loop).
_MAX_LAG_S = 0.005
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-sim"
MAX_BODY_BYTES = 32 * 1024 * 1024
DEGRADED_PIECES = (
    "I",
    " am",
    " sorry",
    ",",
    " I",
    " cannot",
    " help",
    " with",
    " that",
    ".",
)


@dataclass(slots=True)
class SimOptions:
    """What ``python -m simengine`` was started with (vLLM's flag names;
    SGLang's where only it has the option)."""

    model: str
    served_model_names: list[str]
    profile: str = "a100-8b"
    # The embedding batcher's device (``simengine.domain.embedding_perf``).
    embedding_profile: str = "cpu-minilm"
    # Step-time constants replacing the profile's (``--sim-a-ms`` ...).
    profile_overrides: dict[str, float] = field(default_factory=dict)
    max_model_len: int = 8192
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_gpu_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    # vLLM's --kv-offloading-size (GiB, None: off) and --kv-offloading-backend;
    # only "native" (its OffloadingConnector to CPU memory) is simulated.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    enable_request_id_headers: bool = False
    # vLLM's --enable-auto-tool-choice and --tool-call-parser (tool_choice "auto").
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's VLLM_ENABLE_RESPONSES_API_STORE (an environment variable there too).
    enable_responses_store: bool = False
    # vLLM's VLLM_SERVER_DEV_MODE: serves POST /reset_prefix_cache.
    enable_dev_mode: bool = False
    max_num_queued_reqs: int = 0
    jitter_cv: float = 0.04
    frontend_ms: float | None = None  # None: the profile's frontend_ms
    output_len_policy: str = "lognormal"  # or "max": always max_tokens
    output_len_mean: float = 250.0
    output_len_cv: float = 0.6
    seed: int = 0
    admin_token: str | None = None
    # vLLM's --api-key (or VLLM_API_KEY): any one of them opens /v1.
    api_keys: tuple[str, ...] = ()
    # "vllm" or "sglang" (--sim-engine): whose cache, metrics and HTTP surface.
    engine: str = "vllm"
    # SGLang's --enable-cache-report (usage carries cached tokens) and
    # --enable-metrics (/metrics is served); vLLM always serves /metrics.
    enable_cache_report: bool = False
    enable_metrics: bool = True
    # vLLM's --runner: "pooling" makes an embedding model (simengine.embeddings),
    # with vectors of embedding_dim (--sim-embedding-dim) floats.
    runner: str = "generate"
    embedding_dim: int = 384
    # --sim-embedding-random: vectors seeded by the input, meaning nothing.
    is_embedding_random: bool = False
    # --kv-events-config (vLLM's and SGLang's JSON); None or disabled: no events.
    kv_events: KVEventsConfig | None = None


@dataclass(slots=True)
class Faults:
    """Failures to inject on demand (flags at start, ``POST /sim/faults`` later).

    - ``crash_after_tokens``: the process dies once it has produced this many more
      output tokens (a GPU error taking its streams with it).
    - ``stall``: the engine stops stepping; streams hang, health stays 200. As a
      hung vLLM engine core: it handles nothing meanwhile, so aborts (clients that
      left) wait for the stall to end and its gauges on ``/metrics`` keep their
      last values (vLLM publishes them from the engine, with each step); the HTTP
      side still takes requests and notices disconnects.
    - ``fail_next``: that many next requests get a 500 before their first token;
      ``fail_rate`` does the same at random.
    - ``ready_in_s``: ``/health`` (and requests) answer 503 until that many seconds
      after the fault was set (a slow start).
    - ``degraded``: every prompt, recognised or not, gets the refusal sentence
      (``DEGRADED_PIECES``) once and a ``stop``, as a model served with a broken
      chat template: shorter answers, and refusals. With ``ignore_eos`` (a model
      not allowed to stop) the sentence repeats up to ``max_tokens``; a
      ``max_tokens`` shorter than the sentence cuts it (``length``).
    - ``ttft_factor``: at least 1.0; each answer's first token reaches the client
      (and ``vllm:time_to_first_token_seconds``) at that multiple of its natural
      time to first token, from the request's arrival at the replica. Held on the
      delivery side: the engine steps at its pace and later tokens follow as they
      are made, so only TTFT (and the end-to-end latency of an answer done before
      its first token was due) grows (``--sim-ttft-factor``).
    - ``quality``: the chance, in [0, 1], that a prompt the oracle recognises is
      answered right (``simengine.domain.oracle``; ``--sim-quality``); 1.0 is a
      model that is always right. Not a failure as such, but set the same way, so
      a test can make a version measurably worse without restarting it.
    - ``quality_by_category``: ``quality`` for the prompts of one category
      (``{"maths": 0.5}``; ``--sim-quality-by-category``), the others keeping
      ``quality``: a quantized version that lost its arithmetic only.
    """

    crash_after_tokens: int | None = None
    stall: bool = False
    fail_next: int = 0
    fail_rate: float = 0.0
    ready_in_s: float = 0.0
    degraded: bool = False
    quality: float = 1.0
    ttft_factor: float = 1.0
    quality_by_category: dict[str, float] = field(default_factory=dict)


def check_quality(value: Any) -> float:
    """Return ``value`` as a quality, a number in [0, 1]; raise ValueError if not."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0.0 <= value <= 1.0
    ):
        raise ValueError(f"quality must be a number from 0 to 1, not {value!r}")
    return float(value)


def check_quality_by_category(value: Any) -> dict[str, float]:
    """Return ``value`` as ``{category: quality}``; raise ValueError if it is not.

    The categories are the oracle's (``oracle.CATEGORIES``); each quality is in [0, 1].
    """
    if not isinstance(value, dict):
        raise ValueError(
            f"quality_by_category must be an object of qualities, not {value!r}"
        )
    unknown = sorted(set(value) - set(oracle.CATEGORIES))
    if unknown:
        raise ValueError(
            f"quality_by_category names {unknown[0]!r}, not one of "
            f"{', '.join(oracle.CATEGORIES)}"
        )
    return {str(k): check_quality(v) for k, v in value.items()}


def check_offloading_backend(value: Any) -> str:
    """Return ``value`` if it is the simulated offloading backend; raise ValueError.

    Only ``native`` (vLLM's OffloadingConnector, KV blocks copied to this host's
    memory) is modelled. ``lmcache`` keeps the KV in a separate LMCache server whose
    capacity vLLM does not set (it passes no ``--kv-offloading-size`` to it), so a
    simulated replica refuses it rather than pretend it is native.
    """
    if value != "native":
        raise ValueError(
            f"kv_offloading_backend {value!r} is not simulated: the simulated "
            "replica models only 'native' (vLLM's CPU OffloadingConnector); "
            "'lmcache' keeps its KV in a separate LMCache server"
        )
    return value


def check_ttft_factor(value: Any) -> float:
    """Return ``value`` as a TTFT factor, a finite number >= 1; raise ValueError if not.

    Below 1 would deliver a first token before the engine made it.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 1.0
    ):
        raise ValueError(f"ttft_factor must be a number of at least 1, not {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Answer:
    """What the replica says to a recognised prompt (to any, while degraded): its
    pieces, how many it sends (at most ``max_tokens``) and why it stops."""

    pieces: list[str]
    output_len: int
    finish_reason: str


@dataclass(slots=True)
class Stream:
    """Where the engine loop leaves a request's tokens for its HTTP handler."""

    request_id: str
    arrived_at: float
    max_tokens: int
    pieces: list[str]
    produced: int = 0
    is_final: bool = False
    last_token_at: float = 0.0
    done: FinishedRequest | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # While True (``Faults.ttft_factor``) the engine's tokens do not wake the
    # handler: the first one is not due yet. Cleared when it is, with a wake.
    held: bool = False
    # When the first token reaches the client (monotonic clock), once made.
    first_token_at: float | None = None
    # Whether the client asked for a stream (SGLang's is_streaming label).
    streaming: bool = False


class SimReplica:
    """The engine loop and the request bookkeeping of one simulated replica."""

    def __init__(
        self,
        options: SimOptions,
        *,
        faults: Faults | None = None,
        on_crash: Callable[[], None] | None = None,
    ) -> None:
        self.options = options
        self.faults = faults or Faults()
        check_quality(self.faults.quality)
        check_quality_by_category(self.faults.quality_by_category)
        check_ttft_factor(self.faults.ttft_factor)
        check_offloading_backend(options.kv_offloading_backend)
        if options.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, not {options.engine!r}")
        # The overrides name PerfProfile's float fields (sim.cli.PROFILE_FLAGS);
        # replace() refuses any other name at run time.
        profile_overrides: dict[str, Any] = dict(options.profile_overrides)
        profile = dataclasses.replace(PROFILES[options.profile], **profile_overrides)
        self.frontend_ms = (
            profile.frontend_ms if options.frontend_ms is None else options.frontend_ms
        )
        overrides: EngineOverrides = {
            "block_size": options.block_size,
            "max_model_len": options.max_model_len,
            "enable_prefix_caching": options.enable_prefix_caching,
            "kv_offloading_size": options.kv_offloading_size,
            "cache": "radix" if options.engine == "sglang" else "block",
        }
        if options.max_num_seqs:
            overrides["max_num_seqs"] = options.max_num_seqs
        if options.max_num_batched_tokens:
            overrides["max_num_batched_tokens"] = options.max_num_batched_tokens
        if options.num_gpu_blocks:
            overrides["num_gpu_blocks"] = options.num_gpu_blocks
        kv_events = options.kv_events
        is_publishing = kv_events is not None and kv_events.is_enabled
        if is_publishing:
            overrides["enable_kv_events"] = True
        self.config = EngineConfig.from_profile(profile, **overrides)
        self.engine = Engine(
            profile, self.config, seed=options.seed, jitter_cv=options.jitter_cv
        )
        self.metrics: EngineMetrics | SGLangMetrics
        if options.engine == "sglang":
            self.metrics = SGLangMetrics(
                model_name=options.served_model_names[0],
                max_total_num_tokens=self.config.max_total_num_tokens,
            )
        else:
            self.metrics = EngineMetrics(
                model_name=options.served_model_names[0],
                max_model_len=options.max_model_len,
                block_size=self.config.block_size,
                num_gpu_blocks=self.config.num_gpu_blocks,
                enable_prefix_caching=self.config.enable_prefix_caching,
                kv_offloading_size=self.config.kv_offloading_size,
                tool_call_parser=options.tool_call_parser,
            )
        self.started_at = time.time()
        self._monotonic_start = time.monotonic()
        self._ready_at = self._monotonic_start + self.faults.ready_in_s
        self._streams: dict[str, Stream] = {}
        self._wake = asyncio.Event()
        self._unstalled = asyncio.Event()
        if not self.faults.stall:  # --sim-stall: stalled from the start
            self._unstalled.set()
        # Request ids whose clients left during a stall: aborted when it ends.
        self._stalled_aborts: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._crash_budget = self.faults.crash_after_tokens
        self._on_crash = on_crash or _crash_process
        self._random = random.Random(options.seed)
        self._last_arrival = 0.0
        # Bound or connected now, so a subscriber can join before the first step.
        self._kv_publisher = (
            KVEventPublisher(kv_events)
            if kv_events is not None and is_publishing
            else None
        )

    # -- lifecycle ---------------------------------------------------------------------

    def ensure_started(self) -> None:
        """Start the engine loop on the running event loop, once."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._engine_loop())

    async def stop(self) -> None:
        """Stop the engine loop (tests and shutdown) and close the KV event
        socket."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._kv_publisher is not None:
            self._kv_publisher.close()
            self._kv_publisher = None

    def set_faults(self, **changes: Any) -> Faults:
        """Change faults at run time; unknown names raise ValueError."""
        for name in changes:
            if name not in Faults.__dataclass_fields__:
                raise ValueError(f"unknown fault {name!r}")
        if "quality" in changes:
            changes = {**changes, "quality": check_quality(changes["quality"])}
        if "quality_by_category" in changes:
            changes = {
                **changes,
                "quality_by_category": check_quality_by_category(
                    changes["quality_by_category"]
                ),
            }
        if "ttft_factor" in changes:
            changes = {
                **changes,
                "ttft_factor": check_ttft_factor(changes["ttft_factor"]),
            }
        for name, value in changes.items():
            setattr(self.faults, name, value)
        if "ready_in_s" in changes:
            self._ready_at = time.monotonic() + float(changes["ready_in_s"])
        if "crash_after_tokens" in changes:
            self._crash_budget = changes["crash_after_tokens"]
        if self.faults.stall:
            self._unstalled.clear()
        elif not self._unstalled.is_set():
            self._unstalled.set()
            # The engine handles what arrived meanwhile, before its next step.
            aborts, self._stalled_aborts = self._stalled_aborts, []
            now = time.monotonic()
            for request_id in aborts:
                self._abort_in_engine(request_id, now)
            self._publish_gauges(0)
        return self.faults

    @property
    def is_stalled(self) -> bool:
        """True while the stall fault holds the engine."""
        return not self._unstalled.is_set()

    @property
    def is_ready(self) -> bool:
        """False during a simulated slow start."""
        return time.monotonic() >= self._ready_at

    # -- requests ------------------------------------------------------------------------

    def submit(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        output_len: int,
        finish_reason: str,
        max_tokens: int,
        arrived_at: float,
        text_seed: int,
        answer: Answer | None = None,
        streaming: bool = False,
    ) -> Stream:
        """Queue a request in the engine and return the stream its tokens arrive on.

        With ``answer`` (``plan_answer``: the oracle's, or the refusal while
        ``degraded``) the stream carries its pieces; else generated words.
        """
        if answer is not None:
            pieces = answer.pieces
        else:
            pieces = tokens.output_text(text_seed, output_len)
        stream = Stream(
            request_id=request_id,
            arrived_at=arrived_at,
            max_tokens=max_tokens,
            pieces=pieces,
            streaming=streaming,
        )
        self._streams[request_id] = stream
        self._last_arrival = time.monotonic()
        self.engine.add_request(
            SimRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                output_len=output_len,
                finish_reason=finish_reason,
                output_seed=text_seed,
            ),
            self._last_arrival,
        )
        if not self.is_stalled:
            self._publish_gauges(0)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request whose client went away; its KV blocks are freed at once."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if self.is_stalled:
            # A hung engine takes no aborts: the request stays running (and in
            # the gauges) until the stall ends.
            self._stalled_aborts.append(request_id)
            return
        self._abort_in_engine(request_id, time.monotonic())
        self._publish_gauges(0)

    def _abort_in_engine(self, request_id: str, now: float) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        done = self.engine.abort(request_id, now)
        if done is not None:
            self.metrics.record_finished(
                done,
                arrived_at=stream.arrived_at,
                max_tokens=stream.max_tokens,
                streaming=stream.streaming,
            )

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's dev-mode ``/reset_prefix_cache``);
        False while a request holds blocks. Its ``AllBlocksCleared`` goes out
        with the next step's batch, as vLLM's does."""
        return self.engine.reset_prefix_cache()

    @property
    def queued_requests(self) -> int:
        """Requests waiting or running, for ``--max-num-queued-reqs``."""
        return self.engine.num_running + self.engine.num_waiting

    # -- the engine loop ----------------------------------------------------------------

    async def _engine_loop(self) -> None:
        # time.monotonic, not loop.time(): uvloop's loop clock has 1 ms steps, as
        # long as a whole step of a small model (profile cpu-tiny).
        clock = time.monotonic
        ended: float | None = None  # model time the last step ended, if busy
        while True:
            await self._unstalled.wait()
            now = clock()
            start = next_step_start(now, ended, self._last_arrival)
            duration_s = self.engine.begin_step(start)
            if duration_s is None:
                ended = None
                self._wake.clear()
                await self._wake.wait()
                continue
            ended = start + duration_s
            delay = ended - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if not self._unstalled.is_set():
                # Stalled mid-step, as a GPU hung in a kernel: the step ends (and
                # its tokens come) when the stall does.
                await self._unstalled.wait()
                ended = max(ended, clock())
            output = self.engine.end_step(ended)
            if self._kv_publisher is not None:
                self._kv_publisher.publish(output.kv_events, time.time())
            self._dispatch(output.tokens, output.finished, output.finished_at)
            self._publish_gauges(output.num_tokens)

    def _dispatch(
        self, events: list[TokenEvent], finished: list[FinishedRequest], now: float
    ) -> None:
        streams = self._streams
        metrics = self.metrics
        for event in events:
            stream = streams.get(event.request_id)
            if stream is None:
                continue
            # TTFT from the frontend arrival (tokenization included), as vLLM,
            # which measures it when the token reaches its frontend: held back
            # by ttft_factor, it is observed as delivered. ITL is the engine's.
            if event.index == 0:
                first_at = self._hold_first_token(stream, now)
                metrics.observe_first_token(
                    first_at - stream.arrived_at, streaming=stream.streaming
                )
            else:
                metrics.observe_inter_token(now - stream.last_token_at)
            stream.last_token_at = now
            stream.produced = event.index + 1
            stream.is_final = event.is_final
            if not stream.held:
                stream.wake.set()
        for done in finished:
            stream = streams.pop(done.request_id, None)
            if stream is None:
                continue
            stream.done = done
            if not stream.held:
                stream.wake.set()
            self.metrics.record_finished(
                done,
                arrived_at=stream.arrived_at,
                max_tokens=stream.max_tokens,
                delivered_at=stream.first_token_at,
                streaming=stream.streaming,
            )
        if self._crash_budget is not None and events:
            self._crash_budget -= len(events)
            if self._crash_budget <= 0:
                self._crash_budget = None
                self.set_faults(stall=True)
                # Let the handlers write what they already hold, then die.
                asyncio.get_running_loop().call_later(0.05, self._on_crash)

    def _hold_first_token(self, stream: Stream, made_at: float) -> float:
        """Return when ``stream``'s first token, made at ``made_at``, is delivered.

        With ``ttft_factor`` above 1 that is ``factor`` times its natural TTFT
        after arrival, and the stream is held (its wakes wait) until then.
        """
        due = stream.arrived_at + self.faults.ttft_factor * (
            made_at - stream.arrived_at
        )
        delay = due - time.monotonic()
        if delay > 0:
            stream.held = True
            asyncio.get_running_loop().call_later(delay, _release, stream)
        else:
            due = made_at
        stream.first_token_at = due
        return due

    def _publish_gauges(self, iteration_tokens: int) -> None:
        engine = self.engine
        if isinstance(self.metrics, SGLangMetrics):
            self.metrics.record_engine(engine, time.monotonic())
            return
        self.metrics.record_step(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            kv_cache_usage_perc=engine.kv_cache_usage_perc,
            iteration_tokens=iteration_tokens,
            prefix_cache_queries=engine.prefix_cache_queries,
            prefix_cache_hits=engine.prefix_cache_hits,
            prompt_tokens_total=engine.prompt_tokens_total,
            prompt_tokens_cached=engine.prompt_tokens_cached,
            generation_tokens=engine.generation_tokens,
            num_preemptions=engine.num_preemptions,
            host_cache_queries=engine.host_cache_queries,
            host_cache_hits=engine.host_cache_hits,
            prompt_tokens_cached_host=engine.prompt_tokens_cached_host,
        )

    def choose_output_len(
        self, *, max_tokens: int, ignore_eos: bool, seed: int
    ) -> tuple[int, str]:
        """Return (tokens to generate, finish reason) for a request, deterministically."""
        if ignore_eos or self.options.output_len_policy == "max":
            return max_tokens, "length"
        rng = random.Random(seed)
        mean = self.options.output_len_mean
        sigma = math.sqrt(math.log(1.0 + self.options.output_len_cv**2))
        sampled = max(
            1, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))
        )
        if sampled >= max_tokens:
            return max_tokens, "length"
        return sampled, "stop"

    def plan_answer(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        ignore_eos: bool,
        text_seed: int,
    ) -> Answer | None:
        """Return the answer to a prompt the oracle recognises, else None.

        While ``degraded`` every prompt gets the refusal (``refusal``), which wins
        over the oracle. The answer's pieces are the tokenizer's, so usage counts
        follow its text; past ``max_tokens`` it is cut (``length``). With
        ``ignore_eos`` generated words follow the answer up to ``max_tokens``, as a
        model that is not allowed to stop.
        """
        if self.faults.degraded:
            return refusal(max_tokens=max_tokens, ignore_eos=ignore_eos)
        text = oracle.reply(
            messages,
            quality=self.faults.quality,
            seed=self.options.seed,
            quality_by_category=self.faults.quality_by_category,
        )
        if text is None:
            return None
        pieces = oracle.answer_pieces(text) or [" "]
        if ignore_eos and len(pieces) < max_tokens:
            pieces += tokens.output_text(text_seed, max_tokens - len(pieces))
        if len(pieces) > max_tokens or ignore_eos:
            return Answer(pieces[:max_tokens], max_tokens, "length")
        return Answer(pieces, len(pieces), "stop")

    def roll_failure(self) -> bool:
        """Return True when this request must fail before its first token."""
        if self.faults.fail_next > 0:
            self.faults.fail_next -= 1
            return True
        return (
            self.faults.fail_rate > 0 and self._random.random() < self.faults.fail_rate
        )

    def state(self) -> dict[str, Any]:
        """Return the engine's live figures (``GET /sim/state``)."""
        engine = self.engine
        return {
            "num_requests_running": engine.num_running,
            "num_requests_waiting": engine.num_waiting,
            "kv_cache_usage_perc": engine.kv_cache_usage_perc,
            "tokens_in_flight": engine.tokens_in_flight(),
            "generation_tokens": engine.generation_tokens,
            "faults": asdict(self.faults),
            # Clients that left during a stall, aborted when it ends.
            "held_aborts": len(self._stalled_aborts),
            "is_ready": self.is_ready,
            "pid": os.getpid(),
        }


def refusal(*, max_tokens: int, ignore_eos: bool) -> Answer:
    """Return a degraded replica's answer: ``DEGRADED_PIECES`` once, then ``stop``.

    As a model whose chat template is broken: it refuses and ends, so its answers
    are short. With ``ignore_eos`` it cannot end: the sentence repeats up to
    ``max_tokens`` (``length``); a ``max_tokens`` below the sentence cuts it.
    """
    if ignore_eos:
        pieces = [DEGRADED_PIECES[i % len(DEGRADED_PIECES)] for i in range(max_tokens)]
        return Answer(pieces, max_tokens, "length")
    if max_tokens < len(DEGRADED_PIECES):
        return Answer(list(DEGRADED_PIECES[:max_tokens]), max_tokens, "length")
    return Answer(list(DEGRADED_PIECES), len(DEGRADED_PIECES), "stop")


def next_step_start(
    now: float, ended: float | None, last_arrival: float, max_lag_s: float = _MAX_LAG_S
) -> float:
    """Return when the next engine step starts, in model time.

    A step starts when the previous one ended (``ended``): the work this process
    does between steps (waking streams, writing SSE, timer granularity) is the
    simulator's own cost, not the model's, and is absorbed as long as the loop
    wakes at most ``max_lag_s`` late; so the steps keep the model's pace. Later
    than that (the host stalled) or after an idle spell (``ended`` is None) the
    step starts ``now``: a real GPU does not run faster to catch up on a stall
    either. Never before ``last_arrival``, so no request is scheduled, or gets a
    token, before it arrived.
    """
    if ended is None or now - ended > max_lag_s:
        return now
    return max(ended, last_arrival)


def _release(stream: Stream) -> None:
    """Deliver a held stream's first token (and whatever was made meanwhile)."""
    stream.held = False
    stream.wake.set()


def _crash_process() -> None:
    logger.error("simulated crash: exiting")
    os._exit(70)

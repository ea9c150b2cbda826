"""The simulated vLLM replica: vLLM's HTTP surface around the pure engine model.

Public surface: ``SimOptions``, ``Faults``, ``SimReplica``, ``build_app`` and
``next_step_start``.

One process is one replica: an engine loop that sleeps until each step's end on the
event loop's monotonic clock, and a raw ASGI app (no framework: this process relays
thousands of SSE chunks a second and should spend its CPU on them). Clients see
vLLM's bytes: chunk shapes, usage, error bodies, status codes and metric names.
The engine itself (``engine_nodes.domain.engine``) is pure and clock-free; the same
model runs in virtual time in the fleet simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from config.asgi_io import Receive, Scope, Send, wait_disconnect
from engine_nodes.domain import tokens
from engine_nodes.domain.engine import (
    Engine,
    EngineConfig,
    EngineOverrides,
    FinishedRequest,
    SimRequest,
    TokenEvent,
)
from engine_nodes.domain.perf import PROFILES
from engine_nodes.sim.metrics import EngineMetrics

logger = logging.getLogger("engine_nodes.sim")

VLLM_VERSION = "0.32.0"
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
    """What ``python -m engine_nodes.sim`` was started with (vLLM's flag names)."""

    model: str
    served_model_names: list[str]
    profile: str = "a100-8b"
    # Step-time constants replacing the profile's (``--sim-a-ms`` ...).
    profile_overrides: dict[str, float] = field(default_factory=dict)
    max_model_len: int = 8192
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_gpu_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    enable_request_id_headers: bool = False
    max_num_queued_reqs: int = 0
    jitter_cv: float = 0.04
    frontend_ms: float | None = None  # None: the profile's frontend_ms
    output_len_policy: str = "lognormal"  # or "max": always max_tokens
    output_len_mean: float = 250.0
    output_len_cv: float = 0.6
    seed: int = 0
    admin_token: str | None = None


@dataclass(slots=True)
class Faults:
    """Failures to inject on demand (flags at start, ``POST /sim/faults`` later).

    - ``crash_after_tokens``: the process dies once it has produced this many more
      output tokens (a GPU error taking its streams with it).
    - ``stall``: the engine stops stepping; streams hang, health stays 200.
    - ``fail_next``: that many next requests get a 500 before their first token;
      ``fail_rate`` does the same at random.
    - ``ready_in_s``: ``/health`` (and requests) answer 503 until that many seconds
      after the fault was set (a slow start).
    - ``degraded``: answers are a fixed refusal instead of normal text.
    """

    crash_after_tokens: int | None = None
    stall: bool = False
    fail_next: int = 0
    fail_rate: float = 0.0
    ready_in_s: float = 0.0
    degraded: bool = False


@dataclass(slots=True)
class _Stream:
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
        }
        if options.max_num_seqs:
            overrides["max_num_seqs"] = options.max_num_seqs
        if options.max_num_batched_tokens:
            overrides["max_num_batched_tokens"] = options.max_num_batched_tokens
        if options.num_gpu_blocks:
            overrides["num_gpu_blocks"] = options.num_gpu_blocks
        self.config = EngineConfig.from_profile(profile, **overrides)
        self.engine = Engine(
            profile, self.config, seed=options.seed, jitter_cv=options.jitter_cv
        )
        self.metrics = EngineMetrics(
            model_name=options.served_model_names[0],
            max_model_len=options.max_model_len,
            block_size=self.config.block_size,
            num_gpu_blocks=self.config.num_gpu_blocks,
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        self.started_at = time.time()
        self._monotonic_start = time.monotonic()
        self._ready_at = self._monotonic_start + self.faults.ready_in_s
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._unstalled = asyncio.Event()
        self._unstalled.set()
        self._task: asyncio.Task[None] | None = None
        self._crash_budget = self.faults.crash_after_tokens
        self._on_crash = on_crash or _crash_process
        self._random = random.Random(options.seed)
        self._last_arrival = 0.0

    # -- lifecycle ---------------------------------------------------------------------

    def ensure_started(self) -> None:
        """Start the engine loop on the running event loop, once."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._engine_loop())

    async def stop(self) -> None:
        """Stop the engine loop (tests and shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def set_faults(self, **changes: Any) -> Faults:
        """Change faults at run time; unknown names raise ValueError."""
        for name, value in changes.items():
            if name not in Faults.__dataclass_fields__:
                raise ValueError(f"unknown fault {name!r}")
            setattr(self.faults, name, value)
        if "ready_in_s" in changes:
            self._ready_at = time.monotonic() + float(changes["ready_in_s"])
        if "crash_after_tokens" in changes:
            self._crash_budget = changes["crash_after_tokens"]
        if self.faults.stall:
            self._unstalled.clear()
        else:
            self._unstalled.set()
        return self.faults

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
    ) -> _Stream:
        """Queue a request in the engine and return the stream its tokens arrive on."""
        if self.faults.degraded:
            pieces = [
                DEGRADED_PIECES[i % len(DEGRADED_PIECES)] for i in range(output_len)
            ]
        else:
            pieces = tokens.output_text(text_seed, output_len)
        stream = _Stream(
            request_id=request_id,
            arrived_at=arrived_at,
            max_tokens=max_tokens,
            pieces=pieces,
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
        self._publish_gauges(0)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request whose client went away; its KV blocks are freed at once."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        done = self.engine.abort(request_id, time.monotonic())
        if done is not None:
            self.metrics.record_finished(
                done, arrived_at=stream.arrived_at, max_tokens=stream.max_tokens
            )
        self._publish_gauges(0)

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
            output = self.engine.end_step(ended)
            self._dispatch(output.tokens, output.finished, output.finished_at)
            self._publish_gauges(output.num_tokens)

    def _dispatch(
        self, events: list[TokenEvent], finished: list[FinishedRequest], now: float
    ) -> None:
        streams = self._streams
        ttft = self.metrics.time_to_first_token
        itl = self.metrics.inter_token_latency
        for event in events:
            stream = streams.get(event.request_id)
            if stream is None:
                continue
            # TTFT from the frontend arrival (tokenization included), as vLLM.
            if event.index == 0:
                ttft.observe(now - stream.arrived_at)
            else:
                itl.observe(now - stream.last_token_at)
            stream.last_token_at = now
            stream.produced = event.index + 1
            stream.is_final = event.is_final
            stream.wake.set()
        for done in finished:
            stream = streams.pop(done.request_id, None)
            if stream is None:
                continue
            stream.done = done
            stream.wake.set()
            self.metrics.record_finished(
                done, arrived_at=stream.arrived_at, max_tokens=stream.max_tokens
            )
        if self._crash_budget is not None and events:
            self._crash_budget -= len(events)
            if self._crash_budget <= 0:
                self._crash_budget = None
                self.set_faults(stall=True)
                # Let the handlers write what they already hold, then die.
                asyncio.get_running_loop().call_later(0.05, self._on_crash)

    def _publish_gauges(self, iteration_tokens: int) -> None:
        engine = self.engine
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
            "is_ready": self.is_ready,
            "pid": os.getpid(),
        }


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


def _crash_process() -> None:
    logger.error("simulated crash: exiting")
    os._exit(70)


# -- HTTP ---------------------------------------------------------------------------------


class HttpError(Exception):
    """An error answered in vLLM's shape: {"error": {message, type, param, code}}."""

    TYPES = {
        400: "BadRequestError",
        404: "NotFoundError",
        401: "Unauthorized",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return _json_bytes(
            {
                "error": {
                    "message": self.message,
                    "type": self.TYPES.get(self.status, "BadRequestError"),
                    "param": self.param,
                    "code": self.status,
                }
            }
        )


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
    ]
    headers.extend(extra_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HttpError(400, "request body too large")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _stable_seed(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class SimApp:
    """The raw ASGI application of one simulated replica."""

    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica
        self.options = replica.options
        self.names = set(replica.options.served_model_names)
        self.model_name = replica.options.served_model_names[0]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self.replica.ensure_started()
        path = scope["path"]
        method = scope["method"]
        try:
            if path == "/v1/chat/completions" and method == "POST":
                await self._chat(scope, receive, send)
            elif path == "/health" and method == "GET":
                status = 200 if self.replica.is_ready else 503
                await _respond(send, status, b"")
            elif path == "/metrics" and method == "GET":
                await _respond(
                    send,
                    200,
                    self.replica.metrics.render(),
                    b"text/plain; version=0.0.4; charset=utf-8",
                )
            elif path == "/v1/models" and method == "GET":
                await _respond(send, 200, _json_bytes(self._models()))
            elif path == "/version" and method == "GET":
                await _respond(send, 200, _json_bytes({"version": VLLM_VERSION}))
            elif path == "/tokenize" and method == "POST":
                await self._tokenize(receive, send)
            elif path in ("/sim/faults", "/sim/state"):
                await self._admin(scope, receive, send)
            else:
                raise HttpError(404, "Not Found")
        except HttpError as exc:
            await _respond(send, exc.status, exc.body())
        except ConnectionResetError:
            return

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.replica.ensure_started()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.replica.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _models(self) -> dict[str, Any]:
        created = int(self.replica.started_at)
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": self.options.model,
                    "parent": None,
                    "max_model_len": self.options.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{_stable_seed(name, created):016x}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
                for name in self.options.served_model_names
            ],
        }

    async def _json_body(self, receive: Receive) -> dict[str, Any]:
        raw = await _read_body(receive)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"Invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "The request body must be a JSON object")
        return body

    async def _tokenize(self, receive: Receive, send: Send) -> None:
        body = await self._json_body(receive)
        if "messages" in body:
            text = tokens.render_chat(self._messages(body))
        else:
            text = str(body.get("prompt", ""))
        ids = tokens.encode(text)
        await _respond(
            send,
            200,
            _json_bytes(
                {
                    "count": len(ids),
                    "max_model_len": self.options.max_model_len,
                    "tokens": ids,
                    "token_strs": None,
                }
            ),
        )

    async def _admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = self.options.admin_token
        if token:
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization", b"").decode() != f"Bearer {token}":
                raise HttpError(401, "sim admin endpoints need the admin token")
        if scope["path"] == "/sim/state":
            await _respond(send, 200, _json_bytes(self.replica.state()))
            return
        if scope["method"] == "POST":
            body = await self._json_body(receive)
            try:
                self.replica.set_faults(**body)
            except (TypeError, ValueError) as exc:
                raise HttpError(400, str(exc)) from None
        await _respond(send, 200, _json_bytes(asdict(self.replica.faults)))

    def _messages(self, body: Mapping[str, Any]) -> list[dict[str, str]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", "messages")
        rendered = []
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message:
                raise HttpError(
                    400, "each message needs a role and content", "messages"
                )
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                raise HttpError(
                    400,
                    "message content must be a string or a list of parts",
                    "messages",
                )
            rendered.append(
                {"role": str(message["role"]), "content": tokens.message_text(content)}
            )
        return rendered

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        replica = self.replica
        arrived_at = time.monotonic()
        body = await self._json_body(receive)
        model = body.get("model")
        if model not in self.names:
            raise HttpError(
                404,
                f"The model `{model}` does not exist. "
                f"Valid aliases: {', '.join(sorted(self.names))}.",
                "model",
            )
        if body.get("n", 1) != 1:
            raise HttpError(400, "n must be 1 on this server", "n")
        messages = self._messages(body)
        prompt_ids = tokens.encode(tokens.render_chat(messages))
        prompt_len = len(prompt_ids)
        max_len = self.options.max_model_len
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = max_len - prompt_len
        if (
            not isinstance(max_tokens, int)
            or isinstance(max_tokens, bool)
            or max_tokens < 1
        ):
            raise HttpError(400, "max_tokens must be a positive integer", "max_tokens")
        if max_tokens > max_len:
            raise HttpError(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={max_len}. "
                "Please request fewer output tokens.",
                "max_tokens",
            )
        if prompt_len + max_tokens > max_len:
            raise HttpError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                "messages",
            )
        if not replica.is_ready:
            raise HttpError(503, "The server is starting up")
        limit = self.options.max_num_queued_reqs
        if limit and replica.queued_requests >= limit:
            replica.metrics.record_admission_rejection("max_num_queued_reqs")
            raise HttpError(503, "The server is overloaded: too many queued requests")
        if replica.roll_failure():
            raise HttpError(500, "simulated engine failure before the first token")
        stream_options = body.get("stream_options") or {}
        include_usage = bool(
            self.options.enable_force_include_usage
            or (
                isinstance(stream_options, Mapping)
                and stream_options.get("include_usage")
            )
        )
        request_seed = body.get("seed")
        text_seed = _stable_seed(request_seed, prompt_ids[-16:], prompt_len)
        output_len, finish_reason = replica.choose_output_len(
            max_tokens=max_tokens,
            ignore_eos=bool(body.get("ignore_eos")),
            seed=_stable_seed(request_seed, prompt_ids[-32:], prompt_len, max_tokens),
        )
        if replica.frontend_ms > 0:
            # Tokenization and request set-up, counted in TTFT as vLLM counts it.
            await asyncio.sleep(replica.frontend_ms / 1000.0)
        request_id = f"chatcmpl-{secrets.token_hex(8)}"
        stream = replica.submit(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            output_len=output_len,
            finish_reason=finish_reason,
            max_tokens=max_tokens,
            arrived_at=arrived_at,
            text_seed=text_seed,
        )
        headers: list[tuple[bytes, bytes]] = []
        if self.options.enable_request_id_headers:
            headers.append((b"x-request-id", request_id.encode()))
        try:
            if body.get("stream"):
                await self._stream(
                    stream, send, receive, model, headers, include_usage=include_usage
                )
            else:
                await self._complete(stream, send, receive, model, headers)
        finally:
            if stream.done is None:
                replica.abort(request_id)

    def _usage(self, stream: _Stream) -> dict[str, Any]:
        """Return vLLM's usage object (the streamed form; ``_complete`` adds the
        null fields a plain answer carries)."""
        done = stream.done
        assert done is not None
        usage: dict[str, Any] = {
            "prompt_tokens": done.prompt_tokens,
            "total_tokens": done.prompt_tokens + done.output_tokens,
            "completion_tokens": done.output_tokens,
        }
        if self.options.enable_prompt_tokens_details:
            # vLLM: the prompt's full blocks, once cached, minus those it hit
            # (PrefillStats.finalize); nothing is written with caching off.
            created = 0
            if self.replica.config.enable_prefix_caching:
                block_size = self.replica.config.block_size
                full = done.prompt_tokens // block_size * block_size
                created = max(0, full - done.cached_tokens)
            usage["prompt_tokens_details"] = {
                "cached_tokens": done.cached_tokens,
                "created_cache_tokens": created,
            }
        return usage

    async def _wait(self, stream: _Stream, disconnected: asyncio.Task[Any]) -> bool:
        """Wait for the next tokens; return False if the client went away first."""
        waiter = asyncio.ensure_future(stream.wake.wait())
        await asyncio.wait({waiter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            waiter.cancel()
            return False
        stream.wake.clear()
        return True

    async def _stream(
        self,
        stream: _Stream,
        send: Send,
        receive: Receive,
        model: str,
        headers: list[tuple[bytes, bytes]],
        *,
        include_usage: bool,
    ) -> None:
        created = int(time.time())
        head = (
            f'data: {{"id":"{stream.request_id}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{json.dumps(model)},"choices":[{{"index":0,'
            '"delta":{"content":'
        )
        tail = '},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        # Without a usage chunk vLLM puts the fingerprint on the chunk that finishes.
        finish_end = (
            "}\n\n"
            if include_usage
            else f',"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n'
        )
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        *headers,
                    ],
                }
            )
            sent = 0
            while True:
                if not await self._wait(stream, disconnected):
                    return
                produced = stream.produced
                done = stream.done
                if produced > sent:
                    pieces = stream.pieces[sent:produced]
                    parts = []
                    if sent == 0:
                        first = {
                            "id": stream.request_id,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                            "prompt_token_ids": None,
                            "prompt_text": None,
                        }
                        parts.append(b"data: " + _json_bytes(first) + b"\n\n")
                    last_index = produced - 1
                    for offset, piece in enumerate(pieces):
                        index = sent + offset
                        if done is not None and index == last_index:
                            reason = done.finish_reason
                            parts.append(
                                (
                                    head
                                    + json.dumps(piece, ensure_ascii=False)
                                    + f'}},"logprobs":null,"finish_reason":"{reason}",'
                                    '"stop_reason":null,"token_ids":null}]' + finish_end
                                ).encode()
                            )
                        else:
                            parts.append(
                                (
                                    head + json.dumps(piece, ensure_ascii=False) + tail
                                ).encode()
                            )
                    sent = produced
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"".join(parts),
                            "more_body": True,
                        }
                    )
                if done is not None:
                    break
            final = b""
            if include_usage:
                usage_chunk = {
                    "id": stream.request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(stream),
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                }
                final = b"data: " + _json_bytes(usage_chunk) + b"\n\n"
            await send(
                {
                    "type": "http.response.body",
                    "body": final + b"data: [DONE]\n\n",
                    "more_body": False,
                }
            )
        finally:
            disconnected.cancel()

    async def _complete(
        self,
        stream: _Stream,
        send: Send,
        receive: Receive,
        model: str,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        try:
            while stream.done is None:
                if not await self._wait(stream, disconnected):
                    return
        finally:
            disconnected.cancel()
        done = stream.done
        text = "".join(stream.pieces[: done.output_tokens])
        usage = self._usage(stream)
        details = usage.get("prompt_tokens_details")
        if details is not None:
            details["multimodal_tokens"] = None
        usage["prompt_tokens_details"] = details
        usage["completion_tokens_details"] = None
        # vLLM 0.32's body, null fields included (engine_nodes/tests/data).
        body = {
            "id": stream.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": done.finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        await _respond(send, 200, _json_bytes(body), extra_headers=headers)


def build_app(
    options: SimOptions,
    *,
    faults: Faults | None = None,
    on_crash: Callable[[], None] | None = None,
) -> SimApp:
    """Return the ASGI app of a replica started with ``options``."""
    return SimApp(SimReplica(options, faults=faults, on_crash=on_crash))

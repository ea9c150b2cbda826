"""The vLLM V1 engine step loop of one simulated replica, pure and clock-free.

Public surface: ``EngineConfig``, ``SimRequest``, ``TokenEvent``, ``FinishedRequest``,
``StepOutput``, ``Engine``.

The caller owns time: ``begin_step(now)`` schedules a step and returns how long it
takes; the caller waits (really, or in virtual time) and calls ``end_step(now)`` at
its end. Scheduling follows vLLM V1 (research spec §2.6, §6.3):

1. Token budget = ``max_num_batched_tokens``.
2. Running requests first, in order. Each needs ``num_tokens - num_computed`` tokens
   (1 while decoding; the rest of its prompt, or of prompt + generated tokens after a
   preemption, while prefilling), capped by the budget: chunked prefill. If the KV
   blocks for them are not free, the **last** running request is preempted
   (recompute): its blocks are freed (they stay in the prefix cache until evicted),
   it goes to the **front** of the waiting queue and keeps its generated tokens; if
   the request itself was last, the running pass stops.
3. Unless something was preempted, waiting requests are admitted FCFS while budget
   remains, fewer than ``max_num_seqs`` run, and blocks allow. Each does a prefix
   lookup; on its first admission ``prefix_cache_queries += prompt_len`` and
   ``prefix_cache_hits += hit tokens`` (resumed requests look up again, uncounted).
4. The step lasts ``perf.step_time_from_totals_ms`` times a lognormal jitter.
5. At ``end_step`` every scheduled request advances; newly full blocks (prompt blocks
   during prefill, output blocks during decode) are hashed and cached; a request
   whose computed tokens caught up with its known tokens (its prefill completed this
   step, or it is decoding) samples one token. Reaching ``output_len`` finishes it:
   its blocks are freed, last block first, to the LRU tail.

The CPU offload tier (``EngineConfig.kv_offloading_size`` GiB, vLLM's
``--kv-offloading-size`` with its native ``OffloadingConnector``, CPU manager and LRU
policy; off by default) is a ``prefix_cache.HostBlockCache`` of
``host_blocks(size, block_size, kv_bytes_per_token * gpus)`` blocks (vLLM splits the
size over the tensor-parallel ranks, each holding its share of every block):

- at ``end_step`` every newly full block of a scheduled request (prompt and answer)
  is stored to the host tier under its chained hash, whether or not prefix caching
  is on (vLLM hashes blocks for a KV connector either way);
- at admission, after the GPU hit, the blocks that follow it are looked up in the
  host tier (a gap ends the run; capped as the GPU hit is, so the last token is
  recomputed); those tokens count as computed, the blocks are touched, and their
  load, ``host_tokens * host_load_us_per_token / 1000`` ms, is added to the device
  time of that step. That is pessimistic: vLLM loads asynchronously, the request
  waiting (``WAITING_FOR_REMOTE_KVS``) while other requests' steps run;
- the loaded blocks are registered in the GPU prefix cache when the step ends, as
  the ones the request computes.

Counters as vLLM 0.32's scheduler records them (``PrefixCacheStats`` of the
connector, for a request's first admission only; a preempted request's lookups go
to the preempted fields vLLM does not export): ``host_cache_queries += num_tokens
- gpu_hit_tokens`` (``vllm:external_prefix_cache_queries``) and ``host_cache_hits
+= host_tokens`` (``vllm:external_prefix_cache_hits``). ``cached_tokens`` (usage's
``prompt_tokens_details.cached_tokens``, vLLM's ``num_cached_tokens``) is the GPU
hit plus the host hit.

Deviation from vLLM, deliberate: blocks are cached when the step **ends** (vLLM caches
them when it schedules), so two identical prompts admitted in the same step both miss.

SGLang's cache (``EngineConfig.cache = "radix"``; the scheduling and the step-time
model stay the ones above, only the KV side changes): the KV pool is
``max_total_num_tokens = (num_gpu_blocks - 1) * block_size`` one-token slots (the
same memory as the block pool) and the prefix cache is a
``radix_cache.RadixCache`` (page size 1), as SGLang's ``RadixCache``:

- at admission the request matches its tokens but the last
  (``len - 1``: SGLang recomputes the last token so it has logits to sample
  from), reuses the match to the token and locks its node while it runs;
- every token it computes takes one slot; when free slots run short the tree
  evicts unlocked leaves, least recently used first, and only then is a running
  request preempted (its slots freed, its lock dropped, nothing inserted);
- when its prefill completes its prompt is inserted and the lock moves to the
  prompt's node; when it finishes everything it computed (prompt and output) is
  inserted and the lock dropped. Tokens another request inserted first are
  duplicates and go back to the free slots;
- ``kv_cache_usage_perc`` is SGLang's ``token_usage``: ``(max_total - free -
  evictable) / max_total``, so cached idle tokens count as free;
- with ``enable_prefix_caching`` off (SGLang's ``--disable-radix-cache``) there is
  no tree: no hits, and a request's slots are freed when it ends.

The host tier is vLLM's and needs the block cache.

KV events (``EngineConfig.enable_kv_events``): the block pool records
``BlockStored`` (blocks registered when a step ends, with their token ids, prompt
and output), ``BlockRemoved`` (evictions on allocation) and ``AllBlocksCleared``
(``reset_prefix_cache``); the radix cache records the same over blocks of
``block_size`` tokens of its tree (SGLang publishes pages); ``end_step`` drains
them into ``StepOutput.kv_events``, one batch per step as vLLM's scheduler does.

Generated token ids are ``tokens.output_token_id(tokens.request_seed(request_id), i)``,
so output blocks hash to what the streamed text re-encodes to when a client sends the
reply back in its next turn.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TypedDict, Unpack

from simengine.domain.kv_events import KVEvent
from simengine.domain.perf import PerfProfile, jitter_factor
from simengine.domain.prefix_cache import (
    NONE_HASH,
    BlockPool,
    HostBlockCache,
    hash_block_tokens,
    host_blocks,
)
from simengine.domain.radix_cache import RadixCache, RadixNode
from simengine.domain.tokens import output_token_ids, request_seed

__all__ = [
    "CACHE_KINDS",
    "Engine",
    "EngineConfig",
    "EngineOverrides",
    "FinishedRequest",
    "SimRequest",
    "StepOutput",
    "TokenEvent",
]

_FINISH_REASONS = frozenset({"length", "stop"})
CACHE_KINDS = ("block", "radix")
_WAITING, _RUNNING, _DONE = 0, 1, 2


class EngineOverrides(TypedDict, total=False):
    """The ``EngineConfig`` fields that ``EngineConfig.from_profile`` may replace."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    enable_prefix_caching: bool
    kv_offloading_size: float | None
    cache: str
    enable_kv_events: bool


@dataclass(slots=True)
class EngineConfig:
    """The scheduler and KV limits of one replica (vLLM's names).

    ``cache``: ``"block"`` (vLLM's block pool and hashed prefix cache) or
    ``"radix"`` (SGLang's token pool and radix tree, page size 1, over the same
    ``(num_gpu_blocks - 1) * block_size`` tokens of KV memory).

    ``enable_kv_events``: record KV-cache events (vLLM's and SGLang's
    ``--kv-events-config``).

    ``kv_offloading_size``: GiB of host memory for the CPU offload tier (vLLM's
    ``--kv-offloading-size``, the total over tensor-parallel ranks); None: no tier.

    Invariants: every size is positive; ``num_gpu_blocks >= 2`` (one is the null
    block); ``kv_offloading_size`` is None or a finite number above 0 (vLLM refuses
    0: its CPU offload spec needs ``cpu_bytes_to_use``).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    kv_offloading_size: float | None = None
    cache: str = "block"
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        sizes = (
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.block_size,
            self.max_model_len,
        )
        if min(sizes) < 1:
            raise ValueError("engine sizes must be positive")
        if self.num_gpu_blocks < 2:
            raise ValueError(
                "num_gpu_blocks must be at least 2 (one is the null block)"
            )
        size = self.kv_offloading_size
        if size is not None and (
            isinstance(size, bool)
            or not isinstance(size, int | float)
            or not math.isfinite(size)
            or size <= 0
        ):
            raise ValueError(
                f"kv_offloading_size must be a number of GiB above 0, not {size!r}"
            )
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {CACHE_KINDS}, not {self.cache!r}")
        if self.cache == "radix" and size is not None:
            raise ValueError(
                "kv_offloading_size is vLLM's host tier; it needs cache='block'"
            )

    @property
    def max_total_num_tokens(self) -> int:
        """KV slots of the token pool (SGLang's ``max_total_num_tokens``): the
        block pool's memory without its null block."""
        return (self.num_gpu_blocks - 1) * self.block_size

    @classmethod
    def from_profile(
        cls, profile: PerfProfile, **overrides: Unpack[EngineOverrides]
    ) -> EngineConfig:
        """Return the profile's limits, with any field replaced by ``overrides``.

        Raises:
            TypeError: an override names no field.
        """
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown EngineConfig fields: {sorted(unknown)}")
        limits = cls(
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            num_gpu_blocks=profile.num_gpu_blocks,
            block_size=profile.block_size,
        )
        return replace(limits, **overrides)


@dataclass(slots=True)
class SimRequest:
    """One request as the engine sees it: prompt token ids and how long it runs."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_len: int  # tokens generated before finishing (<= max_tokens)
    finish_reason: str = "length"  # reported when output_len is reached
    # Seed of the generated tokens (tokens.output_token_ids); None derives it from
    # the request id. The server passes the seed of the text it streams, so a reply
    # sent back in the next turn hits the blocks its generation filled.
    output_seed: int | None = None


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """One output token, produced at the end of a step."""

    request_id: str
    index: int  # 0-based index of this output token
    is_final: bool


@dataclass(slots=True, frozen=True)
class FinishedRequest:
    """A request that finished or was aborted, with its timeline (caller's clock)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prefix-cache hit at first scheduling (GPU + host tier)
    output_tokens: int
    finish_reason: str  # "length" | "stop" | "abort"
    arrived_at: float
    scheduled_at: float | None
    first_token_at: float | None
    finished_at: float
    num_preemptions: int


@dataclass(slots=True)
class StepOutput:
    """What one step produced."""

    started_at: float
    finished_at: float
    tokens: list[TokenEvent]
    finished: list[FinishedRequest]
    num_tokens: int  # iteration tokens (decode + prefill) in this step
    num_preemptions: int
    # KV-cache events since the last step (EngineConfig.enable_kv_events).
    kv_events: list[KVEvent] = field(default_factory=list)


class _Request:
    """The engine's mutable state of one unfinished request."""

    __slots__ = (
        "arrived_at",
        "block_hashes",
        "block_ids",
        "cached_tokens",
        "finish_reason",
        "first_token_at",
        "host_cached_tokens",
        "num_cached_blocks",
        "num_computed",
        "num_generated",
        "num_offloaded_blocks",
        "num_preemptions",
        "output_len",
        "private_tokens",
        "prompt",
        "prompt_len",
        "radix_locked",
        "radix_node",
        "request_id",
        "scheduled_at",
        "seed",
        "state",
    )

    def __init__(self, request: SimRequest, now: float) -> None:
        self.request_id = request.request_id
        self.prompt = list(request.prompt_token_ids)
        self.prompt_len = len(self.prompt)
        self.output_len = request.output_len
        self.finish_reason = request.finish_reason
        self.seed = (
            request_seed(request.request_id)
            if request.output_seed is None
            else request.output_seed
        )
        self.num_generated = 0  # tokens sampled so far
        self.num_computed = 0  # tokens whose KV is in (or scheduled into) blocks
        self.block_ids: list[int] = []
        self.block_hashes: list[
            int
        ] = []  # chained hashes of full blocks, computed lazily
        self.num_cached_blocks = 0  # leading blocks already registered in the pool
        self.num_offloaded_blocks = 0  # leading blocks already stored to the host tier
        self.cached_tokens = 0
        self.host_cached_tokens = 0  # the part of cached_tokens the host tier gave
        self.arrived_at = now
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.num_preemptions = 0
        self.state = _WAITING
        # Radix cache only: the locked node, its depth (tokens) and the slots the
        # request holds outside the tree.
        self.radix_node: RadixNode | None = None
        self.radix_locked = 0
        self.private_tokens = 0


class Engine:
    """One replica's scheduler, KV block pool and step-time model.

    Read-only state (for metrics and heartbeats): ``num_running``, ``num_waiting``,
    ``kv_cache_usage_perc`` and the cumulative counters ``prefix_cache_queries`` and
    ``prefix_cache_hits`` (tokens), ``prompt_tokens_computed`` (prefill tokens actually
    computed: prefix hits excluded, recomputation after preemption included),
    ``prompt_tokens_total`` and ``prompt_tokens_cached`` (the prompts and their prefix
    hits, counted once per request when its prefill completes, as vLLM's
    ``vllm:prompt_tokens_total`` and ``vllm:prompt_tokens_cached_total`` are),
    ``generation_tokens`` and ``num_preemptions``; with the host tier
    ``host_cache_queries`` and ``host_cache_hits`` (tokens, counted as vLLM's
    ``external_prefix_cache_*``) and ``prompt_tokens_cached_host`` (the host part of
    ``prompt_tokens_cached``), all 0 without it. With the radix cache,
    ``num_used_tokens`` and ``max_total_num_tokens`` (SGLang's figures) and the
    tree itself (``radix_cache``).

    Invariants: at most one step is in flight; a request is in exactly one of waiting,
    running or gone; only running requests hold blocks; unfinished requests are
    tracked by id, finished ones are forgotten (memory is bounded by the live load).
    """

    __slots__ = (
        "_host",
        "_jitter_cv",
        "_pool",
        "_private_tokens",
        "_radix",
        "_radix_mode",
        "_requests",
        "_rng",
        "_running",
        "_step",
        "_step_num_tokens",
        "_step_preemptions",
        "_step_prefill_tokens",
        "_step_started_at",
        "_tokens_in_flight",
        "_waiting",
        "config",
        "generation_tokens",
        "host_cache_hits",
        "host_cache_queries",
        "num_preemptions",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "profile",
        "prompt_tokens_cached",
        "prompt_tokens_cached_host",
        "prompt_tokens_computed",
        "prompt_tokens_total",
    )

    def __init__(
        self,
        profile: PerfProfile,
        config: EngineConfig | None = None,
        *,
        seed: int = 0,
        jitter_cv: float = 0.04,
    ) -> None:
        self.profile = profile
        self.config = (
            config if config is not None else EngineConfig.from_profile(profile)
        )
        self._pool = BlockPool(
            self.config.num_gpu_blocks,
            self.config.block_size,
            enable_caching=self.config.enable_prefix_caching,
            enable_kv_events=self.config.enable_kv_events,
        )
        self._host: HostBlockCache | None = None
        offload_gib = self.config.kv_offloading_size
        if offload_gib is not None:
            block_bytes = profile.kv_bytes_per_token * profile.gpus
            num_host = host_blocks(offload_gib, self.config.block_size, block_bytes)
            if num_host < 1:
                raise ValueError(
                    f"kv_offloading_size {offload_gib} GiB holds no KV block of "
                    f"{self.config.block_size * block_bytes} bytes"
                )
            self._host = HostBlockCache(num_host)
        self._radix_mode = self.config.cache == "radix"
        self._radix: RadixCache | None = (
            RadixCache(
                kv_block_size=(
                    self.config.block_size if self.config.enable_kv_events else None
                )
            )
            if self._radix_mode and self.config.enable_prefix_caching
            else None
        )
        self._private_tokens = 0  # radix: slots held by requests, not in the tree
        self._rng = random.Random(seed)
        self._jitter_cv = jitter_cv
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._step: list[tuple[_Request, int]] | None = None
        self._step_started_at = 0.0
        self._step_num_tokens = 0
        self._step_prefill_tokens = 0
        self._step_preemptions = 0
        self._tokens_in_flight = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_computed = 0
        self.prompt_tokens_total = 0
        self.prompt_tokens_cached = 0
        self.prompt_tokens_cached_host = 0
        self.host_cache_queries = 0
        self.host_cache_hits = 0
        self.generation_tokens = 0
        self.num_preemptions = 0

    # -- read-only state ---------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests in the running batch, including ones mid-prefill."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, including preempted ones."""
        return len(self._waiting)

    @property
    def kv_cache_usage_perc(self) -> float:
        """``1 - free / (num_gpu_blocks - 1)``; cached idle blocks count as free.

        Radix cache: SGLang's ``token_usage``, ``num_used_tokens /
        max_total_num_tokens``; cached idle tokens count as free."""
        if self._radix_mode:
            return self.num_used_tokens / self.config.max_total_num_tokens
        return self._pool.usage

    @property
    def max_total_num_tokens(self) -> int:
        """The KV pool in tokens (SGLang's ``max_total_num_tokens``)."""
        return self.config.max_total_num_tokens

    @property
    def num_used_tokens(self) -> int:
        """KV tokens in use: SGLang's ``max_total - available - evictable`` (the
        slots running requests hold, in the tree or not); block cache: the used
        blocks' tokens."""
        if self._radix_mode:
            protected = self._radix.protected_size if self._radix is not None else 0
            return self._private_tokens + protected
        pool = self._pool
        return (pool.num_blocks - 1 - pool.num_free_blocks) * self.config.block_size

    @property
    def radix_cache(self) -> RadixCache | None:
        """The radix tree (read it), or None with the block cache or caching off."""
        return self._radix

    @property
    def block_pool(self) -> BlockPool:
        """The KV block pool (read it; do not allocate from it)."""
        return self._pool

    @property
    def host_cache(self) -> HostBlockCache | None:
        """The CPU offload tier (read it), or None without ``kv_offloading_size``."""
        return self._host

    def has_work(self) -> bool:
        """Return True while any request is waiting or running."""
        return bool(self._running or self._waiting)

    def tokens_in_flight(self) -> int:
        """Return Σ over unfinished requests of ``prompt_len + output_len - generated``.

        A load measure in tokens: prompt tokens count in full even when cached or
        already computed, so it only falls as tokens are generated and requests end.
        """
        return self._tokens_in_flight

    def cached_tokens(self, request_id: str) -> int | None:
        """Return the prefix hit (tokens) of an unfinished request once it was
        scheduled; None before that or for unknown/finished ids."""
        req = self._requests.get(request_id)
        if req is None or req.scheduled_at is None:
            return None
        return req.cached_tokens

    # -- requests ----------------------------------------------------------------------

    def add_request(self, request: SimRequest, now: float) -> None:
        """Queue a request at the back of the waiting queue.

        Raises:
            ValueError: duplicate id among unfinished requests, empty prompt,
                ``output_len < 1``, unknown finish reason, ``prompt + output_len >
                max_model_len``, or a request whose KV could never fit in the pool.
        """
        config = self.config
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len < 1:
            raise ValueError("the prompt must have at least one token")
        if request.output_len < 1:
            raise ValueError("output_len must be at least 1")
        if request.finish_reason not in _FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {sorted(_FINISH_REASONS)}")
        total = prompt_len + request.output_len
        if total > config.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len}) + output ({request.output_len}) tokens exceed "
                f"max_model_len {config.max_model_len}"
            )
        # The last sampled token is never computed, so KV holds at most total - 1.
        blocks = -(-(total - 1) // config.block_size)
        if blocks > config.num_gpu_blocks - 1:
            raise ValueError(
                f"request needs {blocks} KV blocks; the pool has "
                f"{config.num_gpu_blocks - 1}"
            )
        req = _Request(request, now)
        self._requests[req.request_id] = req
        self._waiting.append(req)
        self._tokens_in_flight += total

    def abort(self, request_id: str, now: float) -> FinishedRequest | None:
        """Drop an unfinished request and free its blocks at once.

        Works while it waits, runs, or is part of the step in flight (its tokens
        from that step are then never emitted). Returns None for unknown ids.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        if req.state == _RUNNING:
            self._running.remove(req)
            if self._radix_mode:
                self._radix_release(req, insert=False)
            else:
                self._pool.free(req.block_ids)
                req.block_ids = []
        else:
            self._waiting.remove(req)
        req.state = _DONE
        self._tokens_in_flight -= req.prompt_len + req.output_len - req.num_generated
        return self._finished(req, "abort", now)

    # -- the step loop -----------------------------------------------------------------

    def begin_step(self, now: float) -> float | None:
        """Schedule the next step at ``now``; return its duration in seconds, or None
        when there is nothing to run.

        Raises:
            RuntimeError: a step is already in flight.
        """
        if self._step is not None:
            raise RuntimeError("a step is already in flight; call end_step first")
        config = self.config
        pool = self._pool
        block_size = config.block_size
        running = self._running
        budget = config.max_num_batched_tokens
        scheduled: list[tuple[_Request, int]] = []
        decode_seqs = kv_tokens = prefill_tokens = prefill_seqs = 0
        prefill_work = 0.0
        preempted = 0
        host_load_tokens = 0
        radix = self._radix_mode

        index = 0
        while index < len(running) and budget > 0:
            req = running[index]
            num_computed = req.num_computed
            left = req.prompt_len + req.num_generated - num_computed
            n = left if left < budget else budget
            if radix:
                need = num_computed + n - req.radix_locked - req.private_tokens
                if need > 0:
                    while not self._radix_reserve(need):
                        victim = running.pop()
                        self._preempt(victim)
                        preempted += 1
                        if victim is req:
                            break
                    if req.state != _RUNNING:
                        break
                    req.private_tokens += need
                    self._private_tokens += need
                need_blocks = 0
            else:
                need_blocks = (num_computed + n + block_size - 1) // block_size - len(
                    req.block_ids
                )
            if need_blocks > 0:
                while pool.num_free_blocks < need_blocks:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted += 1
                    if victim is req:
                        break
                if req.state != _RUNNING:
                    break
                req.block_ids.extend(pool.allocate(need_blocks))
            scheduled.append((req, n))
            budget -= n
            if left == 1 and req.num_generated:
                decode_seqs += 1
                kv_tokens += num_computed + 1
            else:
                prefill_tokens += n
                prefill_seqs += 1
                prefill_work += n * (num_computed + n / 2)
            index += 1

        # vLLM admits no waiting request in a step that had to preempt; the `or`
        # guards the (unreachable by construction) case where that would idle the
        # engine with work queued.
        if preempted == 0 or not scheduled:
            waiting = self._waiting
            max_num_seqs = config.max_num_seqs
            caching = config.enable_prefix_caching
            host = self._host
            while waiting and budget > 0 and len(running) < max_num_seqs:
                req = waiting[0]
                num_tokens = req.prompt_len + req.num_generated
                host_tokens = 0  # of the hit, loaded from the host tier
                if radix:
                    admitted = self._admit_radix(req, num_tokens, budget)
                    if admitted is None:
                        break
                    hit_tokens, n = admitted
                else:
                    hit_ids: list[int] = []
                    max_blocks = (num_tokens - 1) // block_size
                    if caching or host is not None:
                        self._ensure_hashes(req, max_blocks)
                    if caching:
                        hit_ids = pool.cached_block_ids(req.block_hashes, max_blocks)
                    num_gpu_hit = len(hit_ids)
                    num_host_hit = 0
                    if host is not None:
                        num_host_hit = host.lookup(
                            req.block_hashes, num_gpu_hit, max_blocks
                        )
                    hit_tokens = (num_gpu_hit + num_host_hit) * block_size
                    n = min(num_tokens - hit_tokens, budget)
                    need_blocks = (hit_tokens + n + block_size - 1) // block_size - len(
                        hit_ids
                    )
                    if need_blocks + pool.num_evictable(hit_ids) > pool.num_free_blocks:
                        break
                    pool.touch(hit_ids)
                    hit_ids.extend(pool.allocate(need_blocks))
                    req.block_ids = hit_ids
                    # Loaded blocks are registered in the pool once the step ends.
                    req.num_cached_blocks = num_gpu_hit
                    host_tokens = num_host_hit * block_size
                    if host is not None and num_host_hit:
                        host.touch(
                            req.block_hashes[num_gpu_hit : num_gpu_hit + num_host_hit]
                        )
                        host_load_tokens += host_tokens
                left = num_tokens - hit_tokens
                req.num_computed = hit_tokens
                req.state = _RUNNING
                waiting.popleft()
                running.append(req)
                if req.scheduled_at is None:
                    req.scheduled_at = now
                    req.cached_tokens = hit_tokens
                    req.host_cached_tokens = host_tokens
                    gpu_tokens = hit_tokens - host_tokens
                    if caching:
                        self.prefix_cache_queries += num_tokens
                        self.prefix_cache_hits += gpu_tokens
                    if host is not None:
                        self.host_cache_queries += num_tokens - gpu_tokens
                        self.host_cache_hits += host_tokens
                scheduled.append((req, n))
                budget -= n
                if left == 1 and req.num_generated:
                    decode_seqs += 1
                    kv_tokens += num_tokens
                else:
                    prefill_tokens += n
                    prefill_seqs += 1
                    prefill_work += n * (hit_tokens + n / 2)

        if not scheduled:
            return None
        self._step = scheduled
        self._step_started_at = now
        self._step_num_tokens = decode_seqs + prefill_tokens
        self._step_prefill_tokens = prefill_tokens
        self._step_preemptions = preempted
        profile = self.profile
        linear_ms = profile.ctok_ms * (decode_seqs + prefill_tokens)
        step_ms = (
            profile.a_ms
            + (linear_ms if linear_ms > profile.w_ms else profile.w_ms)
            + profile.b_ms * decode_seqs
            + profile.p_ms * prefill_seqs
            + profile.kkv_us * 1e-3 * kv_tokens
            + profile.katt * prefill_work
            # Host-tier loads as device time in the admitting step (pessimistic:
            # vLLM overlaps them with other requests' steps).
            + profile.host_load_us_per_token * 1e-3 * host_load_tokens
        )
        host_ms = profile.h_ms * (decode_seqs + prefill_seqs)
        if host_ms > step_ms:
            step_ms = host_ms
        return step_ms * jitter_factor(self._rng, self._jitter_cv) / 1000.0

    def end_step(self, now: float) -> StepOutput:
        """Apply the step begun last; ``now`` is its end time.

        Raises:
            RuntimeError: no step is in flight.
        """
        step = self._step
        if step is None:
            raise RuntimeError("no step in flight; call begin_step first")
        self._step = None
        pool = self._pool
        block_size = self.config.block_size
        caching = self.config.enable_prefix_caching
        host = self._host
        radix = self._radix_mode
        radix_tree = self._radix
        events = self.config.enable_kv_events
        tokens: list[TokenEvent] = []
        finished: list[FinishedRequest] = []
        for req, n in step:
            if req.state != _RUNNING:
                continue  # aborted while the step was in flight
            num_computed = req.num_computed + n
            req.num_computed = num_computed
            if radix:
                if (
                    radix_tree is not None
                    and req.num_generated == 0
                    and num_computed == req.prompt_len
                ):
                    self._radix_cache_prompt(req, radix_tree)
            elif caching:
                full = num_computed // block_size
                if full > req.num_cached_blocks:
                    self._ensure_hashes(req, full)
                    start = req.num_cached_blocks
                    pool.cache_blocks(
                        req.block_ids,
                        req.block_hashes,
                        start,
                        full,
                        self._block_tokens(req, start, full) if events else (),
                    )
                    req.num_cached_blocks = full
            if host is not None:
                full = num_computed // block_size
                if full > req.num_offloaded_blocks:
                    self._ensure_hashes(req, full)
                    host.store(req.block_hashes[req.num_offloaded_blocks : full])
                    req.num_offloaded_blocks = full
            generated = req.num_generated
            if num_computed != req.prompt_len + generated:
                continue  # a prefill chunk that did not finish the prompt
            req.num_generated = generated + 1
            if generated == 0:
                req.first_token_at = now
                self.prompt_tokens_total += req.prompt_len
                self.prompt_tokens_cached += req.cached_tokens
                self.prompt_tokens_cached_host += req.host_cached_tokens
            is_final = generated + 1 == req.output_len
            tokens.append(TokenEvent(req.request_id, generated, is_final))
            if is_final:
                req.state = _DONE
                if radix:
                    self._radix_release(req, insert=True)
                else:
                    pool.free(req.block_ids)
                    req.block_ids = []
                del self._requests[req.request_id]
                self._tokens_in_flight -= req.prompt_len
                finished.append(self._finished(req, req.finish_reason, now))
        self._tokens_in_flight -= len(tokens)
        self.generation_tokens += len(tokens)
        self.prompt_tokens_computed += self._step_prefill_tokens
        if finished:
            self._running = [r for r in self._running if r.state == _RUNNING]
        return StepOutput(
            started_at=self._step_started_at,
            finished_at=now,
            tokens=tokens,
            finished=finished,
            num_tokens=self._step_num_tokens,
            num_preemptions=self._step_preemptions,
            kv_events=self.take_kv_events(),
        )

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as vLLM's ``/reset_prefix_cache``; only when no
        request holds blocks (block cache) or no node is locked (radix). Returns
        whether it reset; the ``AllBlocksCleared`` event is ``take_kv_events``'s."""
        if self._radix_mode:
            return self._radix.reset() if self._radix is not None else False
        return self._pool.reset_prefix_cache()

    def take_kv_events(self) -> list[KVEvent]:
        """Return the KV events recorded since the last step or call (a reset's
        between steps) and forget them."""
        if self._radix is not None:
            return self._radix.take_events()
        return self._pool.take_events()

    # -- internals ---------------------------------------------------------------------

    def _block_tokens(self, req: _Request, start: int, stop: int) -> list[int]:
        """The token ids of ``req``'s blocks ``start..stop-1``: prompt, then
        output."""
        size = self.config.block_size
        first, end = start * size, stop * size
        tokens = req.prompt[first:end]
        if end > req.prompt_len:
            tokens.extend(
                output_token_ids(
                    req.seed,
                    max(first, req.prompt_len) - req.prompt_len,
                    end - req.prompt_len,
                )
            )
        return tokens

    def _preempt(self, req: _Request) -> None:
        """Recompute-preempt: free the blocks, keep the tokens, queue at the front."""
        if self._radix_mode:
            self._radix_release(req, insert=False)
        else:
            self._pool.free(req.block_ids)
            req.block_ids = []
        req.num_computed = 0
        req.num_cached_blocks = 0
        req.state = _WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(req)

    # -- the radix cache ------------------------------------------------------------------

    def _radix_free(self) -> int:
        """Free KV slots: the pool less the tree and the requests' own slots."""
        tree = self._radix.total_size if self._radix is not None else 0
        return self.config.max_total_num_tokens - tree - self._private_tokens

    def _radix_reserve(self, need: int) -> bool:
        """Make ``need`` slots free, evicting unlocked tree leaves (LRU) if short;
        return False if even that cannot."""
        free = self._radix_free()
        if free < need and self._radix is not None:
            self._radix.evict(need - free)
            free = self._radix_free()
        return free >= need

    def _radix_key(self, req: _Request, num_tokens: int) -> tuple[int, ...]:
        """The first ``num_tokens`` tokens of ``req``: its prompt, then its output."""
        prompt_len = req.prompt_len
        if num_tokens <= prompt_len:
            return tuple(req.prompt[:num_tokens])
        return (*req.prompt, *output_token_ids(req.seed, 0, num_tokens - prompt_len))

    def _admit_radix(
        self, req: _Request, num_tokens: int, budget: int
    ) -> tuple[int, int] | None:
        """Match and lock ``req``'s cached prefix and reserve its first chunk;
        return (hit tokens, tokens scheduled), or None if the slots are short."""
        tree = self._radix
        hit = 0
        node: RadixNode | None = None
        if tree is not None:
            # All but the last token: SGLang recomputes it to sample from.
            match = tree.match_prefix(self._radix_key(req, num_tokens - 1))
            hit, node = match.length, match.node
            tree.lock(node)  # before evicting, so the match survives
        left = num_tokens - hit
        n = left if left < budget else budget
        if not self._radix_reserve(n):
            if tree is not None and node is not None:
                tree.unlock(node)
            return None
        req.radix_node = node
        req.radix_locked = hit
        req.private_tokens = n
        self._private_tokens += n
        return hit, n

    def _radix_cache_prompt(self, req: _Request, tree: RadixCache) -> None:
        """Insert a prompt whose prefill completed; move the lock to its node."""
        prompt = tuple(req.prompt)
        tree.insert(prompt)
        match = tree.match_prefix(prompt)
        tree.lock(match.node)
        if req.radix_node is not None:
            tree.unlock(req.radix_node)
        req.radix_node = match.node
        req.radix_locked = match.length
        # The prompt's slots are the tree's now (or were duplicates, freed).
        self._private_tokens -= req.private_tokens
        req.private_tokens = 0

    def _radix_release(self, req: _Request, *, insert: bool) -> None:
        """Give back ``req``'s slots and lock; with ``insert`` (it finished) its
        computed tokens join the tree first."""
        tree = self._radix
        if tree is not None:
            if insert:
                tree.insert(self._radix_key(req, req.num_computed))
            if req.radix_node is not None:
                tree.unlock(req.radix_node)
        req.radix_node = None
        req.radix_locked = 0
        self._private_tokens -= req.private_tokens
        req.private_tokens = 0

    def _ensure_hashes(self, req: _Request, num_blocks: int) -> None:
        """Extend ``req.block_hashes`` to its first ``num_blocks`` full blocks."""
        hashes = req.block_hashes
        done = len(hashes)
        if done >= num_blocks:
            return
        block_size = self.config.block_size
        prompt = req.prompt
        prompt_len = req.prompt_len
        parent = hashes[-1] if hashes else NONE_HASH
        for k in range(done, num_blocks):
            start = k * block_size
            end = start + block_size
            if end <= prompt_len:
                block = prompt[start:end]
            else:
                block = prompt[start:prompt_len] if start < prompt_len else []
                block.extend(
                    output_token_ids(
                        req.seed, max(start, prompt_len) - prompt_len, end - prompt_len
                    )
                )
            parent = hash_block_tokens(parent, block)
            hashes.append(parent)

    @staticmethod
    def _finished(req: _Request, reason: str, now: float) -> FinishedRequest:
        return FinishedRequest(
            request_id=req.request_id,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens,
            output_tokens=req.num_generated,
            finish_reason=reason,
            arrived_at=req.arrived_at,
            scheduled_at=req.scheduled_at,
            first_token_at=req.first_token_at,
            finished_at=now,
            num_preemptions=req.num_preemptions,
        )

"""One replica of the fleet simulator: the engine's step-time model and prefix cache,
advanced many steps at a time.

Public surface: ``FleetRequest``, ``FleetReplica``, ``Segment``.

The simulated replica server runs ``simengine.domain.engine.Engine``, which
walks every request on every step: exact, and far too slow for twelve replicas
over an hour (a million steps of ~80 requests each). A fleet replica keeps the
same physics with a different bookkeeping:

- **Same step time.** Every step costs ``perf.step_time_from_totals_ms`` of the
  replica's ``PerfProfile`` (decode sequences, KV tokens read, prefill tokens and
  prefill attention work), times the same lognormal jitter, drawn once per
  segment instead of once per step.
- **Same prefix cache.** KV blocks live in ``simengine.domain.prefix_cache.
  BlockPool`` (vLLM's block pool: LRU free queue, hash map, ref counts), looked up
  and touched on admission, cached when full and computed, freed last block first.
  Block hashes are synthetic: block ``k`` of conversation ``c``'s token stream is
  ``(c + 1) << 24 | k``, so turns of one conversation share blocks exactly where
  their tokens are the same and nothing else does; a request behind shared prefix
  ``g`` of ``P`` tokens has ``prefix_block_hash(g, k)`` for its blocks below
  ``P // block_size`` (``request_block_hashes``: the block that straddles the
  prefix's end is the conversation's, as chained hashes would make it). A request
  from a recorded trace has ``block_keys``, its recorded chain of block hashes as
  keys (``drills.domain.workload.recorded_block_key``), for its leading blocks:
  equal hashes hit across conversations as in a real engine; blocks past them
  stay on the conversation's stream. Blocks that no later request can
  match (a turn's own new text) are not hashed; eviction order is unchanged by that.
- **Same scheduler, coarser.** Waiting requests are admitted first come, first
  served while fewer than ``max_num_seqs`` run and the pool has blocks; a step
  gives every decoding request one token and spends the rest of
  ``max_num_batched_tokens`` on prefill chunks (chunked prefill), first admitted
  first. The first token comes at the end of the step that finishes the prompt.
- **Priority scheduling, optional** (``scheduling="priority"``: vLLM's
  ``--scheduling-policy priority``, where a request's ``priority`` is its tier's
  rank, interactive 0, standard 1, batch 2, lower first). The waiting queue admits
  by (rank, arrival): one FIFO per rank, the lowest non-empty one first; the step's
  prefill budget goes to prefilling requests by (rank, admission), so an
  interactive prompt never waits behind a batch prefill. ``"fcfs"`` (the default)
  is the single FIFO above. vLLM also preempts the lowest-priority running request
  when KV blocks run out; blocks are reserved on admission here (below), so that
  never happens and neither does a preemption.
- **Segments, not steps.** While nothing prefills, every running request gains one
  token per step and the batch only changes when one finishes, so a *segment* of
  ``K`` decode steps (up to the next finish) is computed in O(1): step ``j`` lasts
  ``T0 + j * d`` (the KV read grows by one token per sequence per step). A request
  arriving mid-segment cuts it at the end of the step in progress
  (``interrupt``), exactly where the engine would have admitted it.

- **A host tier, optional** (``host_blocks``: vLLM's CPU offloading,
  ``--kv-offloading-size``; ``simengine.domain.prefix_cache.HostBlockCache``).
  Every full block a request computes is stored in host memory when its prompt is
  done and when it finishes (blocks off the conversation's stream take space and
  never hit); on admission, the stream blocks after the GPU hit that the host tier
  holds without a gap are loaded, not prefilled: they count as cached, their GPU
  blocks are allocated as for any miss, and the load costs
  ``host_load_us_per_token`` of device time per token in the step the request first
  prefills (pessimistic: vLLM loads asynchronously, and stores cost nothing here,
  as its stores overlap compute).

- **SGLang's radix cache, optional** (``cache="radix"``; ``"block"``, vLLM's
  block pool, is the default). The same KV memory, ``(num_gpu_blocks - 1) *
  block_size`` tokens, holds ``simengine.domain.radix_cache.RadixCache`` (page
  size 1: hits to the token, LRU eviction of unlocked leaves). A conversation's
  stream is the key ``range(base, base + n)`` (``stream_token_base``), so a match
  costs O(1) per edge. On admission a request matches its stream prefix (at most
  ``min(stream_tokens, prompt_tokens - 1)`` tokens) and locks the node; when its
  prompt is computed the prompt goes into the tree (locked while the request
  runs), and at the finish prompt and answer (then unlocked). Tokens off the
  stream (a turn's own new text, the seed's answers) go in as a range of their own
  from a negative base, unique per request: they take KV while the request runs
  and after it, as an unmatchable leaf, so eviction pressure is SGLang's. The tail
  is a leaf beside the stream's node rather than below it (a range key cannot
  continue one stream with other tokens); both are inserted at once, so the LRU
  order barely differs. Admission reserves ``prompt + max_tokens - 1`` tokens less
  the hit, as the block path reserves blocks, evicting leaves as needed. The host
  tier is block-only (SGLang's hierarchical cache, HiCache, is another design):
  ``host_blocks > 0`` with ``"radix"`` is refused.

Deviations from ``Engine``, deliberate and small at fleet scale: a request's KV
blocks for its whole answer (``prompt + max_tokens``) are reserved on admission,
so the pool never preempts (it admits less instead); jitter is per segment.
``tests`` compare this replica with ``Engine`` on the same workload.

**KV events, optional** (``kv_events=True``, block cache only): what the block
pool caches and evicts, and what the host tier stores and evicts (medium
``"CPU"``), as ``simengine.domain.kv_events`` values keyed by the synthetic hashes
(no token ids); ``take_kv_events`` hands over those since the last call (the
caller publishes them once per step). Off, nothing is recorded.

Time is the caller's: ``plan(now)`` returns when the planned segment ends,
``complete(now)`` applies it and returns the requests that produced their first
token or finished.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

from simengine.domain.kv_events import BlockRemoved, BlockStored, KVEvent
from simengine.domain.perf import PerfProfile, jitter_factor
from simengine.domain.prefix_cache import BlockPool, HostBlockCache
from simengine.domain.radix_cache import RadixCache, RadixNode

__all__ = [
    "CACHES",
    "SCHEDULING_POLICIES",
    "FleetReplica",
    "FleetRequest",
    "Segment",
    "prefix_block_hash",
    "request_block_hashes",
    "stream_block_hash",
    "stream_token_base",
]

# The replica's prefix cache: vLLM's block pool or SGLang's radix tree.
CACHES = ("block", "radix")

# The engine's scheduling policies (vLLM's ``--scheduling-policy``).
SCHEDULING_POLICIES = ("fcfs", "priority")
# A tier's priority under ``"priority"`` (lower first; ``routing.domain.tiers``'
# ranks); an unknown tier counts as standard.
_TIER_RANK = {"interactive": 0, "standard": 1, "batch": 2}
_STANDARD_RANK = 1
_RANKS = 3
_STREAM_SHIFT = 24  # block index bits of a synthetic block hash
# Set in a shared prefix's block hashes: never a stream's (conversation numbers stay
# far below 2**39) nor the host tier's anonymous (negative) keys.
_PREFIX_BIT = 1 << 63
_MAX_DECODE_STEPS = 512  # a segment never runs longer than this many steps
# A request's off-stream tokens (radix cache): keys from -(k + 1) * span on, one
# span per request, never equal to a stream's (positive) tokens.
_TAIL_SPAN = 1 << 32


def stream_block_hash(conversation: int, block: int) -> int:
    """Return the synthetic hash of block ``block`` of a conversation's token stream."""
    return (conversation + 1) << _STREAM_SHIFT | block


def prefix_block_hash(group: int, block: int) -> int:
    """Return the synthetic hash of block ``block`` of shared prefix ``group``."""
    return _PREFIX_BIT | (group + 1) << _STREAM_SHIFT | block


def request_block_hashes(
    conversation: int,
    blocks: int,
    block_size: int,
    *,
    prefix_group: int = -1,
    prefix_tokens: int = 0,
    recorded: tuple[int, ...] = (),
) -> list[int]:
    """Return the hashes of a request's first ``blocks`` blocks: the recorded
    keys, else the shared prefix's whole blocks, then the conversation's stream."""
    if recorded:
        head = list(recorded[:blocks])
        return head + [
            stream_block_hash(conversation, k) for k in range(len(head), blocks)
        ]
    shared = prefix_tokens // block_size if prefix_group >= 0 else 0
    return [
        prefix_block_hash(prefix_group, k)
        if k < shared
        else stream_block_hash(conversation, k)
        for k in range(blocks)
    ]


def stream_token_base(conversation: int) -> int:
    """Return the first synthetic token id of a conversation's stream (radix keys:
    token ``i`` of the stream is ``base + i``; streams never overlap)."""
    return (conversation + 1) << _STREAM_SHIFT


class FleetRequest:
    """One request through the fleet: what the workload asked and what happened.

    ``stream_tokens`` counts the leading tokens of prompt plus answer that lie on the
    conversation's own token stream (and so can be shared with its other turns),
    its shared prefix (``prefix_tokens`` of prefix ``prefix_group``; -1: none)
    included; ``history_tokens`` the leading prompt tokens an earlier turn or
    another conversation's shared prefix already produced (what a warm replica can
    serve from its cache).
    """

    __slots__ = (
        "arrived_at",
        "attempts",
        "block_ids",
        "block_keys",
        "cached_tokens",
        "clock0",
        "computed",
        "conversation",
        "finished_at",
        "first_token_at",
        "gen0",
        "history_tokens",
        "host_stored",
        "host_tokens",
        "load_pending",
        "max_tokens",
        "outcome",
        "output_tokens",
        "prefix_group",
        "prefix_tokens",
        "prompt_tokens",
        "radix_nodes",
        "radix_private",
        "radix_tail",
        "radix_tree",
        "rank",
        "replica_id",
        "request_id",
        "routed_at",
        "stream_tokens",
        "team",
        "tier",
        "tokens_at_failure",
    )

    def __init__(
        self,
        request_id: int,
        *,
        team: str,
        tier: str,
        conversation: int,
        prompt_tokens: int,
        output_tokens: int,
        max_tokens: int,
        history_tokens: int,
        stream_tokens: int,
        arrived_at: float,
        prefix_group: int = -1,
        prefix_tokens: int = 0,
        block_keys: tuple[int, ...] = (),
    ) -> None:
        if prompt_tokens < 1 or output_tokens < 1 or max_tokens < output_tokens:
            raise ValueError(
                "a request needs prompt >= 1, output >= 1 and max_tokens >= output"
            )
        self.request_id = request_id
        self.team = team
        self.tier = tier
        self.conversation = conversation
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.max_tokens = max_tokens
        self.history_tokens = min(history_tokens, prompt_tokens)
        self.stream_tokens = stream_tokens
        self.prefix_group = prefix_group
        self.prefix_tokens = prefix_tokens if prefix_group >= 0 else 0
        self.block_keys = block_keys  # recorded keys, in the replica's block size
        self.arrived_at = arrived_at
        self.routed_at: float | None = None
        self.replica_id: str | None = None
        self.attempts = 0
        self.outcome = ""  # ok | error | rate_limited | shed | no_replica
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.tokens_at_failure = 0
        self.rank = 0  # the engine's priority, set by the replica on ``add``
        self._reset_engine_state()

    def _reset_engine_state(self) -> None:
        self.block_ids: list[int] = []
        self.cached_tokens = 0
        self.computed = 0
        self.gen0 = 0
        self.clock0 = 0
        self.host_tokens = 0  # of cached_tokens, those loaded from the host tier
        self.host_stored = 0  # leading full blocks stored in the host tier
        self.load_pending = False  # the host load is charged in its first step
        # Radix cache: the nodes it locks, the tokens it holds outside the tree
        # (reserved, not yet inserted), its tokens in the tree, its tail's base.
        self.radix_nodes: list[RadixNode] = []
        self.radix_private = 0
        self.radix_tree = 0
        self.radix_tail: int | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time from arrival at the gateway to the first token, or None."""
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.arrived_at

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, or None."""
        if (
            self.first_token_at is None
            or self.finished_at is None
            or self.output_tokens < 2
            or self.outcome != "ok"
        ):
            return None
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)

    def cacheable_tokens(self, block_size: int) -> int:
        """Return the history a warm cache can serve: whole blocks, below the last
        prompt token (vLLM always computes at least one)."""
        limit = (self.prompt_tokens - 1) // block_size * block_size
        return min(self.history_tokens // block_size * block_size, limit)

    def block_hashes(self, blocks: int, block_size: int) -> list[int]:
        """Return the synthetic hashes of this request's first ``blocks`` blocks."""
        return request_block_hashes(
            self.conversation,
            blocks,
            block_size,
            prefix_group=self.prefix_group,
            prefix_tokens=self.prefix_tokens,
            recorded=self.block_keys,
        )


@dataclass(slots=True)
class Segment:
    """Steps planned from ``started_at``: ``steps`` of them, step ``j`` lasting
    ``(base_ms + j * growth_ms) * jitter`` ms; ``chunks`` are this step's prefill
    (only in a one-step segment)."""

    started_at: float
    steps: int
    base_ms: float
    growth_ms: float
    jitter: float
    chunks: list[tuple[FleetRequest, int]]

    def elapsed_s(self, steps: int) -> float:
        """Return the time the first ``steps`` steps take."""
        ms = steps * self.base_ms + self.growth_ms * steps * (steps - 1) / 2
        return ms * self.jitter / 1000.0

    def ends_at(self) -> float:
        return self.started_at + self.elapsed_s(self.steps)

    def steps_done(self, now: float) -> int:
        """Return the steps completed by ``now``: the largest ``m <= steps`` with
        ``elapsed_s(m) <= now - started_at``."""
        elapsed = now - self.started_at
        if elapsed <= 0:
            return 0
        per_step = self.base_ms * self.jitter / 1000.0
        m = min(self.steps, int(elapsed / per_step))
        while m > 0 and self.elapsed_s(m) > elapsed:
            m -= 1
        while m < self.steps and self.elapsed_s(m + 1) <= elapsed:
            m += 1
        return m


class FleetReplica:
    """A replica of the fleet: a perf profile, a block pool and a batch.

    Read-only state: ``tokens_in_flight`` (prompt plus ``max_tokens`` minus tokens
    generated, over every request it holds: the gateway's load measure),
    ``num_running``, ``num_waiting``, ``kv_cache_usage_perc``, and the counters
    ``generated_tokens``, ``prefill_tokens`` (computed, hits excluded),
    ``host_hit_tokens`` (loaded from the host tier) and ``busy_s`` (time spent in
    steps). ``host`` is the host tier (``host_blocks`` > 0) or None. ``scheduling`` is ``"fcfs"`` or
    ``"priority"`` (see the module docstring). ``cache`` is ``"block"`` (``pool``,
    vLLM's block pool) or ``"radix"`` (``radix``, SGLang's tree of
    ``kv_capacity_tokens`` tokens; ``pool`` then raises AttributeError).
    """

    def __init__(
        self,
        replica_id: str,
        profile: PerfProfile,
        *,
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        seed: int = 0,
        jitter_cv: float = 0.04,
        scheduling: str = "fcfs",
        host_blocks: int = 0,
        cache: str = "block",
        kv_events: bool = False,
    ) -> None:
        if scheduling not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling is {' or '.join(SCHEDULING_POLICIES)}; got {scheduling!r}"
            )
        if cache not in CACHES:
            raise ValueError(f"cache is {' or '.join(CACHES)}; got {cache!r}")
        if cache == "radix" and host_blocks > 0:
            raise ValueError(
                "the host offload tier models vLLM's block offloading; SGLang's "
                "hierarchical cache (HiCache) is not modelled: use host_blocks=0 "
                "with the radix cache"
            )
        self.replica_id = replica_id
        self.scheduling = scheduling
        self._by_priority = scheduling == "priority"
        self.profile = profile
        self.block_size = block_size or profile.block_size
        # The same KV memory, in blocks of this replica's size.
        kv_tokens = (profile.num_gpu_blocks - 1) * profile.block_size
        blocks = (
            num_gpu_blocks
            if num_gpu_blocks is not None
            else kv_tokens // self.block_size + 1
        )
        self.cache = cache
        # The KV memory in tokens: the pool's whole blocks; the radix tree holds
        # the profile's tokens exactly (no rounding to this replica's blocks).
        self.kv_capacity_tokens = (
            kv_tokens
            if cache == "radix" and num_gpu_blocks is None
            else (blocks - 1) * self.block_size
        )
        self._pool: BlockPool | None = None
        self.radix: RadixCache | None = None
        if cache == "radix":
            self.radix = RadixCache()
        else:
            self._pool = BlockPool(blocks, self.block_size, enable_kv_events=kv_events)
        self._radix_private = 0  # Σ tokens reserved outside the tree
        self._next_tail = 0  # off-stream tails handed out (radix)
        # The CPU offload tier, in blocks of this replica's size (0: none).
        self.host: HostBlockCache | None = (
            HostBlockCache(host_blocks) if host_blocks > 0 else None
        )
        self._load_ms_per_token = profile.host_load_us_per_token / 1000.0
        # KV events since the last ``take_kv_events`` (None: not recorded).
        self._kv_events: list[KVEvent] | None = None
        if kv_events and self._pool is not None:
            # The pool records its removals (vLLM's BlockRemoved); this replica
            # records what it stores, keyed by the synthetic hashes.
            self._kv_events = []
            if self.host is not None:
                self.host.evicted_log = []
        self.max_num_seqs = profile.max_num_seqs
        self.max_num_batched_tokens = profile.max_num_batched_tokens
        self._rng = random.Random(seed)
        self._jitter_cv = jitter_cv
        # One FIFO per rank (only rank 0 under fcfs): admitted lowest rank first.
        self._waiting: list[deque[FleetRequest]] = [
            deque() for _ in range(_RANKS if self._by_priority else 1)
        ]
        self._num_waiting = 0
        # In admission order (fcfs) or by (rank, admission) (priority).
        self.prefilling: list[FleetRequest] = []
        self.decoding: dict[int, FleetRequest] = {}
        self._finish_heap: list[tuple[int, int]] = []  # (finish clock, request id)
        self.clock = 0  # decode steps taken by every decoding request
        self._kv_base = 0  # Σ (prompt + gen0 - clock0) over decoding requests
        self._gen_base = 0  # Σ (gen0 - clock0) over decoding requests
        self._held_tokens = 0  # Σ (prompt + max_tokens) over every request held
        self.segment: Segment | None = None
        self.generated_tokens = 0
        self.prefill_tokens = 0
        self.host_hit_tokens = 0
        self.busy_s = 0.0
        self.alive = True

    # -- read-only state ---------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.decoding) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def waiting(self) -> list[FleetRequest]:
        """The waiting requests in the order they would be admitted."""
        return [request for queue in self._waiting for request in queue]

    @property
    def kv_reserved_tokens(self) -> int:
        """Radix cache: tokens reserved by running requests outside the tree (their
        KV not yet inserted, their answers to come); 0 with the block pool."""
        return self._radix_private

    @property
    def pool(self) -> BlockPool:
        """The block pool (``cache="block"``)."""
        if self._pool is None:
            raise AttributeError("a radix-cache replica has no block pool")
        return self._pool

    @property
    def kv_cache_usage_perc(self) -> float:
        """vLLM's ``kv_cache_usage_perc`` (blocks referenced); with the radix cache,
        SGLang's token usage: tokens held by running requests (locked in the tree or
        reserved outside it) over the capacity."""
        if self.radix is not None:
            held = self.radix.protected_size + self._radix_private
            return held / self.kv_capacity_tokens
        return self.pool.usage

    def tokens_in_flight(self, now: float | None = None) -> int:
        """Return prompt + max_tokens - generated over every request held, counting
        the steps of the running segment done by ``now`` (if given)."""
        clock = self.clock
        segment = self.segment
        if now is not None and segment is not None and segment.steps > 1:
            clock += segment.steps_done(now)
        return self._held_tokens - self._gen_base - len(self.decoding) * clock

    def holds(self) -> list[FleetRequest]:
        """Return every request on this replica (waiting, prefilling, decoding)."""
        return [*self.waiting, *self.prefilling, *self.decoding.values()]

    def take_kv_events(self) -> tuple[KVEvent, ...]:
        """Return the KV events recorded since the last call (none when off)."""
        events = self._kv_events
        if not events:
            return ()
        self._kv_events = []
        return tuple(events)

    def generated_by(self, request: FleetRequest) -> int:
        """Return the tokens ``request`` has produced here so far."""
        if request.request_id in self.decoding:
            return request.gen0 + self.clock - request.clock0
        return 0

    # -- requests ----------------------------------------------------------------------

    def add(self, request: FleetRequest) -> None:
        """Queue ``request`` (the caller then calls ``interrupt`` or ``plan``)."""
        if self.radix is not None and (request.prefix_tokens > 0 or request.block_keys):
            raise ValueError(
                "the radix cache keys a conversation's stream by token ranges; "
                "shared prefixes are modelled with the block cache (vllm) only"
            )
        request.replica_id = self.replica_id
        request._reset_engine_state()
        request.rank = (
            _TIER_RANK.get(request.tier, _STANDARD_RANK) if self._by_priority else 0
        )
        self._waiting[request.rank].append(request)
        self._num_waiting += 1
        self._held_tokens += request.prompt_tokens + request.max_tokens

    def interrupt(self, now: float) -> float | None:
        """Cut the running segment at the end of the step in progress at ``now``.

        Returns the segment's new end, or None when nothing changed (no segment, a
        one-step segment, or ``now`` already in its last step).
        """
        segment = self.segment
        if segment is None or segment.steps <= 1:
            return None
        keep = segment.steps_done(now) + 1
        if keep >= segment.steps:
            return None
        segment.steps = keep
        return segment.ends_at()

    def plan(self, now: float) -> float | None:
        """Admit what fits and plan the next segment from ``now``; return its end,
        or None when the replica has nothing to run."""
        if self.segment is not None:
            raise RuntimeError("a segment is already planned")
        self._admit()
        decoders = len(self.decoding)
        if not decoders and not self.prefilling:
            return None
        profile = self.profile
        kv_tokens = self._kv_base + decoders * self.clock
        if self.prefilling:
            budget = self.max_num_batched_tokens - decoders
            chunks: list[tuple[FleetRequest, int]] = []
            prefill_tokens = 0
            prefill_work = 0.0
            load_tokens = 0
            for request in self.prefilling:
                if budget <= 0:
                    break
                if request.load_pending:
                    load_tokens += request.host_tokens
                left = request.prompt_tokens - request.computed
                n = left if left < budget else budget
                chunks.append((request, n))
                budget -= n
                prefill_tokens += n
                prefill_work += n * (request.computed + n / 2)
            steps, growth = 1, 0.0
        else:
            chunks = []
            prefill_tokens, prefill_work, load_tokens = 0, 0.0, 0
            steps = min(self._finish_heap[0][0] - self.clock, _MAX_DECODE_STEPS)
            growth = profile.kkv_us * 1e-3 * decoders
        linear = profile.ctok_ms * (decoders + prefill_tokens)
        base = (
            profile.a_ms
            + (linear if linear > profile.w_ms else profile.w_ms)
            + profile.b_ms * decoders
            + profile.p_ms * len(chunks)
            + profile.kkv_us * 1e-3 * kv_tokens
            + profile.katt * prefill_work
            + self._load_ms_per_token * load_tokens
        )
        host = profile.h_ms * (decoders + len(chunks))
        if host > base:
            # Host-bound (perf: the step is the longer of device and host time):
            # constant steps until the device's growing time overtakes the host's.
            if growth > 0:
                steps = min(steps, max(1, math.ceil((host - base) / growth)))
            base, growth = host, 0.0
        self.segment = Segment(
            started_at=now,
            steps=steps,
            base_ms=base,
            growth_ms=growth,
            jitter=jitter_factor(self._rng, self._jitter_cv),
            chunks=chunks,
        )
        return self.segment.ends_at()

    def complete(self, now: float) -> tuple[list[FleetRequest], list[FleetRequest]]:
        """Apply the planned segment, which ends at ``now``.

        Returns ``(first_tokens, finished)``: requests whose first token came out
        in it, and requests that produced their last token (their blocks freed).
        """
        segment = self.segment
        if segment is None:
            raise RuntimeError("no segment is planned")
        self.segment = None
        self.busy_s += now - segment.started_at
        decoders = len(self.decoding)
        self.clock += segment.steps
        self.generated_tokens += decoders * segment.steps
        first: list[FleetRequest] = []
        finished: list[FleetRequest] = []
        # Prefill chunks (a one-step segment): prompts that complete sample a token.
        for request, n in segment.chunks:
            request.computed += n
            request.load_pending = False
            self.prefill_tokens += n
            if request.computed < request.prompt_tokens:
                continue
            self.prefilling.remove(request)
            if self.radix is not None:
                self._cache_radix(
                    request, request.prompt_tokens, done=request.output_tokens == 1
                )
            else:
                self._cache_stream_blocks(request, request.prompt_tokens)
                self._store_host(request, request.prompt_tokens)
            request.first_token_at = now
            first.append(request)
            self.generated_tokens += 1
            if request.output_tokens == 1:
                finished.append(self._release(request, now))
                continue
            request.gen0 = 1
            request.clock0 = self.clock
            self.decoding[request.request_id] = request
            self._kv_base += request.prompt_tokens + 1 - self.clock
            self._gen_base += 1 - self.clock
            heapq.heappush(
                self._finish_heap,
                (self.clock + request.output_tokens - 1, request.request_id),
            )
        heap = self._finish_heap
        while heap and heap[0][0] <= self.clock:
            _, request_id = heapq.heappop(heap)
            done = self.decoding.pop(request_id, None)
            if done is None:
                continue  # removed earlier (failed over)
            self._kv_base -= done.prompt_tokens + done.gen0 - done.clock0
            self._gen_base -= done.gen0 - done.clock0
            computed = done.prompt_tokens + done.output_tokens - 1
            if self.radix is not None:
                self._cache_radix(done, computed, done=True)
            else:
                self._cache_stream_blocks(done, computed)
                self._store_host(done, computed)
            finished.append(self._release(done, now))
        return first, finished

    def fail(self, now: float) -> list[FleetRequest]:
        """Lose the replica: return every request it held, with the tokens each had
        produced in ``tokens_at_failure``; the replica is dead afterwards."""
        lost = []
        clock = self.clock
        segment = self.segment
        if segment is not None and segment.steps > 1:
            clock += segment.steps_done(now)
        for queue in self._waiting:
            for request in queue:
                request.tokens_at_failure = 0
                lost.append(request)
            queue.clear()
        self._num_waiting = 0
        for request in self.prefilling:
            request.tokens_at_failure = 0
            lost.append(request)
        for request in self.decoding.values():
            request.tokens_at_failure = request.gen0 + clock - request.clock0
            lost.append(request)
        self.prefilling.clear()
        self.decoding.clear()
        self._finish_heap.clear()
        self._held_tokens = self._kv_base = self._gen_base = 0
        self._radix_private = 0
        self.segment = None
        self.alive = False
        return lost

    # -- internals ---------------------------------------------------------------------

    def _admit(self) -> None:
        if self.radix is not None:
            self._admit_radix(self.radix)
            return
        pool = self.pool
        block_size = self.block_size
        while (
            self._num_waiting
            and len(self.decoding) + len(self.prefilling) < self.max_num_seqs
        ):
            waiting = next(queue for queue in self._waiting if queue)
            request = waiting[0]
            total = request.prompt_tokens + request.max_tokens
            # As the engine: the hit stops below the last prompt token.
            max_hit = (request.prompt_tokens - 1) // block_size
            stream_blocks = min(request.stream_tokens // block_size, max_hit)
            hashes = request.block_hashes(stream_blocks, block_size)
            hit_ids = pool.cached_block_ids(hashes)
            gpu_hit = len(hit_ids)
            host = self.host
            host_hit = (
                host.lookup(hashes, gpu_hit, stream_blocks)
                if host is not None and gpu_hit < stream_blocks
                else 0
            )
            need = -(-(total - 1) // block_size) - gpu_hit
            if need + pool.num_evictable(hit_ids) > pool.num_free_blocks:
                if not self.decoding and not self.prefilling:
                    # It can never fit: refuse it rather than stall the replica.
                    raise ValueError(
                        f"request needs {need} KV blocks; the pool has "
                        f"{pool.num_free_blocks} free"
                    )
                break
            waiting.popleft()
            self._num_waiting -= 1
            pool.touch(hit_ids)
            hit_ids.extend(pool.allocate(need))
            if self._kv_events is not None:
                self._kv_events.extend(pool.take_events())
            request.block_ids = hit_ids
            request.cached_tokens = request.computed = (gpu_hit + host_hit) * block_size
            if host_hit:
                assert host is not None
                host.touch(hashes[gpu_hit : gpu_hit + host_hit])
                request.host_tokens = host_hit * block_size
                request.load_pending = True
                self.host_hit_tokens += request.host_tokens
            self._start_prefill(request)

    def _start_prefill(self, request: FleetRequest) -> None:
        prefilling = self.prefilling
        if self._by_priority and prefilling and prefilling[-1].rank > request.rank:
            # Before the first of a higher rank: by (rank, admission).
            at = len(prefilling)
            while at and prefilling[at - 1].rank > request.rank:
                at -= 1
            prefilling.insert(at, request)
        else:
            prefilling.append(request)

    def _admit_radix(self, tree: RadixCache) -> None:
        """Admit as ``_admit`` does, against the radix tree: match the stream prefix
        (to the token), lock it, reserve the rest of ``prompt + max_tokens - 1``,
        evicting unlocked leaves for it."""
        capacity = self.kv_capacity_tokens
        while (
            self._num_waiting
            and len(self.decoding) + len(self.prefilling) < self.max_num_seqs
        ):
            waiting = next(queue for queue in self._waiting if queue)
            request = waiting[0]
            total = request.prompt_tokens + request.max_tokens
            # As the engine: the hit stops below the last prompt token.
            limit = min(request.stream_tokens, request.prompt_tokens - 1)
            base = stream_token_base(request.conversation)
            match = tree.match_prefix(range(base, base + max(limit, 0)))
            tree.lock(match.node)
            need = total - 1 - match.length
            free = capacity - tree.total_size - self._radix_private
            if need > free + tree.evictable_size:
                tree.unlock(match.node)
                if not self.decoding and not self.prefilling:
                    # It can never fit: refuse it rather than stall the replica.
                    raise ValueError(
                        f"request needs {need} KV tokens; the cache has "
                        f"{free + tree.evictable_size} free or evictable"
                    )
                break
            if need > free:
                tree.evict(need - free)
            waiting.popleft()
            self._num_waiting -= 1
            request.radix_nodes = [match.node]
            request.radix_tree = match.length
            request.radix_private = need
            self._radix_private += need
            request.cached_tokens = request.computed = match.length
            self._start_prefill(request)

    def _cache_radix(self, request: FleetRequest, computed: int, *, done: bool) -> None:
        """Put ``request``'s first ``computed`` tokens in the tree: the stream part
        as the stream's range, the rest as the request's own tail. Running
        (``done`` false), it locks what it inserted and releases its old locks; done,
        it unlocks everything and gives back what it reserved."""
        tree = self.radix
        assert tree is not None
        on_stream = min(computed, request.stream_tokens)
        tail = computed - on_stream
        keys: list[range] = []
        if on_stream > 0:
            base = stream_token_base(request.conversation)
            keys.append(range(base, base + on_stream))
        if tail > 0:
            if request.radix_tail is None:
                if tail >= _TAIL_SPAN:
                    raise ValueError("a request's own tokens exceed the tail span")
                self._next_tail += 1
                request.radix_tail = -self._next_tail * _TAIL_SPAN
            keys.append(range(request.radix_tail, request.radix_tail + tail))
        locked: list[RadixNode] = []
        for key in keys:
            tree.insert(key)
            if not done:
                # Nothing evicts between the insert and this lock.
                node = tree.match_prefix(key).node
                tree.lock(node)
                locked.append(node)
        for node in request.radix_nodes:
            tree.unlock(node)
        request.radix_nodes = locked
        # Tokens now in the tree (new, or duplicates of another request's, freed)
        # leave the request's reservation; at the end all of it goes back.
        moved = request.radix_private if done else computed - request.radix_tree
        request.radix_tree = computed
        request.radix_private -= moved
        self._radix_private -= moved

    def _cache_stream_blocks(self, request: FleetRequest, computed: int) -> None:
        """Hash the full blocks of ``request`` that lie on its conversation's stream."""
        block_size = self.block_size
        full = min(computed, request.stream_tokens) // block_size
        # Blocks loaded from the host tier are cached on the GPU like computed ones.
        first = (request.cached_tokens - request.host_tokens) // block_size
        if full <= first:
            return
        pool = self.pool
        block_ids = request.block_ids
        hashes = request.block_hashes(full, block_size)
        events = self._kv_events
        if events is None:
            for k in range(first, full):
                pool.cache_block(block_ids[k], hashes[k])
            return
        run: list[int] = []  # consecutive blocks cached, published as one event
        for k in range(first, full):
            if pool.cache_block(block_ids[k], hashes[k]):
                if not run:
                    parent = hashes[k - 1] if k else None
                run.append(hashes[k])
            elif run:
                events.append(BlockStored(tuple(run), parent, (), block_size))
                run = []
        if run:
            events.append(BlockStored(tuple(run), parent, (), block_size))

    def _store_host(self, request: FleetRequest, computed: int) -> None:
        """Store the full blocks of ``request``'s first ``computed`` tokens in the
        host tier (those already stored by it excepted)."""
        host = self.host
        if host is None:
            return
        block_size = self.block_size
        full = computed // block_size
        start = request.host_stored
        if full <= start:
            return
        on_stream = min(computed, request.stream_tokens) // block_size
        chain = request.block_hashes(min(full, on_stream), block_size)
        hashes = chain[start:]
        events = self._kv_events
        if events is not None:
            new = [k for k in range(start, len(chain)) if chain[k] not in host]
            if new:
                # One event: the index keys synthetic blocks by their own hashes,
                # so a gap in the run (a block already stored) changes nothing.
                parent = chain[new[0] - 1] if new[0] else None
                stored = tuple(chain[k] for k in new)
                events.append(BlockStored(stored, parent, (), block_size, "CPU"))
        host.store(hashes)
        host.store_unmatched(full - max(start, on_stream))
        request.host_stored = full
        if events is not None and host.evicted_log:
            # Anonymous blocks (negative keys) were never announced.
            gone = tuple(h for h in host.evicted_log if h >= 0)
            if gone:
                events.append(BlockRemoved(gone, "CPU"))
            host.evicted_log.clear()

    def _release(self, request: FleetRequest, now: float) -> FleetRequest:
        if self._pool is not None:
            self._pool.free(request.block_ids)
        request.block_ids = []
        self._held_tokens -= request.prompt_tokens + request.max_tokens
        request.finished_at = now
        return request

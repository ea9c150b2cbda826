"""What a fleet simulation runs with: the fleet, the platform's options, the scenario.

Public surface: ``ENGINES``, ``FleetConfig``, ``FleetEvent``.
"""

from __future__ import annotations

from dataclasses import dataclass

from batches.domain.guard import BatchGuard
from drills.domain.fleet_scaling import FleetAutoscaling
from drills.domain.replica import SCHEDULING_POLICIES
from routing.domain.admission_control import AdmissionOptions
from routing.domain.policies import DEFAULT_POLICY_OPTIONS, PolicyOptions
from simengine.domain.perf import PROFILES, PerfProfile
from simengine.domain.prefix_cache import host_blocks

__all__ = ["ENGINES", "FleetConfig", "FleetEvent"]

# The serving engine of a pool's replicas, and the prefix cache each one runs
# (``drills.domain.replica``): vLLM's block pool or SGLang's radix tree.
ENGINES = {"vllm": "block", "sglang": "radix"}

_DEFAULT_ADMISSION = AdmissionOptions()


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The fleet and the platform settings the simulation runs with.

    Routing and admission options default to the platform's defaults
    (``PolicyOptions``, ``AdmissionOptions``; ``drills.fleet_settings`` reads the
    settings instead); ``block_size`` is the simulated
    KV block (the same memory in fewer, larger blocks is faster to simulate; hits
    are then whole blocks of this size). ``autoscaling`` (None: a fixed fleet of
    ``replicas``) runs the platform's autoscaler from ``replicas`` on.
    ``engine`` is the pool's serving engine (``ENGINES``): one config is one pool,
    so a drill mixes engines by giving its pools different ones.
    """

    replicas: int = 12
    profile: str = "a100-8b"
    policy: str = "prefix_affinity"
    block_size: int = 64
    load_factor: float = DEFAULT_POLICY_OPTIONS.load_factor
    min_bound_tokens: int = DEFAULT_POLICY_OPTIONS.min_bound_tokens
    admission: bool = False
    replica_tokens_in_flight: int = 110_000
    max_queue: int = _DEFAULT_ADMISSION.max_queue
    max_wait_s: float = _DEFAULT_ADMISSION.max_wait_s
    batch_ceiling: float = _DEFAULT_ADMISSION.batch_ceiling
    batch_lane: float = _DEFAULT_ADMISSION.batch_lane
    retry_ratio: float = 0.1
    retry_min: int = 3
    cold_start_s: float = 0.0
    sample_s: float = 1.0
    jitter_cv: float = 0.04
    seed: int = 0
    autoscaling: FleetAutoscaling | None = None
    # The replicas' engine scheduling policy (``drills.domain.replica``): "fcfs"
    # or "priority" (vLLM's ``--scheduling-policy``, priority = the tier's rank).
    engine_scheduling: str = "fcfs"
    # The replicas' CPU offload tier in GiB (vLLM's ``--kv-offloading-size``; 0:
    # none), sized with the profile's KV bytes per token.
    host_offload_gib: float = 0.0
    # An experiment (routing_ab --owner-wait-ms): a request whose warm replica is
    # over prefix affinity's bound waits up to this long for it, polling every
    # 25 ms, before the policy's next choice takes it. 0: the gateway's behaviour.
    owner_wait_s: float = 0.0
    # Prefix affinity's ring walk (``PolicyOptions.ring_choices``; 0: whole ring).
    ring_choices: int = DEFAULT_POLICY_OPTIONS.ring_choices
    # The replicas' engine: "vllm" (block pool of ``block_size`` tokens) or
    # "sglang" (radix cache, hits to the token; no host offload tier).
    engine: str = "vllm"
    # Cache-aware routing (``PolicyOptions``): its prefill gap and load ceiling.
    prefill_gap_tokens: int = DEFAULT_POLICY_OPTIONS.prefill_gap_tokens
    cache_load_factor: float = DEFAULT_POLICY_OPTIONS.cache_load_factor
    # The replicas publish KV events and the gateway keeps a prefix index of them
    # (always with the "cache_aware" policy; vLLM's block cache only). Events
    # reach the index ``kv_event_delay_s`` after the step that made them.
    kv_events: bool = False
    kv_event_delay_s: float = 0.05
    # The replicas' batch guard (``batches.domain.guard``: batch's ceilings on KV
    # and prefill tokens per step, preemption by priority; None: none). Needs
    # ``engine_scheduling="priority"`` and the vLLM engine.
    batch_guard: BatchGuard | None = None
    # Between admission and the replica: the gateway's own work and the engine's
    # frontend, which the step model does not count. The admitted tokens are
    # held through it and a first token comes that much later (the twin check
    # sets it to what the live window measured; 0: none, every drill).
    route_delay_s: float = 0.0
    # Place each request on the replica that served it live (``Arrival.replica``,
    # a recorded trace's): the k-th replica the trace names, in order of first
    # appearance, is the k-th one the simulation created. The policy places a
    # request that names none, or whose replica is not serving. The twin check
    # sets it: the live ring hashes routing keys and replica names the twin
    # does not have (the trace's keys are salted), so with the policy's own
    # placement a different set of conversations moves to a new replica and
    # misses its cache.
    follow_placement: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        if self.profile not in PROFILES:
            raise ValueError(
                f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}"
            )
        if self.block_size < 1 or self.sample_s <= 0:
            raise ValueError("block_size and sample_s must be positive")
        for name in ("owner_wait_s", "kv_event_delay_s", "route_delay_s"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0")
        if not 0 <= self.host_offload_gib < float("inf"):
            raise ValueError("host_offload_gib must be a finite number >= 0")
        if self.engine_scheduling not in SCHEDULING_POLICIES:
            raise ValueError(
                f"engine_scheduling is {' or '.join(SCHEDULING_POLICIES)}; got "
                f"{self.engine_scheduling!r}"
            )
        if self.engine not in ENGINES:
            raise ValueError(f"engine is {' or '.join(ENGINES)}; got {self.engine!r}")
        if self.engine == "sglang" and self.host_offload_gib > 0:
            raise ValueError(
                "host_offload_gib models vLLM's CPU offloading; SGLang's "
                "hierarchical cache is not modelled: use 0 with engine='sglang'"
            )

    @property
    def perf_profile(self) -> PerfProfile:
        return PROFILES[self.profile]

    @property
    def replica_cache(self) -> str:
        """Return the replicas' prefix cache: ``"block"`` or ``"radix"``."""
        return ENGINES[self.engine]

    @property
    def hit_block_size(self) -> int:
        """Return the granularity hits are counted in: ``block_size`` for vLLM's
        blocks, 1 for SGLang's radix tree (a hit to the token)."""
        return 1 if self.engine == "sglang" else self.block_size

    @property
    def host_blocks(self) -> int:
        """Return each replica's host-tier blocks of ``block_size`` tokens."""
        profile = self.perf_profile
        # vLLM's size is the total over the tensor-parallel ranks.
        return host_blocks(
            self.host_offload_gib,
            self.block_size,
            profile.kv_bytes_per_token * profile.gpus,
        )

    @property
    def policy_options(self) -> PolicyOptions:
        return PolicyOptions(
            load_factor=self.load_factor,
            min_bound_tokens=self.min_bound_tokens,
            ring_choices=self.ring_choices,
            prefill_gap_tokens=self.prefill_gap_tokens,
            cache_load_factor=self.cache_load_factor,
        )

    @property
    def has_kv_index(self) -> bool:
        """Return whether the gateway keeps a prefix index from KV events: asked
        for, or needed by the policy; the radix cache publishes none here."""
        wanted = self.kv_events or self.policy == "cache_aware"
        return wanted and self.replica_cache == "block"

    @property
    def admission_options(self) -> AdmissionOptions:
        return AdmissionOptions(
            max_queue=self.max_queue,
            max_wait_s=self.max_wait_s,
            batch_ceiling=self.batch_ceiling,
            batch_lane=self.batch_lane,
        )


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """Something that happens to the fleet at ``at`` seconds.

    Kinds: ``lose_replica`` (``replica`` or else the ``count`` most loaded die),
    ``add_replica`` (``count`` new replicas, serving after ``cold_start_s``),
    ``rate`` (all arrivals run at ``factor`` times the base rate from now on),
    ``team_rate`` (``team``'s arrivals run at ``factor`` times its base rate).
    """

    at: float
    kind: str
    count: int = 1
    factor: float = 1.0
    replica: str | None = None
    team: str | None = None

    def __post_init__(self) -> None:
        kinds = ("lose_replica", "add_replica", "rate", "team_rate")
        if self.kind not in kinds:
            raise ValueError(f"event kind must be one of {', '.join(kinds)}")
        if self.at < 0 or self.count < 1 or self.factor < 0:
            raise ValueError("events need at >= 0, count >= 1 and factor >= 0")
        if self.kind == "team_rate" and not self.team:
            raise ValueError("a team_rate event names its team")

"""The gateway's view of the control plane: immutable records built off the hot path.

Public surface: ``KeyRecord``, ``LimitRecord``, ``EntitlementRecord``,
``BudgetRecord``, ``VersionRecord``, ``ModelRecord``, ``ReplicaRecord``,
``ConfigSnapshot``, ``NodeSnapshot``.

A ``ConfigSnapshot`` is rebuilt in the background (every couple of seconds) from the
database and swapped in whole; request handling only reads it, so it never touches
the ORM. ``NodeSnapshot`` is one replica as a routing policy sees it at decision
time: its static identity plus the live load summed over every gateway process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

__all__ = [
    "MODEL_KINDS",
    "BudgetRecord",
    "ConfigSnapshot",
    "EntitlementRecord",
    "KeyRecord",
    "LimitRecord",
    "ModelRecord",
    "NodeSnapshot",
    "ReplicaRecord",
    "VersionRecord",
]

# What a model name serves (models_registry's ModelKind): which API answers it.
MODEL_KINDS = ("chat", "embedding")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """An active team API key, by the SHA-256 of its secret.

    ``batch``: the platform minted it for one batch job (accounts' purpose
    ``batch``). It opens only chat completions and embeddings (what a batch runs),
    and everything sent with it is metered as batch work, whatever tier the
    request asks for.
    """

    key_id: int
    team: str
    batch: bool = False


@dataclass(frozen=True, slots=True)
class LimitRecord:
    """A team's limits on a model (team_limits)."""

    team: str
    model: str
    tokens_per_minute: int
    max_concurrency: int
    guaranteed_share: float


@dataclass(frozen=True, slots=True)
class EntitlementRecord:
    """The tiers a team may use on a model (team_entitlements); without one, the
    operator's default (``PLATFORM_DEFAULT_TIERS``)."""

    team: str
    model: str
    tiers: tuple[str, ...]

    def __post_init__(self) -> None:
        # A snapshot file holds the tiers as a JSON list.
        object.__setattr__(self, "tiers", tuple(self.tiers))


@dataclass(frozen=True, slots=True)
class BudgetRecord:
    """A team's monthly USD budget (team_budgets), with its spend in ``month``
    already flushed to the database when the snapshot was built.

    ``model`` "" covers all the team's models. ``spent_here_usd`` is this region's
    part of the spend, ``spent_elsewhere_usd`` the other regions' (each priced at
    its own region's GPU-hour price).
    """

    team: str
    model: str
    monthly_usd: float
    soft_fraction: float
    hard_fraction: float
    month: str
    spent_here_usd: float = 0.0
    spent_elsewhere_usd: float = 0.0

    @property
    def hard_usd(self) -> float:
        """The spend past which new requests are refused."""
        return self.monthly_usd * self.hard_fraction


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """A registered version, with what routing and admission need of it.

    ``weights_uri``, ``tokenizer_hash`` and ``chat_template`` let the gateway count
    prompt tokens with the version's own tokenizer (``routing.prompt_tokens``).
    """

    model: str
    version: str
    status: str
    max_model_len: int
    load_test_tokens_in_flight: int | None
    weights_uri: str = ""
    tokenizer_hash: str = ""
    chat_template: str = ""
    # The engine runs vLLM's ``--scheduling-policy priority`` (engine_config
    # ``scheduling_policy``): the gateway sends each request's tier as its priority.
    priority_scheduling: bool = False
    # The engine's tool-call parser (engine_config ``tool_call_parser``: vLLM's
    # ``--tool-call-parser`` with ``--enable-auto-tool-choice``, SGLang's
    # ``--tool-call-parser``); "" without one: requests with tools are refused.
    tool_call_parser: str = ""
    # What a million weighted tokens (input tokens for an embedding model) of the
    # version cost in this region at a full pool (metering.domain.cost): budgets
    # price requests by it. 0 prices nothing.
    usd_per_million: float = 0.0
    # The share of conversations this region's pool of the version records for
    # the traffic twin (``Pool.record_traffic_share``; routing.domain.traffic).
    traffic_share: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """A model name and where its traffic goes."""

    model: str
    live_version: str | None
    canary_version: str | None
    canary_percent: float
    shadow_version: str | None
    shadow_percent: float
    policy: str = "prefix_affinity"
    # The version the alias left at a promotion, still loaded through its
    # retention: conversations that started on it may finish there.
    retained_version: str | None = None
    # A rollout of the model is running (any stage, begun or not): conversations
    # remember their version from then on (routing.domain.sticky).
    rollout_pending: bool = False
    # "chat" or "embedding" (fixed at registration): which API the name answers.
    kind: str = "chat"
    # An embedding model's vector size and longest input in tokens (0: a chat's).
    dimensions: int = 0
    max_input_tokens: int = 0
    # The rollout plan's live-answer judge (``rollouts.domain.plan.JudgeSpec``):
    # the judging model ("" for none), the share of the candidate's requests
    # whose pair is judged, and at most this many pairs a minute per process.
    judge_model: str = ""
    judge_share: float = 0.0
    judge_per_minute: int = 0

    @property
    def is_embedding(self) -> bool:
        """True for a model that answers ``/v1/embeddings`` (and nothing else)."""
        return self.kind == "embedding"


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """A replica as the control plane last recorded it."""

    replica_id: str
    model: str
    version: str
    region: str
    url: str
    state: str
    queue_depth: int
    tokens_in_flight: int
    kv_cache_usage_perc: float
    last_heartbeat_at: float | None  # unix seconds
    # Where the replica publishes its KV-cache events (a ZMQ endpoint to connect
    # to, "tcp://host:port"); "" when it publishes none.
    kv_events_url: str = ""


_K = TypeVar("_K")
_V = TypeVar("_V")


def _frozen(mapping: Mapping[_K, _V]) -> Mapping[_K, _V]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, slots=True)
class ConfigSnapshot:
    """Everything the gateway needs from the control plane, at one instant.

    ``keys`` maps SHA-256 hex of a secret to its key; ``limits`` and
    ``entitlements`` map (team, model); ``budgets`` maps (team, model or "");
    ``versions`` maps (model, version); ``replicas`` lists this region's replicas;
    ``pools`` names this region's pools that want replicas.
    """

    built_at: float  # unix seconds
    region: str
    keys: Mapping[str, KeyRecord] = field(default_factory=lambda: _frozen({}))
    teams: frozenset[str] = frozenset()
    limits: Mapping[tuple[str, str], LimitRecord] = field(
        default_factory=lambda: _frozen({})
    )
    models: Mapping[str, ModelRecord] = field(default_factory=lambda: _frozen({}))
    entitlements: Mapping[tuple[str, str], EntitlementRecord] = field(
        default_factory=lambda: _frozen({})
    )
    budgets: Mapping[tuple[str, str], BudgetRecord] = field(
        default_factory=lambda: _frozen({})
    )
    versions: Mapping[tuple[str, str], VersionRecord] = field(
        default_factory=lambda: _frozen({})
    )
    replicas: tuple[ReplicaRecord, ...] = ()
    # (model, version) of this region's pools that want replicas (desired > 0):
    # what /healthz requires serving replicas for.
    pools: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One replica at decision time: identity plus live load over all gateways.

    ``tokens_in_flight`` is prompt plus remaining output tokens of every request the
    gateways have outstanding on it (this process's share exact and live, the other
    processes' as published within the last second). ``prefill_tokens_in_flight``
    is the part of it still to prefill (the prompt tokens its cache did not hold, of
    requests without a first token yet), counted the same way.
    """

    replica_id: str
    url: str
    tokens_in_flight: int
    queue_depth: int = 0
    kv_cache_usage_perc: float = 0.0
    # Uncached prompt tokens of this process's requests on the replica that have
    # not had their first token yet: the prefill it still owes them.
    prefill_tokens_in_flight: int = 0

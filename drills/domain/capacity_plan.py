"""The seed's capacity arithmetic as one plan that recomputes from its inputs.

Public surface: ``Scenario`` (sections ``ChatReplicaShape``, ``BigLoad``,
``ChatModelShape``, ``BigModelShape``, ``ColdStart``, ``EmbeddingPool``), ``ScenarioError``,
``KeyRule``, ``scenario_keys``, ``Figure``, ``PrecisionOption``, ``Plan``, ``plan``,
``chat_load``, ``estimate_chat_fleet``.

Every default of ``Scenario`` is a figure the seed states, so ``plan(Scenario())``
reproduces the seed; change one input (a measured replica capacity, a model shape,
a GPU price) and every figure that depends on it follows. Where each sum comes from,
by the seed's section names:

- What "concurrent" means: ``answer_s`` (0.5 s + 300 / 30 = 10.5 s),
  ``streaming_fraction`` (10.5 / 40 = 26%), the fleet "4 times smaller".
- Tokens per second: 1,000 x 30 = 30,000 output tokens/s; / 300 = 100 requests/s.
- Replicas, 7B: 2,500 / 30 = 83 streams per replica; 30,000 / 2,500 = 12 replicas;
  grouped-query attention makes each row's KV cache 32 / 8 = 4 times smaller.
- Prefill: 100 x 1,200 = 120,000 prompt tokens/s; 100 x (1,200 - 0.8 x 800) = 56,000.
- Replicas, 70B: 60 x 20 = 1,200 tokens/s; / 400 = 3 replicas; 140 GB of FP16
  weights leave 20 GB on 2 GPUs, 70 GB of INT8 leave 90 GB.
- Two regions: each region carries the whole peak alone; 24 + 6 x 2 = 36 GPUs, each
  region normally at half load.
- Cost: 36 x 2.50 x 720 = 64,800 USD per month; 2,500 x 3,600 = 9 M tokens per
  replica-hour; 0.28 USD per million tokens when full, 0.56 when half busy.
- Routing: round-robin finds the warm replica 1 time in 12; adding a replica moves
  about 1 key in 13.
- Autoscaling and cold starts: 4 min + 14 / 0.5 + 14 / 1 + 30 s = about 5 minutes,
  plan for 6; 1.05^6 = 1.34; 0.70 x 1.34 = 0.94 in use when the replica arrives; a
  warm node needs only the last two steps (under a minute).
- Precision is chosen per model: 2 x 32 x 8 x 128 x 2 = 131,072 KV bytes per token;
  83 streams of 1,500 tokens hold 16 GB; the 70B needs 4 GPUs in FP16 (180 GB of
  cache), 2 in INT8 (90 GB), 1 in 4-bit (45 GB).
- Capacity per version: at 800 tokens/s per replica the peak needs 38 replicas; the
  56,000 uncached prompt tokens/s are 5.6 GPUs of prefill at 10,000 per GPU.

- Replicas, counting prefill (not in the seed's sums; it warns of them): the chat
  replicas per region at which the fleet carries the peak once prompts count, from
  ``drills.domain.replica_load``'s model of the fleet simulator's replica (section
  ``replica``, the ``a100-8b`` profile) and its cache (``host_offload_gib``): 14
  without host offload, 12 with 128 GiB (docs/capacity-plan.md, "Counting
  prefill").

- Embedding pool (not in the seed, which has none; off with the defaults): a RAG
  ingestion and search load in input tokens/s, sized on one embedding replica's
  input tokens/s (section ``embedding``, defaults from the simulated replica's
  ``a100-minilm`` profile, an estimate) at a target utilisation; its GPUs join the
  region's total and the monthly cost.

Rounding follows the seed: replica counts and the planned cold start (whole minutes)
round up, streams per replica round down, money rounds to cents. Every other figure
keeps full precision; ``Figure.places`` says how many decimals the seed shows.

Two generalisations the seed leaves implicit, each reducing to the seed's figures
with the defaults: a region is sized for ``peak / (regions - regions_lost)`` (with 2
regions and 1 lost, "each region must carry the whole peak alone"), and a 70B
precision's GPUs per replica is the smallest count that divides the attention heads
and leaves at least ``big_model.min_cache_gb`` for the KV cache (the seed calls 20 GB
too little and 45 GB enough).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from drills.domain.replica_load import (
    ChatLoad,
    FleetEstimate,
    StepCosts,
    estimate_fleet,
    smallest_fleet,
)
from metering.domain.usage import usd_per_million_tokens
from simengine.domain.embedding_perf import EMBEDDING_PROFILES, EmbeddingProfile
from simengine.domain.perf import PROFILES, PerfProfile

__all__ = [
    "BigLoad",
    "BigModelShape",
    "ChatModelShape",
    "ChatReplicaShape",
    "ColdStart",
    "EmbeddingPool",
    "Figure",
    "KeyRule",
    "Plan",
    "PrecisionOption",
    "Scenario",
    "ScenarioError",
    "chat_load",
    "estimate_chat_fleet",
    "plan",
    "scenario_keys",
]

# A 7B chat replica is one GPU: "14 GB of FP16 weights on an 80 GB GPU".
CHAT_GPUS_PER_REPLICA = 1
SECONDS_PER_HOUR = 3_600
BYTES_PER_GB = 1e9  # the seed's GB are decimal: 7 B parameters x 2 bytes = 14 GB
# The precisions of the schema's ``model_versions.precision``, in bytes per weight.
PRECISIONS: tuple[tuple[str, float], ...] = (
    ("fp16", 2.0),
    ("int8", 1.0),
    ("4bit", 0.5),
)


class ScenarioError(ValueError):
    """A scenario key that does not exist or a value it cannot take."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class KeyRule:
    """What one scenario key means and which values it accepts."""

    unit: str
    about: str
    minimum: float = 0.0
    is_minimum_allowed: bool = False  # False: the value must be above ``minimum``
    maximum: float | None = None
    is_whole: bool = False

    def check(self, key: str, value: object) -> None:
        """Raise ``ScenarioError`` naming ``key`` unless ``value`` obeys the rule."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ScenarioError(key, f"must be a number, not {value!r}")
        if not math.isfinite(value):
            raise ScenarioError(key, f"must be a finite number, not {value!r}")
        if self.is_whole and value != int(value):
            raise ScenarioError(key, f"must be a whole number, not {value!r}")
        if self.is_minimum_allowed and value < self.minimum:
            raise ScenarioError(
                key, f"must be at least {self.minimum:g}, not {value!r}"
            )
        if not self.is_minimum_allowed and value <= self.minimum:
            raise ScenarioError(
                key, f"must be greater than {self.minimum:g}, not {value!r}"
            )
        if self.maximum is not None and value > self.maximum:
            raise ScenarioError(key, f"must be at most {self.maximum:g}, not {value!r}")


def _key(
    default: float,
    unit: str,
    about: str,
    *,
    minimum: float = 0.0,
    is_minimum_allowed: bool = False,
    maximum: float | None = None,
    is_whole: bool = False,
) -> Any:
    rule = KeyRule(unit, about, minimum, is_minimum_allowed, maximum, is_whole)
    return field(default=default, metadata={"rule": rule})


@dataclass(frozen=True, slots=True)
class BigLoad:
    """The 70B model's peak load and replica capacity (scenario section ``big``)."""

    peak_streams: float = _key(
        60, "streams", "70B answers streaming at once at peak", is_minimum_allowed=True
    )
    stream_tokens_per_s: float = _key(20, "tokens/s", "speed of one 70B stream")
    replica_output_tokens_per_s: float = _key(
        400, "tokens/s", "output tokens one 70B replica carries (assumed)"
    )
    gpus_per_replica: int = _key(
        2, "GPUs", "GPUs per 70B replica in the fleet (2: INT8)", is_whole=True
    )


@dataclass(frozen=True, slots=True)
class ChatModelShape:
    """The 7B chat model's shape and its GPU (scenario section ``model``)."""

    layers: int = _key(32, "layers", "transformer layers", is_whole=True)
    kv_heads: int = _key(
        8, "heads", "KV heads (grouped-query attention)", is_whole=True
    )
    attention_heads: int = _key(32, "heads", "query attention heads", is_whole=True)
    head_dim: int = _key(128, "values", "size of one head", is_whole=True)
    bytes_per_value: float = _key(2, "bytes", "bytes per KV cache value (FP16)")
    weights_gb: float = _key(14, "GB", "weights on the GPU (7 B x 2 bytes)")
    gpu_memory_gb: float = _key(80, "GB", "memory of one GPU (both models)")
    context_tokens: float = _key(
        1_500, "tokens", "tokens one stream holds (1,200 prompt + 300 answer)"
    )


@dataclass(frozen=True, slots=True)
class BigModelShape:
    """The 70B model's size and split (scenario section ``big_model``)."""

    params_b: float = _key(70, "billion", "parameters")
    attention_heads: int = _key(
        64,
        "heads",
        "attention heads; tensor parallelism must divide them",
        is_whole=True,
    )
    min_cache_gb: float = _key(
        40,
        "GB",
        "least KV cache a replica must keep to be useful",
        is_minimum_allowed=True,
    )


@dataclass(frozen=True, slots=True)
class ColdStart:
    """The cold-start sum and the scale-up trigger (scenario section ``cold_start``)."""

    node_start_s: float = _key(
        240, "s", "start a GPU node (4 minutes)", is_minimum_allowed=True
    )
    disk_gb_per_s: float = _key(0.5, "GB/s", "pull weights onto the node's disk")
    load_gb_per_s: float = _key(1, "GB/s", "load weights into GPU memory")
    warmup_s: float = _key(30, "s", "engine warm-up", is_minimum_allowed=True)
    growth_per_minute: float = _key(
        0.05, "fraction/min", "load growth per minute", is_minimum_allowed=True
    )
    scale_at: float = _key(
        0.70, "fraction", "tokens in flight / capacity that adds a replica", maximum=1
    )


_A100 = PROFILES["a100-8b"]


@dataclass(frozen=True, slots=True)
class ChatReplicaShape:
    """How fast one 7B replica steps (scenario section ``replica``).

    The step-time constants of ``simengine.domain.perf`` (defaults: the fleet
    simulator's ``a100-8b`` profile, calibrated to the seed's 2,500 output tokens/s)
    and its KV cache, for the plan's count of replicas with prefill
    (``drills.domain.replica_load``). ``ChatReplicaShape.from_profile`` takes them
    from any profile (``capacity_plan --profile``).
    """

    a_ms: float = _key(
        _A100.a_ms, "ms", "fixed cost of one step", is_minimum_allowed=True
    )
    w_ms: float = _key(_A100.w_ms, "ms", "reading the weights once (memory-bound step)")
    ctok_ms: float = _key(
        _A100.ctok_ms, "ms", "linear layers per token in the step (1 / prefill speed)"
    )
    b_ms: float = _key(
        _A100.b_ms, "ms", "per decoding stream in the step", is_minimum_allowed=True
    )
    kkv_us: float = _key(
        _A100.kkv_us,
        "us",
        "decode attention per KV token read",
        is_minimum_allowed=True,
    )
    katt: float = _key(
        _A100.katt,
        "ms",
        "prefill attention per unit of n x (context + n / 2)",
        is_minimum_allowed=True,
    )
    p_ms: float = _key(
        _A100.p_ms, "ms", "per prefill chunk in the step", is_minimum_allowed=True
    )
    kv_cache_tokens: float = _key(
        (_A100.num_gpu_blocks - 1) * _A100.block_size,
        "tokens",
        "KV cache of one replica (vLLM's GPU blocks x block size)",
    )
    max_num_seqs: int = _key(
        _A100.max_num_seqs, "streams", "most streams one replica runs", is_whole=True
    )
    max_num_batched_tokens: int = _key(
        _A100.max_num_batched_tokens,
        "tokens",
        "tokens one step computes (chunked prefill budget)",
        is_whole=True,
    )
    host_load_us_per_token: float = _key(
        _A100.host_load_us_per_token,
        "us",
        "loading one token's KV from host memory (the offload tier)",
        is_minimum_allowed=True,
    )

    @classmethod
    def from_profile(cls, profile: PerfProfile) -> ChatReplicaShape:
        """Return the shape of ``profile``'s replica."""
        return cls(
            a_ms=profile.a_ms,
            w_ms=profile.w_ms,
            ctok_ms=profile.ctok_ms,
            b_ms=profile.b_ms,
            kkv_us=profile.kkv_us,
            katt=profile.katt,
            p_ms=profile.p_ms,
            kv_cache_tokens=(profile.num_gpu_blocks - 1) * profile.block_size,
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            host_load_us_per_token=profile.host_load_us_per_token,
        )

    def step_costs(self) -> StepCosts:
        """Return these keys as ``replica_load``'s costs (the same names)."""
        return StepCosts(**asdict(self))


_EMBEDDING_PROFILE = EMBEDDING_PROFILES["a100-minilm"]


@dataclass(frozen=True, slots=True)
class EmbeddingPool:
    """An embedding pool beside the chat pools (scenario section ``embedding``).

    Off with the defaults (no ingestion, no search: the seed has no embedding pool).
    ``replica_input_tokens_per_s`` defaults to the simulated replica's
    ``a100-minilm`` profile in full batches, an estimate scaled from the chat
    profiles' GPU/CPU ratio (``simengine.domain.embedding_perf``); the embedding
    load test's figure replaces it. ``EmbeddingPool.from_profile`` takes it from
    another profile (``capacity_plan --embedding-profile``).
    """

    ingest_requests_per_s: float = _key(
        0,
        "requests/s",
        "RAG ingestion requests at peak (0 with no search: no embedding pool)",
        is_minimum_allowed=True,
    )
    texts_per_request: float = _key(32, "texts", "chunks embedded per ingestion")
    tokens_per_text: float = _key(256, "tokens", "input tokens per chunk")
    search_queries_per_s: float = _key(
        0, "queries/s", "search queries at peak, one text each", is_minimum_allowed=True
    )
    query_tokens: float = _key(32, "tokens", "input tokens per search query")
    replica_input_tokens_per_s: float = _key(
        round(_EMBEDDING_PROFILE.full_batch_tokens_per_s),
        "tokens/s",
        "input tokens one embedding replica carries (a100-minilm, an estimate)",
    )
    gpus_per_replica: int = _key(1, "GPUs", "GPUs per embedding replica", is_whole=True)
    target_utilisation: float = _key(
        0.7,
        "fraction",
        "share of a replica's input tokens/s the pool is sized to use",
        maximum=1,
    )

    @classmethod
    def from_profile(cls, profile: EmbeddingProfile) -> EmbeddingPool:
        """Return the defaults with ``profile``'s full-batch input tokens/s."""
        return cls(replica_input_tokens_per_s=round(profile.full_batch_tokens_per_s))

    @property
    def input_tokens_per_s(self) -> float:
        """Input tokens/s at peak: the ingestion's chunks and the queries."""
        return (
            self.ingest_requests_per_s * self.texts_per_request * self.tokens_per_text
            + self.search_queries_per_s * self.query_tokens
        )

    @property
    def is_on(self) -> bool:
        """Whether the scenario has an embedding pool (any embedding load)."""
        return self.input_tokens_per_s > 0


_SECTIONS: dict[str, type] = {
    "replica": ChatReplicaShape,
    "big": BigLoad,
    "model": ChatModelShape,
    "big_model": BigModelShape,
    "cold_start": ColdStart,
    "embedding": EmbeddingPool,
}


@dataclass(frozen=True, slots=True)
class Scenario:
    """The inputs of a capacity plan; every default is the seed's figure.

    Invariants (checked on construction, ``ScenarioError`` names the key): every
    value obeys its ``KeyRule``; ``cached_prefix_tokens <= prompt_tokens``;
    ``regions_lost < regions``.
    """

    peak_streams: float = _key(1_000, "streams", "7B answers streaming at once at peak")
    stream_tokens_per_s: float = _key(30, "tokens/s", "speed of one 7B stream")
    answer_tokens: float = _key(300, "tokens", "output tokens per answer")
    first_token_s: float = _key(
        0.5, "s", "time to the first token", is_minimum_allowed=True
    )
    logged_in_users: float = _key(1_000, "users", "logged-in users (the other reading)")
    message_interval_s: float = _key(40, "s", "time between one user's messages")
    prompt_tokens: float = _key(1_200, "tokens", "prompt tokens per request")
    cached_prefix_tokens: float = _key(
        800, "tokens", "prompt tokens in a cached prefix", is_minimum_allowed=True
    )
    prefix_hit_rate: float = _key(
        0.8,
        "fraction",
        "share of requests that find their prefix",
        is_minimum_allowed=True,
        maximum=1,
    )
    replica_output_tokens_per_s: float = _key(
        2_500, "tokens/s", "output tokens one 7B replica carries (assumed)"
    )
    low_replica_output_tokens_per_s: float = _key(
        800, "tokens/s", "the one-GPU batching problem's replica capacity"
    )
    prefill_tokens_per_s_per_gpu: float = _key(
        10_000, "tokens/s", "prompt tokens one GPU prefills"
    )
    regions: int = _key(2, "regions", "regions serving the models", is_whole=True)
    regions_lost: int = _key(
        1,
        "regions",
        "regions that may fail while the rest carry the peak",
        is_minimum_allowed=True,
        is_whole=True,
    )
    gpu_hour_usd: float = _key(
        2.50, "USD", "price of one GPU-hour", is_minimum_allowed=True
    )
    hours_per_month: float = _key(720, "h", "hours billed per month")
    host_offload_gib: float = _key(
        0,
        "GiB",
        "host memory per 7B replica for its KV cache (vLLM --kv-offloading-size)",
        is_minimum_allowed=True,
    )
    host_gib_month_usd: float = _key(
        0,
        "USD",
        "price of one GiB of host memory a month (0: it comes with the GPU node)",
        is_minimum_allowed=True,
    )
    affinity_off_owner: float = _key(
        0.06,
        "fraction",
        "requests prefix affinity's load bound sends off their warm replica "
        "(measured: routing_ab's hit rate over the cache model's at the seed's peak)",
        is_minimum_allowed=True,
        maximum=1,
    )
    replica: ChatReplicaShape = field(default_factory=ChatReplicaShape)
    big: BigLoad = field(default_factory=BigLoad)
    model: ChatModelShape = field(default_factory=ChatModelShape)
    big_model: BigModelShape = field(default_factory=BigModelShape)
    cold_start: ColdStart = field(default_factory=ColdStart)
    embedding: EmbeddingPool = field(default_factory=EmbeddingPool)

    def __post_init__(self) -> None:
        for key, rule in scenario_keys().items():
            rule.check(key, self.value_of(key))
        if self.cached_prefix_tokens > self.prompt_tokens:
            raise ScenarioError(
                "cached_prefix_tokens",
                f"must not exceed prompt_tokens ({self.prompt_tokens:g}), "
                f"not {self.cached_prefix_tokens:g}",
            )
        if self.regions_lost >= self.regions:
            raise ScenarioError(
                "regions_lost",
                f"must be less than regions ({self.regions}), not {self.regions_lost}; "
                "some region must survive to carry the peak",
            )

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object]) -> Scenario:
        """Return the seed's scenario with ``mapping`` applied.

        ``mapping`` is nested by section (``{"big": {"peak_streams": 80}}``, as in a
        YAML file) or uses dotted keys (``{"big.peak_streams": 80}``).
        """
        return cls().with_values(_flatten(mapping))

    def with_overrides(self, items: Iterable[str]) -> Scenario:
        """Return a copy with ``key=value`` strings (``--set``) applied."""
        values: dict[str, object] = {}
        for item in items:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise ScenarioError(item, "expected key=value")
            values[key.strip()] = raw.strip()
        return self.with_values(values)

    def with_values(self, values: Mapping[str, object]) -> Scenario:
        """Return a copy with dotted ``key: value`` pairs applied and checked."""
        rules = scenario_keys()
        top: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        for key, raw in values.items():
            rule = rules.get(key)
            if key in _SECTIONS:
                raise ScenarioError(key, _section_message(key))
            if rule is None:
                raise ScenarioError(key, _unknown_key_message(key, rules))
            value = _number(key, raw, rule)
            section, dot, name = key.partition(".")
            if dot:
                sections.setdefault(section, {})[name] = value
            else:
                top[key] = value
        for section, changes in sections.items():
            top[section] = replace(getattr(self, section), **changes)
        return replace(self, **top)

    def value_of(self, key: str) -> Any:
        """Return the value of a dotted key (``"big.peak_streams"``)."""
        holder: Any = self
        for part in key.split("."):
            holder = getattr(holder, part)
        return holder

    def as_dict(self) -> dict[str, Any]:
        """Return the inputs nested by section, as a scenario file writes them."""
        return _tidy_dict(asdict(self))

    def overrides(self) -> dict[str, Any]:
        """Return the dotted keys whose values differ from the seed's."""
        seed = Scenario()
        return {
            key: self.value_of(key)
            for key in scenario_keys()
            if self.value_of(key) != seed.value_of(key)
        }


def scenario_keys() -> dict[str, KeyRule]:
    """Return every dotted scenario key and its rule, in declaration order."""
    return dict(_walk_rules(Scenario, ""))


def _walk_rules(cls: type, prefix: str) -> Iterator[tuple[str, KeyRule]]:
    for f in fields(cls):
        if f.name in _SECTIONS and not prefix:
            yield from _walk_rules(_SECTIONS[f.name], f"{f.name}.")
        else:
            yield prefix + f.name, f.metadata["rule"]


def _flatten(mapping: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if not prefix and key in _SECTIONS:
            if not isinstance(value, Mapping):
                raise ScenarioError(name, _section_message(name))
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _section_message(section: str) -> str:
    first = fields(_SECTIONS[section])[0].name
    return f"is a section, not a key: set its keys, e.g. {section}.{first}"


def _unknown_key_message(key: str, rules: Mapping[str, KeyRule]) -> str:
    close = difflib.get_close_matches(key, list(rules), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown scenario key{hint}; docs/capacity-plan.md lists them all"


def _number(key: str, raw: object, rule: KeyRule) -> float | int:
    value: object = raw
    if isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise ScenarioError(key, f"must be a number, not {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(key, f"must be a number, not {raw!r}")
    if rule.is_whole and math.isfinite(value) and value == int(value):
        return int(value)
    return float(value)


@dataclass(frozen=True, slots=True)
class Figure:
    """One computed figure: its value, unit, the sum that made it and its seed section.

    ``places`` is how many decimals the seed shows it with (display only).
    """

    name: str
    value: float | int
    unit: str
    how: str
    section: str
    places: int = 0


@dataclass(frozen=True, slots=True)
class PrecisionOption:
    """What one weight precision means for a 70B replica.

    ``gpus_per_replica`` is None when no split of the attention heads leaves
    ``min_cache_gb``; then the GPU totals are None too.
    """

    precision: str
    bytes_per_param: float
    weights_gb: float
    gpus_per_replica: int | None
    cache_gb_left: float | None
    cache_gb_at_fleet_gpus: float
    big_gpus_total: int | None
    fleet_gpus_total: int | None


@dataclass(frozen=True, slots=True)
class Plan:
    """The whole capacity plan for one scenario."""

    scenario: Scenario
    figures: tuple[Figure, ...]
    precision_options: tuple[PrecisionOption, ...]
    warnings: tuple[str, ...]

    def __getitem__(self, name: str) -> float | int:
        for figure in self.figures:
            if figure.name == name:
                return figure.value
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        """Return every figure by name, the precision options, warnings and inputs."""
        out: dict[str, Any] = {figure.name: figure.value for figure in self.figures}
        out["big_precision_options"] = {
            option.precision: {
                k: v for k, v in asdict(option).items() if k != "precision"
            }
            for option in self.precision_options
        }
        out["warnings"] = list(self.warnings)
        out["scenario"] = self.scenario.as_dict()
        return _tidy_dict(out)


def plan(scenario: Scenario) -> Plan:
    """Return the seed's capacity arithmetic computed for ``scenario``."""
    s, m, big, cold = scenario, scenario.model, scenario.big, scenario.cold_start
    figures: list[Figure] = []

    def add(
        name: str, value: float, unit: str, how: str, section: str, places: int = 0
    ) -> None:
        figures.append(Figure(name, value, unit, how, section, places))

    concurrent = 'What "concurrent" means'
    answer_s = s.first_token_s + s.answer_tokens / s.stream_tokens_per_s
    add(
        "answer_s",
        answer_s,
        "s",
        f"{_n(s.first_token_s)} + {_n(s.answer_tokens)} / {_n(s.stream_tokens_per_s)}",
        concurrent,
        1,
    )
    streaming_fraction = answer_s / s.message_interval_s
    add(
        "streaming_fraction",
        streaming_fraction,
        "fraction",
        f"{_n(answer_s)} / {_n(s.message_interval_s)}",
        concurrent,
        2,
    )
    logged_in_streams = s.logged_in_users * streaming_fraction
    add(
        "streams_from_logged_in_users",
        logged_in_streams,
        "streams",
        f"{_n(s.logged_in_users)} x {_n(streaming_fraction)}",
        concurrent,
        1,
    )
    add(
        "fleet_reduction_if_logged_in",
        s.peak_streams / logged_in_streams,
        "x",
        f"{_n(s.peak_streams)} / {_n(logged_in_streams)}",
        concurrent,
        1,
    )

    tokens = "Tokens per second"
    chat_tokens_per_s = s.peak_streams * s.stream_tokens_per_s
    add(
        "chat_output_tokens_per_s",
        chat_tokens_per_s,
        "tokens/s",
        f"{_n(s.peak_streams)} x {_n(s.stream_tokens_per_s)}",
        tokens,
    )
    requests_per_s = chat_tokens_per_s / s.answer_tokens
    add(
        "chat_requests_per_s",
        requests_per_s,
        "requests/s",
        f"{_n(chat_tokens_per_s)} / {_n(s.answer_tokens)}",
        tokens,
        1,
    )

    chat = "Replicas, 7B"
    survivors = s.regions - s.regions_lost
    add(
        "peak_share_per_region",
        1 / survivors,
        "fraction",
        f"1 / ({s.regions} regions - {s.regions_lost} lost)",
        chat,
        2,
    )
    streams_per_replica = _floor(s.replica_output_tokens_per_s / s.stream_tokens_per_s)
    add(
        "streams_per_replica",
        streams_per_replica,
        "streams",
        f"floor({_n(s.replica_output_tokens_per_s)} / {_n(s.stream_tokens_per_s)})",
        chat,
    )
    add(
        "gqa_kv_reduction",
        m.attention_heads / m.kv_heads,
        "x",
        f"{m.attention_heads} attention heads / {m.kv_heads} KV heads",
        chat,
        1,
    )
    chat_load_per_region = chat_tokens_per_s / survivors
    chat_replicas = _ceil(chat_load_per_region / s.replica_output_tokens_per_s)
    add(
        "chat_replicas_per_region",
        chat_replicas,
        "replicas",
        f"ceil({_n(chat_load_per_region)} / {_n(s.replica_output_tokens_per_s)})",
        chat,
    )

    prefill = "Prefill"
    prefill_tokens = requests_per_s * s.prompt_tokens
    add(
        "prefill_tokens_per_s",
        prefill_tokens,
        "tokens/s",
        f"{_n(requests_per_s)} x {_n(s.prompt_tokens)}",
        prefill,
    )
    uncached = requests_per_s * (
        s.prompt_tokens - s.prefix_hit_rate * s.cached_prefix_tokens
    )
    add(
        "prefill_tokens_per_s_uncached",
        uncached,
        "tokens/s",
        f"{_n(requests_per_s)} x ({_n(s.prompt_tokens)} - "
        f"{_n(s.prefix_hit_rate)} x {_n(s.cached_prefix_tokens)})",
        prefill,
    )
    add(
        "prefill_uncached_fraction",
        uncached / prefill_tokens,
        "fraction",
        f"{_n(uncached)} / {_n(prefill_tokens)}",
        prefill,
        2,
    )

    big_section = "Replicas, 70B"
    big_tokens_per_s = big.peak_streams * big.stream_tokens_per_s
    add(
        "big_output_tokens_per_s",
        big_tokens_per_s,
        "tokens/s",
        f"{_n(big.peak_streams)} x {_n(big.stream_tokens_per_s)}",
        big_section,
    )
    big_load_per_region = big_tokens_per_s / survivors
    big_replicas = _ceil(big_load_per_region / big.replica_output_tokens_per_s)
    add(
        "big_replicas_per_region",
        big_replicas,
        "replicas",
        f"ceil({_n(big_load_per_region)} / {_n(big.replica_output_tokens_per_s)})",
        big_section,
    )

    embedding_gpus, embedding_how = _embedding_figures(scenario, add)

    regions = "Two regions"
    gpus_per_region = (
        chat_replicas * CHAT_GPUS_PER_REPLICA
        + big_replicas * big.gpus_per_replica
        + embedding_gpus
    )
    add(
        "gpus_per_region",
        gpus_per_region,
        "GPUs",
        f"{chat_replicas} x {CHAT_GPUS_PER_REPLICA} + "
        f"{big_replicas} x {big.gpus_per_replica}{embedding_how}",
        regions,
    )
    gpus_total = s.regions * gpus_per_region
    add(
        "gpus_total",
        gpus_total,
        "GPUs",
        f"{s.regions} x {gpus_per_region}",
        regions,
    )
    chat_capacity_per_region = chat_replicas * s.replica_output_tokens_per_s
    utilisation_normal = chat_tokens_per_s / s.regions / chat_capacity_per_region
    add(
        "chat_utilisation_normal",
        utilisation_normal,
        "fraction",
        f"{_n(chat_tokens_per_s)} / {s.regions} / {_n(chat_capacity_per_region)}",
        regions,
        2,
    )

    cost = "Cost"
    add(
        "usd_per_month",
        _cents(gpus_total * s.gpu_hour_usd * s.hours_per_month),
        "USD",
        f"{gpus_total} x {_n(s.gpu_hour_usd)} x {_n(s.hours_per_month)}",
        cost,
    )
    tokens_per_hour = s.replica_output_tokens_per_s * SECONDS_PER_HOUR
    add(
        "chat_replica_tokens_per_hour",
        tokens_per_hour,
        "tokens/h",
        f"{_n(s.replica_output_tokens_per_s)} x {SECONDS_PER_HOUR:,}",
        cost,
    )
    for name, busy in (
        ("chat_usd_per_million_tokens_full", 1.0),
        ("chat_usd_per_million_tokens_half", 0.5),
        ("chat_usd_per_million_tokens_normal", utilisation_normal),
    ):
        add(
            name,
            _cents(
                usd_per_million_tokens(
                    s.gpu_hour_usd, CHAT_GPUS_PER_REPLICA, tokens_per_hour * busy
                )
            ),
            "USD/M tokens",
            f"{_n(s.gpu_hour_usd)} / ({_n(tokens_per_hour)} x {_n(busy)}) x 1,000,000",
            cost,
            2,
        )

    routing = "Routing"
    add(
        "round_robin_hit_rate",
        1 / chat_replicas,
        "fraction",
        f"1 / {chat_replicas}",
        routing,
        3,
    )
    add(
        "keys_moved_adding_replica",
        1 / (chat_replicas + 1),
        "fraction",
        f"1 / ({chat_replicas} + 1)",
        routing,
        3,
    )

    scaling = "Autoscaling and cold starts"
    pull_s = m.weights_gb / cold.disk_gb_per_s
    load_s = m.weights_gb / cold.load_gb_per_s
    cold_start_s = cold.node_start_s + pull_s + load_s + cold.warmup_s
    add(
        "cold_start_s",
        cold_start_s,
        "s",
        f"{_n(cold.node_start_s)} + {_n(m.weights_gb)} / {_n(cold.disk_gb_per_s)} + "
        f"{_n(m.weights_gb)} / {_n(cold.load_gb_per_s)} + {_n(cold.warmup_s)}",
        scaling,
    )
    plan_min = _ceil(cold_start_s / 60)
    add(
        "cold_start_plan_min",
        plan_min,
        "min",
        f"ceil({_n(cold_start_s)} / 60)",
        scaling,
    )
    add(
        "warm_start_s",
        load_s + cold.warmup_s,
        "s",
        f"{_n(m.weights_gb)} / {_n(cold.load_gb_per_s)} + {_n(cold.warmup_s)}",
        scaling,
    )
    growth = (1 + cold.growth_per_minute) ** plan_min
    add(
        "load_growth_during_cold_start",
        growth,
        "x",
        f"(1 + {_n(cold.growth_per_minute)}) ^ {plan_min}",
        scaling,
        2,
    )
    on_arrival = cold.scale_at * growth
    add(
        "utilisation_when_capacity_arrives",
        on_arrival,
        "fraction",
        f"{_n(cold.scale_at)} x {_n(growth)}",
        scaling,
        2,
    )

    precision = "Precision is chosen per model"
    kv_bytes = _kv_bytes_per_token(m)
    add(
        "kv_bytes_per_token",
        int(kv_bytes) if kv_bytes == int(kv_bytes) else kv_bytes,
        "bytes",
        f"2 x {m.layers} x {m.kv_heads} x {m.head_dim} x {_n(m.bytes_per_value)}",
        precision,
    )
    kv_gb = streams_per_replica * m.context_tokens * kv_bytes / BYTES_PER_GB
    add(
        "kv_gb_at_replica_capacity",
        kv_gb,
        "GB",
        f"{streams_per_replica} x {_n(m.context_tokens)} x {_n(kv_bytes)} / 1e9",
        precision,
        1,
    )
    chat_free_gb = m.gpu_memory_gb - m.weights_gb - kv_gb
    add(
        "chat_gb_free_at_capacity",
        chat_free_gb,
        "GB",
        f"{_n(m.gpu_memory_gb)} - {_n(m.weights_gb)} - {_n(kv_gb)}",
        precision,
        1,
    )

    capacity = "Capacity per version"
    low_replicas = _ceil(chat_load_per_region / s.low_replica_output_tokens_per_s)
    add(
        "chat_replicas_per_region_at_low_capacity",
        low_replicas,
        "replicas",
        f"ceil({_n(chat_load_per_region)} / {_n(s.low_replica_output_tokens_per_s)})",
        capacity,
    )
    add(
        "prefill_gpus",
        uncached / s.prefill_tokens_per_s_per_gpu,
        "GPUs",
        f"{_n(uncached)} / {_n(s.prefill_tokens_per_s_per_gpu)}",
        capacity,
        1,
    )
    add(
        "prefill_gpus_without_cache",
        prefill_tokens / s.prefill_tokens_per_s_per_gpu,
        "GPUs",
        f"{_n(prefill_tokens)} / {_n(s.prefill_tokens_per_s_per_gpu)}",
        capacity,
        1,
    )

    prefill_warnings = _prefill_figures(
        scenario,
        add,
        chat_replicas,
        big_replicas * big.gpus_per_replica,
        embedding_gpus,
    )

    options = tuple(
        _precision_option(scenario, name, bytes_per_param, chat_replicas, big_replicas)
        for name, bytes_per_param in PRECISIONS
    )
    warnings = _warnings(scenario, on_arrival, chat_free_gb, options)
    return Plan(scenario, tuple(figures), options, warnings + prefill_warnings)


def _embedding_figures(s: Scenario, add: Any) -> tuple[int, str]:
    """Add the section "Embedding pool" when the scenario has one; return its GPUs
    per region and the term it adds to ``gpus_per_region``'s sum ("" when off).

    The pool is sized as the chat pool is, on the tokens it carries (here input
    tokens): each surviving region carries its share of the peak, on replicas
    used at most ``target_utilisation``.
    """
    e = s.embedding
    if not e.is_on:
        return 0, ""
    section = "Embedding pool"
    load = e.input_tokens_per_s
    add(
        "embedding_input_tokens_per_s",
        load,
        "tokens/s",
        f"{_n(e.ingest_requests_per_s)} x {_n(e.texts_per_request)} x "
        f"{_n(e.tokens_per_text)} + {_n(e.search_queries_per_s)} x "
        f"{_n(e.query_tokens)}",
        section,
    )
    survivors = s.regions - s.regions_lost
    per_region = load / survivors
    usable = e.replica_input_tokens_per_s * e.target_utilisation
    replicas = _ceil(per_region / usable)
    add(
        "embedding_replicas_per_region",
        replicas,
        "replicas",
        f"ceil({_n(per_region)} / ({_n(e.replica_input_tokens_per_s)} x "
        f"{_n(e.target_utilisation)}))",
        section,
    )
    gpus = replicas * e.gpus_per_replica
    add(
        "embedding_gpus_per_region",
        gpus,
        "GPUs",
        f"{replicas} x {e.gpus_per_replica}",
        section,
    )
    utilisation = load / s.regions / (replicas * e.replica_input_tokens_per_s)
    add(
        "embedding_utilisation_normal",
        utilisation,
        "fraction",
        f"{_n(load)} / {s.regions} / ({replicas} x {_n(e.replica_input_tokens_per_s)})",
        section,
        2,
    )
    add(
        "embedding_usd_per_month",
        _cents(s.regions * gpus * s.gpu_hour_usd * s.hours_per_month),
        "USD",
        f"{s.regions} x {gpus} x {_n(s.gpu_hour_usd)} x {_n(s.hours_per_month)}",
        section,
    )
    tokens_per_hour = e.replica_input_tokens_per_s * SECONDS_PER_HOUR
    for name, busy in (
        ("embedding_usd_per_million_tokens_full", 1.0),
        ("embedding_usd_per_million_tokens_normal", utilisation),
    ):
        add(
            name,
            usd_per_million_tokens(
                s.gpu_hour_usd, e.gpus_per_replica, tokens_per_hour * busy
            ),
            "USD/M tokens",
            f"{_n(s.gpu_hour_usd)} x {e.gpus_per_replica} / "
            f"({_n(tokens_per_hour)} x {_n(busy)}) x 1,000,000",
            section,
            6,
        )
    return gpus, f" + {gpus} embedding"


def _kv_bytes_per_token(m: ChatModelShape) -> float:
    """K and V, every layer and KV head: 2 x 32 x 8 x 128 x 2 = 131,072 bytes."""
    return 2 * m.layers * m.kv_heads * m.head_dim * m.bytes_per_value


def chat_load(s: Scenario) -> tuple[StepCosts, ChatLoad]:
    """Return the replica's step costs and one region's chat peak, as the section
    "Replicas, counting prefill" models them."""
    kv_bytes = _kv_bytes_per_token(s.model)
    requests_per_s = s.peak_streams * s.stream_tokens_per_s / s.answer_tokens
    load = ChatLoad(
        requests_per_s=requests_per_s / (s.regions - s.regions_lost),
        prompt_tokens=s.prompt_tokens,
        cached_prefix_tokens=s.cached_prefix_tokens,
        answer_tokens=s.answer_tokens,
        stream_tokens_per_s=s.stream_tokens_per_s,
        message_interval_s=s.message_interval_s,
        host_cache_tokens=s.host_offload_gib * (1 << 30) / kv_bytes,
        off_owner=s.affinity_off_owner,
    )
    return s.replica.step_costs(), load


def estimate_chat_fleet(s: Scenario, replicas: int) -> FleetEstimate:
    """Return what ``replicas`` chat replicas do with one region's peak."""
    costs, load = chat_load(s)
    return estimate_fleet(costs, load, replicas)


def _prefill_figures(
    s: Scenario,
    add: Any,
    output_only_replicas: int,
    big_gpus_per_region: int,
    embedding_gpus_per_region: int,
) -> tuple[str, ...]:
    """Add the section "Replicas, counting prefill"; return its warnings.

    The replica model is ``drills.domain.replica_load``: the mean step of a replica
    of ``s.replica`` at a region's peak, carried when streams keep
    ``stream_tokens_per_s``; hits either assumed (``prefix_hit_rate``) or from
    the cache model (GPU KV cache, ``host_offload_gib``, ``message_interval_s``,
    ``affinity_off_owner``).
    """
    section = "Replicas, counting prefill"
    r = s.replica
    costs, load = chat_load(s)
    region_rate = load.requests_per_s
    kv_bytes = _kv_bytes_per_token(s.model)
    host_tokens = load.host_cache_tokens
    step_target = 1000 / s.stream_tokens_per_s
    add(
        "replica_prefill_tokens_per_s",
        1000 / r.ctok_ms,
        "tokens/s",
        f"1,000 / {_n(r.ctok_ms)} ms per token (the replica's prefill speed)",
        section,
    )
    add(
        "chat_step_ms_target",
        step_target,
        "ms",
        f"1,000 / {_n(s.stream_tokens_per_s)}: a step per token of every stream",
        section,
        1,
    )
    found: list[str] = []
    output_only = estimate_fleet(costs, load, output_only_replicas)
    if not output_only.is_carried(s.stream_tokens_per_s):
        step = output_only.step_ms
        found.append(
            f"once prefill counts, the output-only plan's {output_only_replicas} "
            "replicas per region do not carry the peak ("
            + (
                "queues grow without end"
                if step is None
                else f"streams at {1000 / step:.0f} tokens/s, not "
                f"{s.stream_tokens_per_s:g}"
            )
            + f'); see "{section}"'
        )
    assumed = smallest_fleet(costs, load, s.prefix_hit_rate)
    if assumed is not None and assumed.step_ms is not None:
        add(
            "chat_replicas_per_region_with_prefill_at_assumed_hit",
            assumed.replicas,
            "replicas",
            f"smallest N whose replicas, at {_n(region_rate)} / N requests/s of "
            f"{_n(s.prompt_tokens)} prompt tokens less {_n(s.prefix_hit_rate)} x "
            f"{_n(s.cached_prefix_tokens)} cached, step in at most "
            f"{_n(step_target)} ms ({_n(assumed.step_ms)})",
            section,
        )
    add(
        "host_cache_tokens_per_replica",
        host_tokens,
        "tokens",
        f"{_n(s.host_offload_gib)} GiB x 2^30 / {_n(kv_bytes)} bytes",
        section,
    )
    fleet = smallest_fleet(costs, load)
    if fleet is None or fleet.step_ms is None or fleet.streams_per_replica is None:
        found.append(
            "no fleet up to 10,000 replicas carries the peak with its prefill at "
            "the cache model's hit rate"
        )
        return tuple(found)
    n = fleet.replicas
    add(
        "prefix_hit_rate_expected",
        fleet.hit_rate,
        "fraction",
        f"on {n} replicas: 1 - exp(-tau / {_n(s.message_interval_s)} s) x "
        f"(1 - {_n(s.affinity_off_owner)}), tau the longer of the GPU cache's and "
        "the host tier's turnover",
        section,
        3,
    )
    add(
        "host_hit_rate_expected",
        fleet.host_hit_rate,
        "fraction",
        "of those, found only in host memory",
        section,
        3,
    )
    add(
        "chat_replicas_per_region_with_prefill",
        n,
        "replicas",
        f"smallest N whose replicas step in at most {_n(step_target)} ms at "
        f"{_n(region_rate)} / N requests/s, hits from the cache model",
        section,
    )
    add(
        "chat_step_ms_with_prefill",
        fleet.step_ms,
        "ms",
        f"mean step of {n} replicas (time per output token)",
        section,
        1,
    )
    add(
        "streams_per_replica_with_prefill",
        fleet.streams_per_replica,
        "streams",
        f"{_n(region_rate)} / {n} x {_n(s.answer_tokens)} x {_n(fleet.step_ms)} ms",
        section,
        1,
    )
    add(
        "prefill_tokens_per_s_uncached_with_prefill",
        fleet.uncached_prefill_tokens_per_s,
        "tokens/s",
        f"{_n(region_rate)} x ({_n(s.prompt_tokens)} - {_n(fleet.hit_rate)} x "
        f"{_n(s.cached_prefix_tokens)})",
        section,
    )
    gpus = s.regions * (
        n * CHAT_GPUS_PER_REPLICA + big_gpus_per_region + embedding_gpus_per_region
    )
    embedding_how = f" + {embedding_gpus_per_region}" if s.embedding.is_on else ""
    add(
        "gpus_total_with_prefill",
        gpus,
        "GPUs",
        f"{s.regions} x ({n} x {CHAT_GPUS_PER_REPLICA} + {big_gpus_per_region}"
        f"{embedding_how})",
        section,
    )
    host_usd = s.regions * n * s.host_offload_gib * s.host_gib_month_usd
    add(
        "usd_per_month_with_prefill",
        _cents(gpus * s.gpu_hour_usd * s.hours_per_month + host_usd),
        "USD",
        f"{gpus} x {_n(s.gpu_hour_usd)} x {_n(s.hours_per_month)} + "
        f"{s.regions} x {n} x {_n(s.host_offload_gib)} GiB x "
        f"{_n(s.host_gib_month_usd)}",
        section,
    )
    return tuple(found)


def _precision_option(
    s: Scenario,
    name: str,
    bytes_per_param: float,
    chat_replicas: int,
    big_replicas: int,
) -> PrecisionOption:
    memory = s.model.gpu_memory_gb
    weights_gb = s.big_model.params_b * bytes_per_param
    # Tensor parallelism splits every layer's heads evenly: "the usual 32 or 64
    # attention heads cannot be split evenly over 3 GPUs".
    heads = s.big_model.attention_heads
    splits = [n for n in range(1, heads + 1) if heads % n == 0]
    gpus = next(
        (n for n in splits if n * memory - weights_gb >= s.big_model.min_cache_gb),
        None,
    )
    return PrecisionOption(
        precision=name,
        bytes_per_param=bytes_per_param,
        weights_gb=weights_gb,
        gpus_per_replica=gpus,
        cache_gb_left=None if gpus is None else gpus * memory - weights_gb,
        cache_gb_at_fleet_gpus=s.big.gpus_per_replica * memory - weights_gb,
        big_gpus_total=None if gpus is None else s.regions * big_replicas * gpus,
        fleet_gpus_total=(
            None
            if gpus is None
            else s.regions
            * (chat_replicas * CHAT_GPUS_PER_REPLICA + big_replicas * gpus)
        ),
    )


def _warnings(
    s: Scenario,
    on_arrival: float,
    chat_free_gb: float,
    options: tuple[PrecisionOption, ...],
) -> tuple[str, ...]:
    found = []
    if on_arrival > 1:
        found.append(
            f"load passes capacity before a cold replica arrives "
            f"({on_arrival:.2f}): scale earlier than {s.cold_start.scale_at:g} "
            "or keep warm replicas"
        )
    streams = _floor(s.replica_output_tokens_per_s / s.stream_tokens_per_s)
    if streams == 0:
        found.append("a 7B replica cannot carry even one stream at stream_tokens_per_s")
    if chat_free_gb < 0:
        found.append(
            f"a 7B replica at capacity needs {-chat_free_gb:.1f} GB more than one GPU"
        )
    if s.model.context_tokens < s.prompt_tokens + s.answer_tokens:
        found.append(
            f"model.context_tokens ({s.model.context_tokens:g}) is less than "
            f"prompt_tokens + answer_tokens ({s.prompt_tokens + s.answer_tokens:g})"
        )
    fitting = [
        o.precision
        for o in options
        if o.cache_gb_at_fleet_gpus >= s.big_model.min_cache_gb
    ]
    if not fitting:
        found.append(
            f"no precision leaves {s.big_model.min_cache_gb:g} GB of cache on "
            f"big.gpus_per_replica = {s.big.gpus_per_replica} GPUs"
        )
    found.extend(
        f"{o.precision}: no split of {s.big_model.attention_heads} heads leaves "
        f"{s.big_model.min_cache_gb:g} GB of cache"
        for o in options
        if o.gpus_per_replica is None
    )
    return tuple(found)


def _tidy(value: Any) -> Any:
    """Return ``value`` with whole floats as ints (30000, not 30000.0) throughout."""
    if isinstance(value, dict):
        return _tidy_dict(value)
    if isinstance(value, list):
        return [_tidy(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _tidy_dict(value: dict[str, Any]) -> dict[str, Any]:
    """``_tidy`` of a dict, typed as one."""
    return {k: _tidy(v) for k, v in value.items()}


def _ceil(value: float) -> int:
    # Round away float dust first, so that a load of exactly 4 replicas that comes
    # out as 4.000000000000001 does not buy a fifth.
    return math.ceil(round(value, 9))


def _floor(value: float) -> int:
    return math.floor(round(value, 9))


def _cents(usd: float) -> float:
    return round(usd, 2)


def _n(value: float) -> str:
    """Return a number as the seed writes it: thousands separated, no float dust."""
    rounded = round(value, 4)
    if rounded == int(rounded):
        return f"{int(rounded):,}"
    return f"{rounded:,.4f}".rstrip("0")

"""The command line that starts one engine replica: ``vllm serve`` or the simulator.

Public surface: ``ReplicaSpec``, ``vllm_serve_argv``, ``sglang_launch_argv``,
``engine_for``, ``ENGINES``, ``SGLANG_FLAG_NAMES``, ``sim_replica_argv``,
``sim_profile_for``, ``sim_quality_for``, ``sim_quality_by_category_for``,
``sim_ttft_factor_for``,
``sim_degraded_for``,
``engine_flag_args``, ``engine_trace_args``, ``engine_trace_env``,
``DEFAULT_QUANTIZATION_4BIT``, ``RESERVED_KEYS``.

A version's ``engine_config`` is a JSON object of vLLM flags spelled with
underscores (``{"max_num_seqs": 256}``). It is turned into argv items, never into a
shell string, so shell metacharacters are inert; what is guarded against is a key or
a value smuggling *another flag* into the argv (``--api-key``, ``--port``):

- keys must match ``^[a-z][a-z0-9_]*$``; ``max_num_seqs`` becomes ``--max-num-seqs``;
- string values must not start with ``-`` and must not contain NUL;
- the flags the platform sets itself (host, port, served model name, model path,
  tensor parallelism = ``gpus_per_replica``, prompt-token details) cannot be set by
  the config (``RESERVED_KEYS``), except to restate the same value.

Value spelling (vLLM's argparse): ``True`` -> bare ``--flag``; ``False`` ->
``--no-flag`` (``argparse.BooleanOptionalAction``, which vLLM uses for its boolean
flags); ints and finite floats -> ``str()``; a list -> the flag once followed by
each item as its own argv item (``--served-model-name a b`` style ``nargs="+"``,
never comma-joined, so an item may itself contain commas); an object (``dict``) ->
one compact JSON argument with sorted keys (``--kv-events-config '{...}'``).
``None`` and empty lists are refused: leave the key out instead.

Precision (the version's identity, not a tunable):

- ``fp16``: ``--dtype float16``; a ``quantization`` key is refused, since the
  weights would then not be what the version says they are.
- ``int8``: the checkpoint is pre-quantized (W8A8, e.g. compressed-tensors or
  SmoothQuant exports) and carries its quantization config, which vLLM reads on its
  own. We pass ``--dtype float16`` for the activations and ``--quantization X`` only
  when ``engine_config`` names ``X``; guessing a method would break checkpoints whose
  config vLLM would have read correctly.
- ``4bit``: ``--dtype float16 --quantization awq`` (AWQ kernels run in float16),
  or the method ``engine_config["quantization"]`` names (``gptq``, ``awq_marlin``...).

CPU offloading of the KV cache (vLLM's second cache tier): ``kv_offloading_size``
(GiB of host memory, the total over tensor-parallel ranks; a number above 0) and
``kv_offloading_backend`` (``"native"``, vLLM's OffloadingConnector to CPU memory
with its LRU policy, the default; or ``"lmcache"``) reach ``vllm serve`` as
``--kv-offloading-size N --kv-offloading-backend X`` and the simulated replica
alike (it models ``native`` and refuses ``lmcache`` at start). vLLM fails to start
with a size of 0 (its CPU offload spec needs ``cpu_bytes_to_use``), so 0 is
refused here: leave the key out for no offloading. The vLLM CPU build parses the
flags but its worker refuses them ("CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs"); ``lmcache`` needs the ``lmcache`` package.

``engine_config["dtype"]`` may replace ``float16`` (``bfloat16`` for checkpoints
trained in bf16). Keys starting with ``sim_`` configure the simulated replica and
never reach vLLM: ``sim_profile`` (its performance profile), ``sim_quality``
(the chance it answers a prompt it can check right, ``--sim-quality``, so a bad
version measurably fails the eval gate), ``sim_quality_by_category`` (a quality per
prompt category, ``{"maths": 0.5}``, ``--sim-quality-by-category``: a precision
that lost one skill) and ``sim_ttft_factor`` (at least 1: its
first tokens reach clients that many times later, ``--sim-ttft-factor``, so a slow
canary measurably trips a TTFT guard) and ``sim_degraded`` (a boolean: every
answer is a short refusal, ``--sim-degraded``, a broken chat template) and
``sim_embedding_random`` (a boolean: an embedding replica's vectors mean
nothing, ``--sim-embedding-random``, so a broken embedding model measurably fails
the eval gate). ``latency_target_ms`` is the platform's own (an embedding
version's load-test latency target) and reaches no engine either.

Tool calls: ``tool_call_parser`` names the engine's parser of the model's tool-call
format (vLLM's ``hermes``, ``llama3_json``, ``mistral``...; SGLang's ``qwen25``,
``llama3``...). For vLLM it brings ``--enable-auto-tool-choice`` with it (the
parser is what ``tool_choice: auto`` needs; ``"enable_auto_tool_choice": false``
in the config leaves it off), for SGLang it is ``--tool-call-parser`` alone, and
the simulated replica gets the same flags as the engine it stands in for. The
gateway serves requests with ``tools`` only to a version that names a parser.

KV-cache events (cache-aware routing): ``"kv_events": true`` is the platform's
way to turn them on. The platform then owns ``kv_events_config`` (setting both is
refused): the engine publishes on ``tcp://*:<spec.kv_events_port>`` (a bind, so
the gateway connects to the replica's host) under the topic
``kv@<replica_id>@<served_model_name>``, with vLLM's JSON for ``vllm serve``,
SGLang (its ``--kv-events-config`` takes the same keys) and the simulated replica
alike. Without ``kv_events`` a ``kv_events_config`` passes through verbatim.

Argv order is deterministic: the fixed platform flags, then the precision flags,
then the remaining config flags sorted by key, then ``spec.extra`` verbatim.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from models_registry.domain.identity import DEFAULT_ENGINE, ENGINES, Precision

__all__ = [
    "DEFAULT_QUANTIZATION_4BIT",
    "DEFAULT_SIM_PROFILE",
    "ENGINES",
    "RESERVED_KEYS",
    "SGLANG_FLAG_NAMES",
    "ReplicaSpec",
    "engine_flag_args",
    "engine_for",
    "engine_trace_args",
    "engine_trace_env",
    "is_kv_events_on",
    "kv_events_config_for",
    "kv_events_url",
    "sglang_launch_argv",
    "sim_degraded_for",
    "sim_profile_for",
    "sim_quality_by_category_for",
    "sim_quality_for",
    "sim_replica_argv",
    "sim_ttft_factor_for",
    "vllm_serve_argv",
]

DEFAULT_QUANTIZATION_4BIT = "awq"
DEFAULT_DTYPE = "float16"
DEFAULT_SIM_PROFILE = "a100-8b"

# Flags the platform owns: the gateway must find the replica at host:port under
# the served name, metering needs prompt-token details, and the GPU count is the
# version's gpus_per_replica.
RESERVED_KEYS = frozenset(
    {
        "model",
        "served_model_name",
        "host",
        "port",
        "uds",
        "api_key",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "enable_prompt_tokens_details",
    }
)
# Reserved keys the config may restate when the value equals the platform's own.
_RESTATABLE = frozenset(
    {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "enable_prompt_tokens_details",
    }
)
# Consumed by the fixed part of the argv (engine, precision and prefix caching).
# ``latency_target_ms`` is the platform's: the latency an embedding version's
# load-test gate measures its capacity at (``control.embedding_gates``).
_CONSUMED_KEYS = frozenset(
    {
        "engine",
        "dtype",
        "quantization",
        "enable_prefix_caching",
        "latency_target_ms",
        "kv_events",
    }
)
_KV_EVENTS = "kv_events"
_KV_EVENTS_CONFIG = "kv_events_config"
# SGLang's flags the platform owns, besides RESERVED_KEYS (spelled as SGLang's
# server_args fields): the model path, tensor parallelism, metrics, the cache report
# that usage's cached_tokens needs, and the file the API key comes from.
_SGLANG_RESERVED = frozenset(
    {
        "model_path",
        "tp_size",
        "enable_metrics",
        "enable_cache_report",
        "config",
        "admin_api_key",
    }
)
# vLLM's names for the limits a version sets, and SGLang's for the same: an SGLang
# version may use either (server_args.py: --context-length, --max-running-requests,
# --chunked-prefill-size, --mem-fraction-static).
SGLANG_FLAG_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "max_model_len": "context_length",
        "max_num_seqs": "max_running_requests",
        "max_num_batched_tokens": "chunked_prefill_size",
        "gpu_memory_utilization": "mem_fraction_static",
    }
)
# SGLang's quantization for pre-quantized W8A8 INT8 checkpoints.
SGLANG_QUANTIZATION_INT8 = "w8a8_int8"
# The flags the simulated replica shares with ``vllm serve``.
_SIM_FLAG_KEYS = (
    "enable_auto_tool_choice",
    "kv_offloading_backend",
    "kv_events_config",
    "kv_offloading_size",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "runner",
    "tool_call_parser",
)
_TOOL_PARSER = "tool_call_parser"
_AUTO_TOOL_CHOICE = "enable_auto_tool_choice"
_OFFLOADING_BACKENDS = ("native", "lmcache")
_SIM_PREFIX = "sim_"

_FLAG_KEY = re.compile(r"^[a-z][a-z0-9_]*\Z")
_PROFILE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
_PRECISIONS = frozenset(p.value for p in Precision)

# (precision, gpus_per_replica) -> simulator profile, for shapes the fleet runs.
_SIM_PROFILES: Mapping[tuple[str, int], str] = MappingProxyType(
    {
        (Precision.FP16.value, 1): "a100-8b",
        (Precision.INT8.value, 2): "h100-70b-int8-tp2",
        (Precision.FP16.value, 4): "h100-70b-tp4",
    }
)


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """Everything needed to start one replica of one version on this node.

    Invariants (checked on construction, ``ValueError`` otherwise): ``precision`` is
    a known precision, ``gpus_per_replica >= 1``, ``1 <= port <= 65535``,
    ``0 <= kv_events_port <= 65535`` (0: no KV events port),
    ``max_model_len`` is None or positive, ``extra`` holds strings without NUL.
    ``engine_config`` is copied into a read-only mapping, so a caller mutating its
    dict afterwards cannot change a spec; it takes no part in ``hash()``.
    ``extra`` is trusted operator input (the node agent's settings), appended
    verbatim after the config flags.
    """

    replica_id: str
    model: str
    version: str
    served_model_name: str
    precision: str
    gpus_per_replica: int
    engine_config: Mapping[str, Any] = field(hash=False)
    weights_dir: str
    host: str
    port: int
    max_model_len: int | None = None
    extra: tuple[str, ...] = ()
    kv_events_port: int = 0

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id must not be empty")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.precision not in _PRECISIONS:
            raise ValueError(
                f"precision {self.precision!r} is not one of {sorted(_PRECISIONS)}"
            )
        if _is_bool(self.gpus_per_replica) or self.gpus_per_replica < 1:
            raise ValueError("gpus_per_replica must be a positive integer")
        if _is_bool(self.port) or not 1 <= self.port <= 65535:
            raise ValueError(f"port {self.port!r} is out of range")
        if _is_bool(self.kv_events_port) or not 0 <= self.kv_events_port <= 65535:
            raise ValueError(f"kv_events_port {self.kv_events_port!r} is out of range")
        if self.max_model_len is not None and (
            _is_bool(self.max_model_len) or self.max_model_len < 1
        ):
            raise ValueError("max_model_len must be a positive integer or None")
        for text in (self.model, self.weights_dir, self.host, self.served_model_name):
            _check_value_text(text, "spec")
        if any(not isinstance(arg, str) or "\0" in arg for arg in self.extra):
            raise ValueError("extra args must be strings without NUL")
        object.__setattr__(self, "extra", tuple(self.extra))
        object.__setattr__(
            self, "engine_config", MappingProxyType(dict(self.engine_config))
        )


def vllm_serve_argv(spec: ReplicaSpec, *, vllm_executable: str = "vllm") -> list[str]:
    """Return the ``vllm serve`` argv for ``spec`` (see the module docstring).

    Raises:
        ValueError: the config sets a reserved flag to another value, names an
            unsafe flag or value, or asks for a quantization its precision forbids.
    """
    if not spec.weights_dir:
        raise ValueError("vllm serve needs a weights_dir")
    if engine_for(spec) != "vllm":
        raise ValueError("this version runs on sglang: use sglang_launch_argv")
    config = dict(spec.engine_config)
    _check_reserved(config, spec)
    _check_offloading(config)
    argv = [
        vllm_executable,
        "serve",
        spec.weights_dir,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--tensor-parallel-size",
        str(spec.gpus_per_replica),
        _prefix_caching_flag(config),
        "--enable-prompt-tokens-details",
        *_precision_args(spec.precision, config),
    ]
    flags = _with_auto_tool_choice(_config_flags(config))
    _merge_max_model_len(flags, spec)
    _merge_kv_events(flags, spec)
    argv.extend(engine_flag_args(flags))
    argv.extend(spec.extra)
    return argv


def is_kv_events_on(engine_config: Mapping[str, Any]) -> bool:
    """Whether a version's ``engine_config`` turns KV-cache events on.

    Raises:
        ValueError: ``kv_events`` is set to something other than a boolean.
    """
    value = engine_config.get(_KV_EVENTS, False)
    if not isinstance(value, bool):
        raise ValueError(f"engine_config['kv_events'] must be a boolean, not {value!r}")
    return value


def kv_events_url(host: str, port: int) -> str:
    """Return where a replica publishes KV events (its engine binds
    ``tcp://*:port``; the gateway connects here)."""
    return f"tcp://{host}:{port}"


def kv_events_config_for(spec: ReplicaSpec) -> dict[str, Any] | None:
    """Return the platform's ``kv_events_config`` for ``spec``, or None when the
    version does not turn ``kv_events`` on.

    Raises:
        ValueError: ``kv_events`` is not a boolean, it is on without a
            ``kv_events_port``, or the config also sets ``kv_events_config``.
    """
    config = spec.engine_config
    if not is_kv_events_on(config):
        return None
    if _KV_EVENTS_CONFIG in config:
        raise ValueError(
            "engine_config may not set 'kv_events_config' with 'kv_events': "
            "the platform chooses the endpoint and topic"
        )
    if spec.kv_events_port == 0:
        raise ValueError("kv_events is on but the replica has no kv_events_port")
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{spec.kv_events_port}",
        "topic": f"kv@{spec.replica_id}@{spec.served_model_name}",
    }


def _merge_kv_events(flags: dict[str, Any], spec: ReplicaSpec) -> None:
    events = kv_events_config_for(spec)
    if events is not None:
        flags[_KV_EVENTS_CONFIG] = events


def _with_auto_tool_choice(flags: dict[str, Any]) -> dict[str, Any]:
    """vLLM's flags with ``enable_auto_tool_choice`` on wherever a tool-call parser
    is named and the config does not say otherwise."""
    if flags.get(_TOOL_PARSER) and _AUTO_TOOL_CHOICE not in flags:
        return {**flags, _AUTO_TOOL_CHOICE: True}
    return flags


def engine_for(spec: ReplicaSpec) -> str:
    """Return the version's engine, ``engine_config["engine"]`` ("vllm" unset).

    Raises:
        ValueError: it names no engine the platform runs.
    """
    engine = spec.engine_config.get("engine", DEFAULT_ENGINE)
    if engine not in ENGINES:
        raise ValueError(
            f"engine_config['engine'] must be one of {list(ENGINES)}, not {engine!r}"
        )
    return str(engine)


def engine_trace_args(engine: str, endpoint: str) -> list[str]:
    """Return the flags that make ``engine`` export its own spans to ``endpoint``
    (an OTLP/HTTP traces URL); none when ``endpoint`` is empty.

    vLLM and the simulated replica (which takes vLLM's flag):
    ``--otlp-traces-endpoint URL``; SGLang: ``--enable-trace --otlp-traces-endpoint
    URL`` (its tracing stays off without the first). Each engine's request span
    is then the child of the gateway's call, whose ``traceparent`` it receives.
    """
    if not endpoint:
        return []
    if engine == "sglang":
        return ["--enable-trace", "--otlp-traces-endpoint", endpoint]
    return ["--otlp-traces-endpoint", endpoint]


def engine_trace_env(engine: str, endpoint: str) -> dict[str, str]:
    """Return the environment that goes with ``engine_trace_args``: OTLP over
    HTTP, as the gateway exports (vLLM's and SGLang's exporters speak gRPC unless
    told otherwise); none for the simulator or an empty ``endpoint``."""
    if not endpoint or engine not in ("vllm", "sglang"):
        return {}
    return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}


def sglang_launch_argv(
    spec: ReplicaSpec, *, python: str = "python", config_file: str | None = None
) -> list[str]:
    """Return the ``python -m sglang.launch_server`` argv for ``spec``.

    The platform's flags first (model path, served name, host, port, ``--tp-size``
    = ``gpus_per_replica``, ``--enable-metrics`` for the beats,
    ``--enable-cache-report`` so usage carries cached tokens), then precision
    (``--dtype float16``; INT8 adds ``--quantization w8a8_int8``, the method for
    pre-quantized W8A8 checkpoints, 4bit ``--quantization awq`` unless the config
    names another), ``--disable-radix-cache`` only when the version turns prefix
    caching off, then the config's own SGLang flags sorted by key, then
    ``spec.extra``. SGLang's boolean flags are ``store_true`` only: True is the bare
    flag, False leaves it out. The API key never enters the argv: ``config_file``
    (``--config``, SGLang's YAML of server arguments, written by the actuator
    with the key) carries it. Guarded as ``vllm_serve_argv`` is.

    Raises:
        ValueError: the version's engine is not sglang, or as ``vllm_serve_argv``.
    """
    if engine_for(spec) != "sglang":
        raise ValueError("sglang_launch_argv needs engine_config['engine'] = 'sglang'")
    if not spec.weights_dir:
        raise ValueError("sglang needs a weights_dir")
    config = dict(spec.engine_config)
    _check_reserved(config, spec)
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        *_sglang_platform_flags(spec, config, spec.weights_dir, config_file),
    ]
    argv.extend(
        _precision_args(
            spec.precision, config, int8_quantization=SGLANG_QUANTIZATION_INT8
        )
    )
    if not _prefix_caching_on(config):
        argv.append("--disable-radix-cache")
    # store_true flags only: False is SGLang's default, so the flag stays out.
    flags = {
        key: value
        for key, value in _sglang_names(_config_flags(config)).items()
        if not (_is_bool(value) and not value) and key != _AUTO_TOOL_CHOICE
    }
    _merge_max_model_len(flags, spec, key="context_length")
    _merge_kv_events(flags, spec)
    argv.extend(engine_flag_args(flags))
    argv.extend(spec.extra)
    return argv


def sim_replica_argv(
    spec: ReplicaSpec,
    *,
    python: str = "python",
    profile: str = DEFAULT_SIM_PROFILE,
    config_file: str | None = None,
) -> list[str]:
    """Return the argv of a simulated replica standing in for ``spec``.

    The simulator takes the engine's own flag names. For a vLLM version, only the
    flags it models are passed (``max_model_len``, ``max_num_batched_tokens``,
    ``max_num_seqs``, ``kv_offloading_size``, ``kv_offloading_backend``, prefix
    caching, ``runner``: ``pooling`` makes an embedding replica). For an SGLang version it runs ``--sim-engine sglang`` with the
    platform's part of ``sglang_launch_argv`` (``--model-path``, ``--tp-size``,
    ``--enable-metrics``, ``--enable-cache-report``, ``--config config_file`` for
    the API key, ``--disable-radix-cache`` when caching is off, ``--context-length``
    from ``max_model_len``): the flags a real SGLang would get. Either way the
    profile comes from ``sim_profile_for(spec, default=profile)``, then
    ``--sim-quality`` and ``--sim-ttft-factor`` when the config sets them
    (``sim_quality_for``, ``sim_ttft_factor_for``). The model is the weights
    directory, or the model name when no weights were pulled.

    Raises:
        ValueError: as ``vllm_serve_argv``, or the profile name is not a slug.
    """
    config = dict(spec.engine_config)
    _check_reserved(config, spec)
    engine = engine_for(spec)
    if engine == "sglang":
        return _sim_sglang_argv(spec, config, python, profile, config_file)
    _check_offloading(config)
    argv = [
        python,
        "-m",
        "simengine",
        "--model",
        spec.weights_dir or spec.model,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        *_sim_flags(spec, profile),
    ]
    argv.extend([_prefix_caching_flag(config), "--enable-prompt-tokens-details"])
    flags = _with_auto_tool_choice(
        {key: config[key] for key in _SIM_FLAG_KEYS if key in config}
    )
    _merge_max_model_len(flags, spec)
    _merge_kv_events(flags, spec)
    argv.extend(engine_flag_args(flags))
    argv.extend(spec.extra)
    return argv


def _sim_sglang_argv(
    spec: ReplicaSpec,
    config: Mapping[str, Any],
    python: str,
    profile: str,
    config_file: str | None,
) -> list[str]:
    argv = [
        python,
        "-m",
        "simengine",
        "--sim-engine",
        "sglang",
        *_sglang_platform_flags(
            spec, config, spec.weights_dir or spec.model, config_file
        ),
    ]
    argv.extend(_sim_flags(spec, profile))
    if not _prefix_caching_on(config):
        argv.append("--disable-radix-cache")
    flags: dict[str, Any] = {}
    named = _sglang_names(_config_flags(config))
    for key in ("context_length", _TOOL_PARSER, _KV_EVENTS_CONFIG):
        if named.get(key) is not None:
            flags[key] = named[key]
    _merge_max_model_len(flags, spec, key="context_length")
    _merge_kv_events(flags, spec)
    argv.extend(engine_flag_args(flags))
    argv.extend(spec.extra)
    return argv


def _sglang_platform_flags(
    spec: ReplicaSpec,
    config: Mapping[str, Any],
    model_path: str,
    config_file: str | None,
) -> list[str]:
    """Return the flags the platform owns on SGLang's command line (real or
    simulated), refusing a config that sets one of them."""
    if clashes := sorted(_SGLANG_RESERVED & config.keys()):
        raise ValueError(
            f"engine_config may not set {clashes[0]!r}: the platform controls it"
        )
    flags = [
        "--model-path",
        model_path,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--tp-size",
        str(spec.gpus_per_replica),
        "--enable-metrics",
        "--enable-cache-report",
    ]
    if config_file is not None:
        _check_value_text(config_file, "config_file")
        flags.extend(["--config", config_file])
    return flags


def _sim_flags(spec: ReplicaSpec, profile: str) -> list[str]:
    """Return the simulator's own flags for ``spec``: profile, quality, TTFT
    factor, degraded."""
    argv = ["--sim-profile", sim_profile_for(spec, default=profile)]
    quality = sim_quality_for(spec)
    if quality is not None:
        argv.extend(["--sim-quality", repr(quality)])
    by_category = sim_quality_by_category_for(spec)
    if by_category:
        argv.extend(["--sim-quality-by-category", json.dumps(by_category)])
    ttft_factor = sim_ttft_factor_for(spec)
    if ttft_factor is not None:
        argv.extend(["--sim-ttft-factor", repr(ttft_factor)])
    if sim_degraded_for(spec):
        argv.append("--sim-degraded")
    if _sim_bool(spec, "sim_embedding_random"):
        argv.append("--sim-embedding-random")
    return argv


def _sim_bool(spec: ReplicaSpec, key: str) -> bool:
    value = spec.engine_config.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key} {value!r} is not a boolean")
    return value


def sim_profile_for(spec: ReplicaSpec, *, default: str = DEFAULT_SIM_PROFILE) -> str:
    """Return the simulator profile for ``spec``.

    ``engine_config["sim_profile"]`` wins; else the (precision, GPUs) table
    (fp16 x1 -> ``a100-8b``, int8 x2 -> ``h100-70b-int8-tp2``, fp16 x4 ->
    ``h100-70b-tp4``); else ``default``.

    Raises:
        ValueError: the chosen name is not a lowercase slug.
    """
    chosen = spec.engine_config.get("sim_profile")
    if chosen is None:
        chosen = _SIM_PROFILES.get((spec.precision, spec.gpus_per_replica), default)
    if not isinstance(chosen, str) or _PROFILE.fullmatch(chosen) is None:
        raise ValueError(f"sim profile {chosen!r} is not a lowercase slug")
    return chosen


def sim_quality_for(spec: ReplicaSpec) -> float | None:
    """Return ``engine_config["sim_quality"]`` as a float, or None when unset.

    Raises:
        ValueError: it is not a number from 0 to 1 (a boolean is no number here).
    """
    value = spec.engine_config.get("sim_quality")
    if value is None:
        return None
    if (
        _is_bool(value)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 <= value <= 1
    ):
        raise ValueError(f"sim quality {value!r} is not a number from 0 to 1")
    return float(value)


# The prompt categories the simulated replica's oracle knows (simengine.domain.oracle).
_SIM_CATEGORIES = frozenset({"reasoning", "maths", "long_output", "general"})


def sim_quality_by_category_for(spec: ReplicaSpec) -> dict[str, float]:
    """Return ``engine_config["sim_quality_by_category"]``, sorted; ``{}`` unset.

    ``{"maths": 0.5}`` makes the simulated replica right on half the maths
    prompts while the other categories keep ``sim_quality``: a quantized
    version that lost its arithmetic only (the precision gate's test).

    Raises:
        ValueError: not an object of categories (reasoning, maths, long_output,
            general) to numbers from 0 to 1.
    """
    value = spec.engine_config.get("sim_quality_by_category")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"sim_quality_by_category {value!r} is not an object")
    chosen: dict[str, float] = {}
    for category in sorted(value):
        quality = value[category]
        if category not in _SIM_CATEGORIES:
            raise ValueError(
                f"sim_quality_by_category names {category!r}, not one of "
                f"{', '.join(sorted(_SIM_CATEGORIES))}"
            )
        if (
            _is_bool(quality)
            or not isinstance(quality, int | float)
            or not math.isfinite(quality)
            or not 0 <= quality <= 1
        ):
            raise ValueError(
                f"sim quality {quality!r} of {category} is not a number from 0 to 1"
            )
        chosen[category] = float(quality)
    return chosen


def sim_ttft_factor_for(spec: ReplicaSpec) -> float | None:
    """Return ``engine_config["sim_ttft_factor"]`` as a float, or None when unset.

    Raises:
        ValueError: it is not a finite number of at least 1 (a boolean is no
            number here); below 1 a first token would come before it was made.
    """
    value = spec.engine_config.get("sim_ttft_factor")
    if value is None:
        return None
    if (
        _is_bool(value)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 1
    ):
        raise ValueError(f"sim TTFT factor {value!r} is not a number of at least 1")
    return float(value)


def sim_degraded_for(spec: ReplicaSpec) -> bool:
    """Return ``engine_config["sim_degraded"]``: the replica answers every prompt
    with a short refusal, as a version with a broken chat template (False unset).

    Raises:
        ValueError: it is set to something other than a boolean.
    """
    value = spec.engine_config.get("sim_degraded", False)
    if not _is_bool(value):
        raise ValueError(f"sim_degraded {value!r} is not a boolean")
    return bool(value)


def engine_flag_args(flags: Mapping[str, Any]) -> list[str]:
    """Return argv items for ``flags``, sorted by key (spelling in the module doc).

    Raises:
        ValueError: a key is not a safe flag name, or a value is None, an empty
            list, a non-finite float, or a string that starts with '-' or has NUL.
    """
    args: list[str] = []
    for key in sorted(flags):
        value = flags[key]
        if not isinstance(key, str) or _FLAG_KEY.fullmatch(key) is None:
            raise ValueError(f"engine_config key {key!r} is not a safe flag name")
        flag = "--" + key.replace("_", "-")
        if _is_bool(value):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list | tuple):
            if not value:
                raise ValueError(f"engine_config[{key!r}] is an empty list")
            args.append(flag)
            args.extend(_scalar_text(key, item) for item in value)
        elif isinstance(value, dict):
            args.extend([flag, _json_text(key, value)])
        else:
            args.extend([flag, _scalar_text(key, value)])
    return args


def _check_reserved(config: Mapping[str, Any], spec: ReplicaSpec) -> None:
    own: dict[str, Any] = {
        "tensor_parallel_size": spec.gpus_per_replica,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "enable_prompt_tokens_details": True,
    }
    for key in sorted(RESERVED_KEYS & config.keys()):
        value = config[key]
        # bool is an int: True must not pass for tensor_parallel_size 1.
        if key in _RESTATABLE and type(value) is type(own[key]) and value == own[key]:
            continue
        raise ValueError(
            f"engine_config may not set {key!r}: the platform controls it"
            + (f" (it is {own[key]!r} here)" if key in own else "")
        )


def _check_offloading(config: Mapping[str, Any]) -> None:
    size = config.get("kv_offloading_size")
    if "kv_offloading_size" in config and (
        _is_bool(size)
        or not isinstance(size, int | float)
        or not math.isfinite(size)
        or size <= 0
    ):
        raise ValueError(
            f"engine_config['kv_offloading_size'] must be a number of GiB above 0, "
            f"not {size!r} (vLLM fails to start with 0: leave the key out for no "
            "CPU offloading)"
        )
    backend = config.get("kv_offloading_backend", "native")
    if backend not in _OFFLOADING_BACKENDS:
        raise ValueError(
            f"engine_config['kv_offloading_backend'] must be one of "
            f"{list(_OFFLOADING_BACKENDS)}, not {backend!r}"
        )


def _config_flags(config: Mapping[str, Any]) -> dict[str, Any]:
    """Return the config's own engine flags: neither the platform's, nor those the
    fixed part of the argv consumed, nor the simulator's."""
    return {
        key: value
        for key, value in config.items()
        if key not in RESERVED_KEYS
        and key not in _CONSUMED_KEYS
        and not key.startswith(_SIM_PREFIX)
    }


def _sglang_names(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``flags`` with the platform's vLLM-named keys under SGLang's names
    (``SGLANG_FLAG_NAMES``), so a version keeps its limits when its engine changes.

    Raises:
        ValueError: a key and its SGLang name both set, to different values.
    """
    renamed = {k: v for k, v in flags.items() if k not in SGLANG_FLAG_NAMES}
    for vllm_key, sglang_key in SGLANG_FLAG_NAMES.items():
        if vllm_key not in flags:
            continue
        value = flags[vllm_key]
        if sglang_key in renamed and renamed[sglang_key] != value:
            raise ValueError(
                f"engine_config[{vllm_key!r}] = {value!r} conflicts with "
                f"engine_config[{sglang_key!r}] = {renamed[sglang_key]!r}"
            )
        renamed[sglang_key] = value
    return renamed


def _prefix_caching_on(config: Mapping[str, Any]) -> bool:
    # On unless the version turns it off: prefix-affinity routing depends on it.
    value = config.get("enable_prefix_caching", True)
    if not _is_bool(value):
        raise ValueError("engine_config['enable_prefix_caching'] must be a boolean")
    return bool(value)


def _prefix_caching_flag(config: Mapping[str, Any]) -> str:
    if _prefix_caching_on(config):
        return "--enable-prefix-caching"
    return "--no-enable-prefix-caching"


def _precision_args(
    precision: str, config: Mapping[str, Any], *, int8_quantization: str | None = None
) -> list[str]:
    dtype = config.get("dtype", DEFAULT_DTYPE)
    args = ["--dtype", _scalar_text("dtype", dtype)]
    quantization = config.get("quantization")
    if precision == Precision.FP16.value:
        if quantization is not None:
            raise ValueError(
                "an fp16 version takes no 'quantization'; register the quantized "
                "weights as an int8 or 4bit version"
            )
    elif precision == Precision.INT8.value:
        # Pre-quantized W8A8: the checkpoint's own quantization config decides
        # (vLLM) unless the version names a method; SGLang must be told
        # (``int8_quantization``).
        method = int8_quantization if quantization is None else quantization
        if method is not None:
            args.extend(["--quantization", _scalar_text("quantization", method)])
    else:
        method = DEFAULT_QUANTIZATION_4BIT if quantization is None else quantization
        args.extend(["--quantization", _scalar_text("quantization", method)])
    return args


def _merge_max_model_len(
    flags: dict[str, Any], spec: ReplicaSpec, *, key: str = "max_model_len"
) -> None:
    """Put ``spec.max_model_len`` under the engine's ``key`` (SGLang:
    ``context_length``), refusing a config that sets another."""
    if spec.max_model_len is None:
        return
    configured = flags.get(key)
    if configured is not None and configured != spec.max_model_len:
        raise ValueError(
            f"max_model_len {spec.max_model_len} conflicts with "
            f"engine_config[{key!r}] = {configured!r}"
        )
    flags[key] = spec.max_model_len


def _scalar_text(key: str, value: Any) -> str:
    if _is_bool(value):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"engine_config[{key!r}] must be finite")
        return repr(value)
    if isinstance(value, str):
        _check_value_text(value, f"engine_config[{key!r}]")
        return value
    raise ValueError(
        f"engine_config[{key!r}] = {value!r} is not a string, number or boolean"
    )


def _json_text(key: str, value: Mapping[str, Any]) -> str:
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"engine_config[{key!r}] is not plain JSON: {exc}") from None
    return text


def _check_value_text(text: str, where: str) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{where}: {text!r} is not a string")
    if text.startswith("-"):
        raise ValueError(f"{where}: {text!r} starts with '-' and could pose as a flag")
    if "\0" in text:
        raise ValueError(f"{where}: value contains NUL")


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)

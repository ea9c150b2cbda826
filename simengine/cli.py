"""Command line of the simulated replica; flag names follow ``vllm serve``.

With ``--sim-engine sglang`` the replica stands in for ``python -m
sglang.launch_server`` and takes the flags the platform gives SGLang
(``engine_nodes.domain.replica_argv.sglang_launch_argv``): ``--model-path`` (for
``--model``), ``--context-length`` (for ``--max-model-len``),
``--disable-radix-cache`` (prefix caching off), ``--enable-metrics`` (``/metrics``
is served only with it, as SGLang's), ``--enable-cache-report`` (usage carries
cached tokens), ``--tp-size``, ``--dtype`` and ``--quantization`` (accepted; the
profile already models the GPUs and precision), and ``--config FILE``: SGLang's
file of server arguments (``server_args_config_parser.py``), YAML or JSON by
suffix, keys being flag names with dashes or underscores. Its arguments go before
the command line's, so the command line wins, as in SGLang; the platform writes
the API key there (``{"api-key": ...}``), out of the process list. These flags are
refused without ``--sim-engine sglang``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from simengine.domain.embedding_perf import embedding_profile_for
from simengine.domain.perf import DEFAULT_PROFILE, PROFILES
from simengine.kv_publisher import KVEventsConfig, parse_kv_events_config
from simengine.replica import (
    ENGINES,
    Faults,
    SimOptions,
    check_offloading_backend,
    check_quality,
    check_quality_by_category,
    check_ttft_factor,
)
from simengine.server import build_app

# The step-time constants a flag may replace, as the research spec's command line
# names them (simengine.domain.perf.PerfProfile field -> flag).
PROFILE_FLAGS = {
    "a_ms": "--sim-a-ms",
    "w_ms": "--sim-w-ms",
    "ctok_ms": "--sim-ctok-ms",
    "b_ms": "--sim-b-ms",
    "kkv_us": "--sim-kkv-us",
    "katt": "--sim-katt",
    "p_ms": "--sim-p-ms",
    "h_ms": "--sim-h-ms",
}


_NO_FAULTS = Faults()
# SGLang's flags (dest -> default): refused unless --sim-engine sglang.
SGLANG_ONLY = {
    "model_path": None,
    "tp_size": None,
    "enable_metrics": False,
    "enable_cache_report": False,
    "dtype": None,
    "quantization": None,
    "disable_radix_cache": False,
    "context_length": None,
    "config": None,
}


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (shared by ``manage.py sim_replica``)."""
    parser = argparse.ArgumentParser(
        prog="python -m simengine",
        description="A simulated vLLM (or, with --sim-engine sglang, SGLang) replica: "
        "the engine's HTTP surface on a performance model.",
    )
    add = parser.add_argument
    add(
        "--sim-engine",
        choices=ENGINES,
        default="vllm",
        help="Whose surface to present: vLLM's (block cache, vllm: metrics) or "
        "SGLang's (radix cache, sglang: metrics, SGLang's flags).",
    )
    add(
        "--model",
        default=None,
        help="Model path or name (shown as root in /v1/models); required.",
    )
    sglang = parser.add_argument_group("SGLang's flags (--sim-engine sglang)")
    sglang.add_argument("--model-path", default=None, help="SGLang's --model.")
    sglang.add_argument("--tp-size", type=int, default=None)
    sglang.add_argument("--enable-metrics", action="store_true")
    sglang.add_argument("--enable-cache-report", action="store_true")
    sglang.add_argument("--dtype", default=None)
    sglang.add_argument("--quantization", default=None)
    sglang.add_argument("--disable-radix-cache", action="store_true")
    sglang.add_argument("--context-length", type=int, default=None)
    sglang.add_argument(
        "--config",
        default=None,
        help="SGLang's YAML (or JSON) file of server arguments, e.g. the API key.",
    )
    add(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Names clients use; defaults to --model.",
    )
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--max-model-len", type=int, default=8192)
    add("--max-num-seqs", type=int, default=None)
    add("--max-num-batched-tokens", type=int, default=None)
    add("--num-gpu-blocks-override", type=int, default=None)
    add("--block-size", type=int, default=16)
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add(
        "--kv-offloading-size",
        type=_offloading_size,
        default=None,
        help="GiB of host memory for the CPU offload tier of the KV cache (vLLM's "
        "native OffloadingConnector, LRU); the total over tensor-parallel ranks. "
        "Unset: no offloading.",
    )
    add(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help="vLLM's (and SGLang's) KV-cache events as JSON, e.g. "
        '\'{"enable_kv_cache_events":true,"publisher":"zmq",'
        '"endpoint":"tcp://*:5557","topic":"kv@r1@m"}\': a ZMQ PUB socket that '
        "binds a wildcard endpoint and connects to any other.",
    )
    add(
        "--kv-offloading-backend",
        choices=["native", "lmcache"],
        default="native",
        help="Only native is simulated; lmcache is refused (its KV lives in a "
        "separate LMCache server).",
    )
    add("--enable-prompt-tokens-details", action="store_true")
    add("--enable-force-include-usage", action="store_true")
    add("--enable-request-id-headers", action="store_true")
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Serve tool_choice "auto" (needs --tool-call-parser), as vLLM.',
    )
    add(
        "--tool-call-parser",
        default=None,
        help="The tool-call parser's name (any name; the sim parses its own output).",
    )
    add(
        "--max-num-queued-reqs",
        type=int,
        default=0,
        help="Reject with 503 past this many waiting+running requests (0: never).",
    )
    add(
        "--runner",
        choices=["auto", "generate", "pooling"],
        default="auto",
        help="vLLM's --runner: pooling serves /v1/embeddings and no generation "
        "(simengine.embeddings); auto is generate.",
    )
    add(
        "--sim-embedding-dim",
        type=int,
        default=384,
        help="Length of the vectors /v1/embeddings answers (--runner pooling).",
    )
    add(
        "--sim-embedding-random",
        action="store_true",
        help="Answer /v1/embeddings with vectors as meaningless as noise (a broken "
        "embedding model) instead of a hashed bag of the input's tokens.",
    )
    add(
        "--sim-profile",
        choices=sorted(PROFILES),
        default=None,
        help="Performance profile (simengine.domain.perf; default a100-8b). With "
        "--runner pooling it also names the embedding batcher's device "
        "(simengine.domain.embedding_perf; default: cpu-minilm, the measured one).",
    )
    for name, flag in PROFILE_FLAGS.items():
        add(
            flag,
            dest=f"sim_{name}",
            type=float,
            default=None,
            help=f"Replace the profile's {name} (simengine.domain.perf).",
        )
    add("--sim-jitter-cv", type=float, default=0.04)
    add(
        "--sim-frontend-ms",
        type=float,
        default=None,
        help="Frontend time before the engine sees a request (default: the "
        "profile's frontend_ms).",
    )
    add(
        "--sim-output-len",
        choices=["lognormal", "max"],
        default="lognormal",
        help="max: always generate max_tokens; lognormal: sample a length (ignore_eos "
        "in the request forces max).",
    )
    add("--sim-output-mean", type=float, default=250.0)
    add("--sim-output-cv", type=float, default=0.6)
    add("--sim-seed", type=int, default=0)
    add(
        "--api-key",
        nargs="+",
        default=None,
        help="Keys /v1 demands as 'Authorization: Bearer' (vLLM's flag); defaults "
        "to VLLM_API_KEY, which keeps the key out of the process list.",
    )
    add(
        "--sim-admin-token",
        default=None,
        help="Bearer token for /sim/faults and /sim/state; defaults to "
        "SIM_ADMIN_TOKEN (out of the process list). Unset: they are open.",
    )
    add("--sim-crash-after-tokens", type=int, default=None)
    add("--sim-stall", action="store_true")
    add("--sim-fail-next", type=int, default=0)
    add("--sim-fail-rate", type=float, default=0.0)
    add(
        "--sim-startup-s",
        type=float,
        default=0.0,
        help="Answer 503 on /health and requests for this long (slow start).",
    )
    add(
        "--sim-degraded",
        action="store_true",
        help="Answer every prompt with a refusal, once, then stop (a broken chat "
        "template); with ignore_eos it repeats to max_tokens.",
    )
    add(
        "--sim-quality",
        type=_quality,
        default=1.0,
        help="Chance (0 to 1) that a prompt the oracle recognises is answered right "
        "(simengine.domain.oracle); also settable on /sim/faults.",
    )
    add(
        "--sim-quality-by-category",
        type=_quality_by_category,
        default={},
        help="JSON object of a quality per prompt category ('{\"maths\": 0.5}'); "
        "the other categories keep --sim-quality.",
    )
    add(
        "--sim-ttft-factor",
        type=_ttft_factor,
        default=1.0,
        help="Deliver each answer's first token at this multiple (at least 1) of "
        "its natural time to first token; the engine's pace is unchanged. Also "
        "settable on /sim/faults (ttft_factor).",
    )
    add(
        "--otlp-traces-endpoint",
        default=None,
        help="vLLM's flag: export a span per chat request (llm_request) to this "
        "OTLP/HTTP traces URL, parented by the request's traceparent.",
    )
    add("--log-level", default="warning")
    return parser


def config_file_args(path: str) -> list[str]:
    """Return the flags SGLang's ``--config`` file ``path`` stands for.

    A YAML mapping of server-argument names (dashes or underscores) to values:
    True is the bare flag, False leaves it out, a list gives its items. As SGLang
    0.5.23, only a ``.yaml`` or ``.yml`` file is taken (its parser refuses
    ``.json``: "Config file must be YAML format").

    Raises:
        ValueError: the file is not YAML by name, unreadable, or not a mapping.
    """
    file = Path(path)
    if file.suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"Config file must be YAML format, got: {file.suffix}")
    try:
        text = file.read_text()
        data: Any = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read --config {path}: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of server arguments")
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            argv.extend([flag, *(str(item) for item in value)])
        elif value is not None:
            argv.extend([flag, str(value)])
    return argv


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse ``argv`` with ``--config``'s arguments before it (the command line
    wins); refuse SGLang's flags without ``--sim-engine sglang`` and a missing
    model."""
    given = list(argv) if argv is not None else None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(given)
    if known.config is not None:
        try:
            from_file = config_file_args(known.config)
        except ValueError as exc:
            parser.error(str(exc))
        import sys

        given = from_file + (given if given is not None else sys.argv[1:])
    args = parser.parse_args(given)
    if args.sim_engine != "sglang":
        used = [
            "--" + dest.replace("_", "-")
            for dest, default in SGLANG_ONLY.items()
            if getattr(args, dest) != default
        ]
        if used:
            parser.error(f"{', '.join(used)}: SGLang's flags need --sim-engine sglang")
    elif args.model is not None and args.model_path is not None:
        parser.error("give --model-path or --model, not both")
    if args.model is None and args.model_path is None:
        parser.error("--model (SGLang: --model-path) is required")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        # vLLM's validate_parsed_serve_args, word for word.
        parser.error("Error: --enable-auto-tool-choice requires --tool-call-parser")
    return args


def options_from_args(args: argparse.Namespace) -> tuple[SimOptions, Faults]:
    """Turn parsed flags into the server's options and initial faults."""
    model = args.model if args.model is not None else args.model_path
    names = args.served_model_name or [model]
    is_sglang = args.sim_engine == "sglang"
    max_model_len = args.max_model_len
    enable_prefix_caching = args.enable_prefix_caching
    if is_sglang:
        if args.context_length is not None:
            max_model_len = args.context_length
        enable_prefix_caching = enable_prefix_caching and not args.disable_radix_cache
    options = SimOptions(
        model=model,
        served_model_names=list(names),
        profile=args.sim_profile or DEFAULT_PROFILE.name,
        embedding_profile=embedding_profile_for(args.sim_profile).name,
        profile_overrides={
            name: value
            for name in PROFILE_FLAGS
            if (value := getattr(args, f"sim_{name}")) is not None
        },
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=args.num_gpu_blocks_override,
        block_size=args.block_size,
        enable_prefix_caching=enable_prefix_caching,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        kv_events=args.kv_events_config,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        enable_dev_mode=bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0") or "0")),
        enable_responses_store=bool(
            int(os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0") or "0")
        ),
        max_num_queued_reqs=args.max_num_queued_reqs,
        jitter_cv=args.sim_jitter_cv,
        frontend_ms=args.sim_frontend_ms,
        output_len_policy=args.sim_output_len,
        output_len_mean=args.sim_output_mean,
        output_len_cv=args.sim_output_cv,
        seed=args.sim_seed,
        admin_token=args.sim_admin_token or os.environ.get("SIM_ADMIN_TOKEN") or None,
        # vLLM: the flag's keys, else VLLM_API_KEY; empty keys open nothing.
        api_keys=tuple(
            key for key in (args.api_key or [os.environ.get("VLLM_API_KEY", "")]) if key
        ),
        engine=args.sim_engine,
        enable_cache_report=is_sglang and args.enable_cache_report,
        enable_metrics=not is_sglang or args.enable_metrics,
        runner="pooling" if args.runner == "pooling" else "generate",
        embedding_dim=args.sim_embedding_dim,
        is_embedding_random=args.sim_embedding_random,
    )
    faults = Faults(
        crash_after_tokens=args.sim_crash_after_tokens,
        stall=args.sim_stall,
        fail_next=args.sim_fail_next,
        fail_rate=args.sim_fail_rate,
        ready_in_s=args.sim_startup_s,
        degraded=args.sim_degraded,
        quality=args.sim_quality,
        ttft_factor=args.sim_ttft_factor,
        quality_by_category=args.sim_quality_by_category,
    )
    return options, faults


def _quality_by_category(text: str) -> dict[str, float]:
    try:
        return check_quality_by_category(json.loads(text))
    except ValueError as exc:  # JSONDecodeError is one
        raise argparse.ArgumentTypeError(str(exc)) from None


def _quality(text: str) -> float:
    try:
        return check_quality(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _offloading_size(text: str) -> float:
    # vLLM takes a float; 0 makes its CPU offload spec fail at start
    # ("cpu_bytes_to_use must be specified"), so it is refused here.
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"--kv-offloading-size must be above 0 GiB, not {text}; leave it out "
            "to turn offloading off"
        )
    return value


def _ttft_factor(text: str) -> float:
    try:
        return check_ttft_factor(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags and serve until interrupted."""
    import uvicorn

    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        check_offloading_backend(args.kv_offloading_backend)
    except ValueError as exc:
        parser.error(str(exc))
    options, faults = options_from_args(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    tracer = None
    if args.otlp_traces_endpoint:
        from simengine.traces import build_engine_tracer

        tracer = build_engine_tracer(args.otlp_traces_endpoint, model=options.model)
    app = build_app(options, faults=faults, tracer=tracer)
    logging.getLogger("simengine").warning(
        "simulated %s replica %s (profile %s) on %s:%d; faults %s; /v1 %s; /sim %s",
        options.engine,
        ",".join(options.served_model_names),
        options.profile,
        args.host,
        args.port,
        json.dumps(
            {k: v for k, v in asdict(faults).items() if v != getattr(_NO_FAULTS, k)}
        ),
        "needs an engine key" if options.api_keys else "is open (no engine key)",
        "needs the admin token" if options.admin_token else "is open",
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        # vLLM's server keeps idle connections 5 s; clients pool against that.
        timeout_keep_alive=5,
    )

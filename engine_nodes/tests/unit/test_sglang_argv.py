"""SGLang's launch command for a version whose ``engine_config["engine"]`` is sglang
(issue 22; flag names from SGLang's server_args.py)."""

from __future__ import annotations

from typing import Any

import pytest

from engine_nodes.domain.replica_argv import (
    ReplicaSpec,
    engine_for,
    engine_trace_args,
    engine_trace_env,
    sglang_launch_argv,
    sim_replica_argv,
    vllm_serve_argv,
)


def make_spec(
    engine_config: dict[str, Any],
    *,
    precision: str = "fp16",
    gpus: int = 1,
    max_model_len: int | None = None,
) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id="chat-7b-v4-local-0",
        model="chat-7b",
        version="v4",
        served_model_name="chat-7b@v4",
        precision=precision,
        gpus_per_replica=gpus,
        engine_config=engine_config,
        weights_dir="/weights/chat-7b",
        host="127.0.0.1",
        port=8102,
        max_model_len=max_model_len,
    )


def test_the_7b_fp16_on_one_gpu() -> None:
    argv = sglang_launch_argv(make_spec({"engine": "sglang"}), python="/py")
    assert argv == [
        "/py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/weights/chat-7b",
        "--served-model-name",
        "chat-7b@v4",
        "--host",
        "127.0.0.1",
        "--port",
        "8102",
        "--tp-size",
        "1",
        "--enable-metrics",
        "--enable-cache-report",
        "--dtype",
        "float16",
    ]
    # The radix cache is SGLang's default: nothing turns it off.
    assert "--disable-radix-cache" not in argv


def test_the_70b_int8_on_two_gpus_is_w8a8() -> None:
    spec = make_spec(
        {"engine": "sglang", "mem_fraction_static": 0.85},
        precision="int8",
        gpus=2,
        max_model_len=8192,
    )
    argv = sglang_launch_argv(spec, config_file="/run/keys/chat.yaml")
    assert argv[argv.index("--tp-size") + 1] == "2"
    assert argv[argv.index("--quantization") + 1] == "w8a8_int8"
    assert argv[argv.index("--context-length") + 1] == "8192"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.85"
    assert argv[argv.index("--config") + 1] == "/run/keys/chat.yaml"
    assert not any("key" in item for item in argv if not item.endswith(".yaml"))


def test_4bit_defaults_to_awq_and_a_named_method_wins() -> None:
    assert "awq" in sglang_launch_argv(
        make_spec({"engine": "sglang"}, precision="4bit")
    )
    argv = sglang_launch_argv(
        make_spec({"engine": "sglang", "quantization": "gptq"}, precision="4bit")
    )
    assert argv[argv.index("--quantization") + 1] == "gptq"


def test_booleans_are_store_true_and_prefix_caching_off_disables_the_radix_cache() -> (
    None
):
    argv = sglang_launch_argv(
        make_spec(
            {
                "engine": "sglang",
                "enable_prefix_caching": False,
                "trust_remote_code": True,
                "disable_overlap_schedule": False,
            }
        )
    )
    assert "--disable-radix-cache" in argv
    assert "--trust-remote-code" in argv
    # store_true flags have no --no-X form: False leaves the flag out.
    assert not any(item.startswith("--no-") for item in argv)
    assert "--disable-overlap-schedule" not in argv


@pytest.mark.parametrize(
    "config",
    [
        {"engine": "sglang", "api_key": "k"},
        {"engine": "sglang", "port": 1},
        {"engine": "sglang", "model_path": "/other"},
        {"engine": "sglang", "tp_size": 4},
        {"engine": "sglang", "enable_metrics": False},
        {"engine": "sglang", "config": "/tmp/x.yaml"},
        {"engine": "sglang", "chunked_prefill_size": "--api-key=x"},
        {"engine": "sglang", "bad-key": 1},
        {"engine": "sglang", "quantization": "awq"},  # fp16 takes none
    ],
)
def test_the_platforms_flags_and_injections_are_refused(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        sglang_launch_argv(make_spec(config))


def test_the_engine_chooses_the_builder() -> None:
    assert engine_for(make_spec({})) == "vllm"
    assert engine_for(make_spec({"engine": "sglang"})) == "sglang"
    with pytest.raises(ValueError, match="must be one of"):
        engine_for(make_spec({"engine": "tgi"}))
    with pytest.raises(ValueError, match="sglang"):
        vllm_serve_argv(make_spec({"engine": "sglang"}))
    with pytest.raises(ValueError, match="needs engine_config"):
        sglang_launch_argv(make_spec({}))
    # The key never reaches vLLM or the simulator as a flag.
    assert "--engine" not in vllm_serve_argv(make_spec({"engine": "vllm"}))
    assert "--engine" not in sim_replica_argv(make_spec({"engine": "sglang"}))


def test_a_simulated_sglang_replica_gets_the_flags_a_real_one_would() -> None:
    """The simulator stands in for SGLang with SGLang's own platform flags, so the
    end-to-end test runs the command line production would."""
    spec = make_spec(
        {"engine": "sglang", "enable_prefix_caching": False, "sim_quality": 0.9},
        precision="int8",
        gpus=2,
        max_model_len=4096,
    )
    argv = sim_replica_argv(
        spec, python="/py", profile="h100-70b-int8-tp2", config_file="/run/k.json"
    )
    assert argv == [
        "/py",
        "-m",
        "simengine",
        "--sim-engine",
        "sglang",
        "--model-path",
        "/weights/chat-7b",
        "--served-model-name",
        "chat-7b@v4",
        "--host",
        "127.0.0.1",
        "--port",
        "8102",
        "--tp-size",
        "2",
        "--enable-metrics",
        "--enable-cache-report",
        "--config",
        "/run/k.json",
        "--sim-profile",
        "h100-70b-int8-tp2",
        "--sim-quality",
        "0.9",
        "--disable-radix-cache",
        "--context-length",
        "4096",
    ]
    real = sglang_launch_argv(spec, python="/py", config_file="/run/k.json")
    platform_part = real[3 : real.index("--config") + 2]
    assert argv[5 : 5 + len(platform_part)] == platform_part
    # A vLLM version's simulator never sees SGLang's flags, and the reverse.
    vllm_sim = sim_replica_argv(make_spec({}), python="/py")
    assert "--sim-engine" not in vllm_sim and "--model" in vllm_sim
    with pytest.raises(ValueError, match="platform controls it"):
        sim_replica_argv(make_spec({"engine": "sglang", "tp_size": 4}))


def test_a_version_s_vllm_named_limits_reach_sglang_under_sglang_s_names() -> None:
    """GIVEN the 70B INT8 example's engine config (vLLM's names) with engine sglang
    THEN SGLang gets --context-length, --max-running-requests,
    --chunked-prefill-size and --mem-fraction-static, never a vLLM flag it would
    refuse; a key and its SGLang name set to different values are refused."""
    config = {
        "engine": "sglang",
        "tensor_parallel_size": 2,
        "max_num_seqs": 64,
        "max_model_len": 32768,
        "max_num_batched_tokens": 8192,
        "gpu_memory_utilization": 0.85,
        "enable_prefix_caching": True,
    }
    argv = sglang_launch_argv(
        make_spec(config, precision="int8", gpus=2, max_model_len=32768)
    )
    tail = argv[argv.index("w8a8_int8") + 1 :]
    assert tail == [
        "--chunked-prefill-size",
        "8192",
        "--context-length",
        "32768",
        "--max-running-requests",
        "64",
        "--mem-fraction-static",
        "0.85",
    ]
    assert not {"--max-model-len", "--max-num-seqs", "--tensor-parallel-size"} & set(
        argv
    )
    same = {**config, "max_running_requests": 64}
    assert sglang_launch_argv(make_spec(same, precision="int8", gpus=2)) == (
        sglang_launch_argv(make_spec(config, precision="int8", gpus=2))
    )
    with pytest.raises(ValueError, match="conflicts"):
        sglang_launch_argv(
            make_spec({**config, "max_running_requests": 32}, precision="int8", gpus=2)
        )


@pytest.mark.parametrize(
    ("engine", "flags"),
    [
        ("vllm", ["--otlp-traces-endpoint", "http://c:4318/v1/traces"]),
        ("sim", ["--otlp-traces-endpoint", "http://c:4318/v1/traces"]),
        (
            "sglang",
            ["--enable-trace", "--otlp-traces-endpoint", "http://c:4318/v1/traces"],
        ),
    ],
)
def test_each_engine_gets_its_own_tracing_flags(engine: str, flags: list[str]) -> None:
    url = "http://c:4318/v1/traces"
    assert engine_trace_args(engine, url) == flags
    assert engine_trace_args(engine, "") == []
    http = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert engine_trace_env(engine, url) == ({} if engine == "sim" else http)
    assert engine_trace_env(engine, "") == {}

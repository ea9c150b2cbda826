"""Tests for the replica command lines: exact argv for vLLM and the simulator."""

from __future__ import annotations

from typing import Any

import pytest

from engine_nodes.domain.replica_argv import (
    ReplicaSpec,
    engine_flag_args,
    sim_profile_for,
    sim_quality_by_category_for,
    sim_quality_for,
    sim_replica_argv,
    sim_ttft_factor_for,
    vllm_serve_argv,
)
from simengine.cli import build_parser, options_from_args
from simengine.domain.perf import PROFILES
from simengine.surface_capture import SURFACE_ENGINE_CONFIG

WEIGHTS = "/var/lib/platform/weights/" + "a" * 64


def make_spec(**overrides: Any) -> ReplicaSpec:
    fields: dict[str, Any] = {
        "replica_id": "chat-7b-v3-local-0",
        "model": "chat-7b",
        "version": "v3",
        "served_model_name": "chat-7b@v3",
        "precision": "fp16",
        "gpus_per_replica": 1,
        "engine_config": {},
        "weights_dir": WEIGHTS,
        "host": "127.0.0.1",
        "port": 8101,
    }
    fields.update(overrides)
    return ReplicaSpec(**fields)


def test_vllm_serve_argv_fp16_7b_on_one_gpu() -> None:
    spec = make_spec(
        engine_config={"max_num_seqs": 256, "enable_prefix_caching": True},
    )
    assert vllm_serve_argv(spec) == [
        "vllm",
        "serve",
        WEIGHTS,
        "--served-model-name",
        "chat-7b@v3",
        "--host",
        "127.0.0.1",
        "--port",
        "8101",
        "--tensor-parallel-size",
        "1",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--dtype",
        "float16",
        "--max-num-seqs",
        "256",
    ]


def test_vllm_serve_argv_int8_70b_on_tp2_relies_on_checkpoint_quantization() -> None:
    spec = make_spec(
        model="chat-70b",
        served_model_name="chat-70b@v1",
        precision="int8",
        gpus_per_replica=2,
        engine_config={
            "tensor_parallel_size": 2,
            "gpu_memory_utilization": 0.92,
            "max_num_batched_tokens": 8192,
        },
        max_model_len=32768,
        host="0.0.0.0",
        port=8000,
    )
    assert vllm_serve_argv(spec, vllm_executable="/opt/vllm/bin/vllm") == [
        "/opt/vllm/bin/vllm",
        "serve",
        WEIGHTS,
        "--served-model-name",
        "chat-70b@v1",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "2",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--dtype",
        "float16",
        "--gpu-memory-utilization",
        "0.92",
        "--max-model-len",
        "32768",
        "--max-num-batched-tokens",
        "8192",
    ]


def test_vllm_serve_argv_int8_passes_quantization_only_when_named() -> None:
    spec = make_spec(precision="int8", engine_config={"quantization": "experts_int8"})
    argv = vllm_serve_argv(spec)
    assert argv[13:] == [
        "--dtype",
        "float16",
        "--quantization",
        "experts_int8",
    ]


def test_vllm_serve_argv_4bit_defaults_to_awq() -> None:
    spec = make_spec(precision="4bit", engine_config={"max_num_seqs": 128})
    assert vllm_serve_argv(spec) == [
        "vllm",
        "serve",
        WEIGHTS,
        "--served-model-name",
        "chat-7b@v3",
        "--host",
        "127.0.0.1",
        "--port",
        "8101",
        "--tensor-parallel-size",
        "1",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--dtype",
        "float16",
        "--quantization",
        "awq",
        "--max-num-seqs",
        "128",
    ]


def test_vllm_serve_argv_4bit_takes_the_configured_method() -> None:
    spec = make_spec(precision="4bit", engine_config={"quantization": "gptq"})
    assert vllm_serve_argv(spec)[13:] == [
        "--dtype",
        "float16",
        "--quantization",
        "gptq",
    ]


def test_vllm_serve_argv_dtype_override() -> None:
    spec = make_spec(engine_config={"dtype": "bfloat16"})
    assert vllm_serve_argv(spec)[13:] == ["--dtype", "bfloat16"]


def test_vllm_serve_argv_fp16_refuses_quantization() -> None:
    with pytest.raises(ValueError, match="fp16 version takes no 'quantization'"):
        vllm_serve_argv(make_spec(engine_config={"quantization": "fp8"}))


def test_vllm_serve_argv_false_becomes_no_flag() -> None:
    spec = make_spec(
        engine_config={"enable_prefix_caching": False, "enable_chunked_prefill": False}
    )
    argv = vllm_serve_argv(spec)
    assert argv[11] == "--no-enable-prefix-caching"
    assert "--enable-prefix-caching" not in argv
    assert argv[-1] == "--no-enable-chunked-prefill"


def test_vllm_serve_argv_sorts_config_flags_and_appends_extra() -> None:
    spec = make_spec(
        engine_config={
            "max_num_seqs": 64,
            "enforce_eager": True,
            "kv_cache_dtype": "fp8",
            "block_size": 16,
        },
        extra=("--kv-cache-memory-bytes", "67108864"),
    )
    assert vllm_serve_argv(spec)[15:] == [
        "--block-size",
        "16",
        "--enforce-eager",
        "--kv-cache-dtype",
        "fp8",
        "--max-num-seqs",
        "64",
        "--kv-cache-memory-bytes",
        "67108864",
    ]


def test_vllm_serve_argv_spells_the_tool_and_structured_output_flags() -> None:
    """The flags the real-vLLM surface capture runs with (tool calls, compact JSON
    under a grammar) come out of a version's engine_config as vLLM reads them."""
    spec = make_spec(engine_config=dict(SURFACE_ENGINE_CONFIG))
    assert vllm_serve_argv(spec)[15:] == [
        "--enable-auto-tool-choice",
        "--structured-outputs-config",
        '{"backend":"xgrammar","disable_any_whitespace":true}',
        "--tool-call-parser",
        "hermes",
    ]


def test_vllm_serve_argv_never_passes_sim_keys() -> None:
    spec = make_spec(engine_config={"sim_profile": "h100-8b", "sim_jitter_cv": 0.0})
    assert not any(arg.startswith("--sim") for arg in vllm_serve_argv(spec))


def test_vllm_serve_argv_is_independent_of_config_key_order() -> None:
    one = make_spec(engine_config={"max_num_seqs": 8, "block_size": 16})
    two = make_spec(engine_config={"block_size": 16, "max_num_seqs": 8})
    assert vllm_serve_argv(one) == vllm_serve_argv(two)


@pytest.mark.parametrize(
    "config",
    [
        {"host": "0.0.0.0"},
        {"port": 9000},
        {"served_model_name": "other"},
        {"model": "/elsewhere"},
        {"api_key": "sk-123"},
        {"tensor_parallel_size": 2},
        {"tensor_parallel_size": True},
        {"pipeline_parallel_size": 2},
        {"enable_prompt_tokens_details": False},
    ],
)
def test_vllm_serve_argv_rejects_platform_controlled_keys(
    config: dict[str, object],
) -> None:
    with pytest.raises(ValueError, match="the platform controls it"):
        vllm_serve_argv(make_spec(engine_config=config))


def test_vllm_serve_argv_accepts_restated_tensor_parallel_size() -> None:
    spec = make_spec(gpus_per_replica=4, engine_config={"tensor_parallel_size": 4})
    assert vllm_serve_argv(spec).count("--tensor-parallel-size") == 1


@pytest.mark.parametrize(
    "key",
    [
        "max_num_seqs; rm -rf /",
        "max-num-seqs",
        "Max_num_seqs",
        "_private",
        "9lives",
        "max_num_seqs\n",
        "",
    ],
)
def test_vllm_serve_argv_rejects_unsafe_keys(key: str) -> None:
    with pytest.raises(ValueError, match="not a safe flag name"):
        vllm_serve_argv(make_spec(engine_config={key: 1}))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"kv_cache_dtype": "--api-key"}, "could pose as a flag"),
        ({"kv_cache_dtype": "-x"}, "could pose as a flag"),
        ({"served_model_alias": ["ok", "--port"]}, "could pose as a flag"),
        ({"quantization": "-awq"}, "could pose as a flag"),
        ({"kv_cache_dtype": "fp8\0--api-key"}, "NUL"),
        ({"max_num_seqs": None}, "not a string, number or boolean"),
        ({"max_num_seqs": []}, "empty list"),
        ({"gpu_memory_utilization": float("nan")}, "finite"),
        ({"kv_events_config": {"x": float("inf")}}, "not plain JSON"),
        ({"enable_prefix_caching": "yes"}, "must be a boolean"),
    ],
)
def test_vllm_serve_argv_rejects_unsafe_values(
    config: dict[str, object], message: str
) -> None:
    spec = make_spec(precision="4bit", engine_config=config)
    with pytest.raises(ValueError, match=message):
        vllm_serve_argv(spec)


def test_vllm_serve_argv_keeps_shell_metacharacters_in_one_item() -> None:
    argv = vllm_serve_argv(make_spec(engine_config={"chat_template": "a; rm -rf /"}))
    assert argv[-2:] == ["--chat-template", "a; rm -rf /"]


def test_vllm_serve_argv_needs_weights_dir() -> None:
    with pytest.raises(ValueError, match="weights_dir"):
        vllm_serve_argv(make_spec(weights_dir=""))


def test_vllm_serve_argv_max_model_len_conflict_is_refused() -> None:
    spec = make_spec(engine_config={"max_model_len": 4096}, max_model_len=8192)
    with pytest.raises(ValueError, match="conflicts"):
        vllm_serve_argv(spec)


def test_engine_flag_args_spells_lists_and_objects() -> None:
    args = engine_flag_args(
        {
            "kv_events_config": {"topic": "kv", "enable_kv_cache_events": True},
            "middleware": ["a.b", "c,d"],
            "swap_space": 4.5,
        }
    )
    assert args == [
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"topic":"kv"}',
        "--middleware",
        "a.b",
        "c,d",
        "--swap-space",
        "4.5",
    ]


def test_replica_spec_copies_engine_config() -> None:
    config = {"max_num_seqs": 8}
    spec = make_spec(engine_config=config)
    config["max_num_seqs"] = 9
    assert spec.engine_config["max_num_seqs"] == 8
    with pytest.raises(TypeError):
        # A read-only Mapping: the checker refuses the write that this test makes.
        spec.engine_config["max_num_seqs"] = 10  # type: ignore[index]


def test_replica_spec_is_hashable_and_compares_by_value() -> None:
    assert hash(make_spec(engine_config={"a": 1})) == hash(make_spec())
    assert make_spec(engine_config={"a": 1}) == make_spec(engine_config={"a": 1})
    assert make_spec(engine_config={"a": 1}) != make_spec(engine_config={"a": 2})


@pytest.mark.parametrize(
    "overrides",
    [
        {"precision": "fp8"},
        {"gpus_per_replica": 0},
        {"port": 0},
        {"port": 70000},
        {"max_model_len": 0},
        {"served_model_name": "--api-key"},
        {"weights_dir": "-rf"},
        {"extra": ("ok", "bad\0")},
        {"replica_id": ""},
    ],
)
def test_replica_spec_rejects_invalid_fields(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_spec(**overrides)


def test_sim_replica_argv_fp16_7b() -> None:
    spec = make_spec(
        engine_config={
            "max_num_seqs": 256,
            "max_num_batched_tokens": 2048,
            "gpu_memory_utilization": 0.9,
            "kv_cache_dtype": "fp8",
        },
        max_model_len=8192,
    )
    assert sim_replica_argv(spec, python="/usr/bin/python3") == [
        "/usr/bin/python3",
        "-m",
        "simengine",
        "--model",
        WEIGHTS,
        "--served-model-name",
        "chat-7b@v3",
        "--host",
        "127.0.0.1",
        "--port",
        "8101",
        "--sim-profile",
        "a100-8b",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        "8192",
        "--max-num-batched-tokens",
        "2048",
        "--max-num-seqs",
        "256",
    ]


def test_sim_replica_argv_uses_model_name_without_weights_and_passes_extra() -> None:
    spec = make_spec(
        weights_dir="",
        engine_config={"enable_prefix_caching": False},
        extra=("--sim-time-scale", "10"),
    )
    assert sim_replica_argv(spec) == [
        "python",
        "-m",
        "simengine",
        "--model",
        "chat-7b",
        "--served-model-name",
        "chat-7b@v3",
        "--host",
        "127.0.0.1",
        "--port",
        "8101",
        "--sim-profile",
        "a100-8b",
        "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--sim-time-scale",
        "10",
    ]


def test_sim_replica_argv_passes_the_pooling_runner() -> None:
    spec = make_spec(
        engine_config={"runner": "pooling", "enable_prefix_caching": False}
    )
    argv = sim_replica_argv(spec)
    assert argv[argv.index("--runner") + 1] == "pooling"
    assert "--runner" in vllm_serve_argv(spec)


@pytest.mark.parametrize(
    ("precision", "gpus", "config", "expected"),
    [
        ("fp16", 1, {}, "a100-minilm"),
        ("int8", 2, {}, "h100-minilm"),
        ("fp16", 1, {"sim_profile": "cpu-tiny"}, "cpu-minilm"),
    ],
)
def test_a_pooling_replica_embeds_at_the_speed_of_its_versions_gpu(
    precision: str, gpus: int, config: dict[str, Any], expected: str
) -> None:
    """The profile that sets a chat replica's step time sets an embedding
    replica's batch time: an FP16 one-GPU version embeds at an A100's."""
    spec = make_spec(
        precision=precision,
        gpus_per_replica=gpus,
        engine_config={"runner": "pooling", **config},
    )
    argv = sim_replica_argv(spec)
    options, _ = options_from_args(build_parser().parse_args(argv[3:]))
    assert options.embedding_profile == expected


def test_sim_replica_argv_rejects_reserved_keys_too() -> None:
    with pytest.raises(ValueError, match="the platform controls it"):
        sim_replica_argv(make_spec(engine_config={"port": 1}))


@pytest.mark.parametrize(
    ("precision", "gpus", "expected"),
    [
        ("fp16", 1, "a100-8b"),
        ("int8", 2, "h100-70b-int8-tp2"),
        ("fp16", 4, "h100-70b-tp4"),
        ("4bit", 1, "fallback"),
        ("fp16", 2, "fallback"),
    ],
)
def test_sim_profile_for_picks_by_precision_and_gpus(
    precision: str, gpus: int, expected: str
) -> None:
    spec = make_spec(precision=precision, gpus_per_replica=gpus)
    assert sim_profile_for(spec, default="fallback") == expected


def test_sim_profile_for_engine_config_override_wins() -> None:
    spec = make_spec(
        precision="int8", gpus_per_replica=2, engine_config={"sim_profile": "h100-8b"}
    )
    assert sim_profile_for(spec) == "h100-8b"
    assert sim_replica_argv(spec)[11:13] == ["--sim-profile", "h100-8b"]


def test_sim_profile_table_names_profiles_the_simulator_knows() -> None:
    shapes = [("fp16", 1), ("int8", 2), ("fp16", 4), ("4bit", 1)]
    chosen = {
        sim_profile_for(make_spec(precision=precision, gpus_per_replica=gpus))
        for precision, gpus in shapes
    }
    assert chosen <= set(PROFILES)


@pytest.mark.parametrize("profile", ["--api-key", "A100", "", 7])
def test_sim_profile_for_rejects_non_slug_names(profile: object) -> None:
    spec = make_spec(engine_config={"sim_profile": profile})
    with pytest.raises(ValueError, match="slug"):
        sim_profile_for(spec)


def test_sim_replica_argv_passes_the_configured_quality() -> None:
    spec = make_spec(engine_config={"sim_quality": 0.5, "max_num_seqs": 8})
    argv = sim_replica_argv(spec)
    assert argv[11:17] == [
        "--sim-profile",
        "a100-8b",
        "--sim-quality",
        "0.5",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert sim_quality_for(make_spec(engine_config={"sim_quality": 1})) == 1.0


def test_sim_replica_argv_leaves_quality_to_the_simulator_default() -> None:
    assert "--sim-quality" not in sim_replica_argv(make_spec())
    assert sim_quality_for(make_spec()) is None


def test_vllm_serve_argv_never_passes_the_sim_quality() -> None:
    spec = make_spec(engine_config={"sim_quality": 0.5, "sim_profile": "h100-8b"})
    argv = vllm_serve_argv(spec)
    assert not any("sim" in arg or arg == "0.5" for arg in argv)
    assert argv == vllm_serve_argv(make_spec())


@pytest.mark.parametrize("quality", [1.5, -0.1, True, "0.5", float("nan")])
def test_sim_quality_outside_zero_to_one_is_refused(quality: object) -> None:
    spec = make_spec(engine_config={"sim_quality": quality})
    with pytest.raises(ValueError, match="not a number from 0 to 1"):
        sim_replica_argv(spec)


def test_the_simulator_parses_the_quality_flag_it_is_given() -> None:
    spec = make_spec(weights_dir="", engine_config={"sim_quality": 0.25})
    argv = sim_replica_argv(spec)
    options, faults = options_from_args(build_parser().parse_args(argv[3:]))
    assert faults.quality == 0.25
    assert options.served_model_names == ["chat-7b@v3"]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv[3:], "--sim-quality", "2"])


def test_sim_replica_argv_passes_the_configured_ttft_factor() -> None:
    spec = make_spec(
        weights_dir="", engine_config={"sim_ttft_factor": 1.3, "sim_quality": 0.9}
    )
    argv = sim_replica_argv(spec)
    assert argv[11:19] == [
        "--sim-profile",
        "a100-8b",
        "--sim-quality",
        "0.9",
        "--sim-ttft-factor",
        "1.3",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    _, faults = options_from_args(build_parser().parse_args(argv[3:]))
    assert (faults.ttft_factor, faults.quality) == (1.3, 0.9)
    assert sim_ttft_factor_for(make_spec(engine_config={"sim_ttft_factor": 2})) == 2.0


def test_sim_replica_argv_leaves_the_ttft_factor_to_the_simulator_default() -> None:
    argv = sim_replica_argv(make_spec())
    assert "--sim-ttft-factor" not in argv
    assert sim_ttft_factor_for(make_spec()) is None
    _, faults = options_from_args(build_parser().parse_args(argv[3:]))
    assert faults.ttft_factor == 1.0


def test_vllm_serve_argv_never_passes_the_sim_ttft_factor() -> None:
    spec = make_spec(engine_config={"sim_ttft_factor": 1.3})
    assert vllm_serve_argv(spec) == vllm_serve_argv(make_spec())


@pytest.mark.parametrize(
    "factor", [0.5, 0, -1, True, "1.3", float("nan"), float("inf")]
)
def test_sim_ttft_factor_below_one_or_not_a_number_is_refused(factor: object) -> None:
    spec = make_spec(engine_config={"sim_ttft_factor": factor})
    with pytest.raises(ValueError, match="not a number of at least 1"):
        sim_replica_argv(spec)


@pytest.mark.parametrize("text", ["0.5", "x", "nan", "inf"])
def test_the_simulator_refuses_a_bad_ttft_factor_flag(text: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--sim-ttft-factor", text])


def test_sim_replica_argv_passes_sim_degraded_and_never_to_vllm() -> None:
    spec = make_spec(weights_dir="", engine_config={"sim_degraded": True})
    argv = sim_replica_argv(spec)
    assert "--sim-degraded" in argv
    _, faults = options_from_args(build_parser().parse_args(argv[3:]))
    assert faults.degraded is True
    assert "--sim-degraded" not in sim_replica_argv(make_spec())
    served = make_spec(engine_config={"sim_degraded": True})
    assert vllm_serve_argv(served) == vllm_serve_argv(make_spec())


@pytest.mark.parametrize("value", [1, "yes", None, 0.0])
def test_sim_degraded_must_be_a_boolean(value: object) -> None:
    with pytest.raises(ValueError, match="not a boolean"):
        sim_replica_argv(make_spec(engine_config={"sim_degraded": value}))


def test_sim_embedding_random_reaches_the_simulator_and_never_vllm() -> None:
    spec = make_spec(
        weights_dir="",
        engine_config={"runner": "pooling", "sim_embedding_random": True},
    )
    argv = sim_replica_argv(spec)
    assert "--sim-embedding-random" in argv
    options, _ = options_from_args(build_parser().parse_args(argv[3:]))
    assert options.is_embedding_random is True
    assert "--sim-embedding-random" not in sim_replica_argv(make_spec())
    with pytest.raises(ValueError, match="not a boolean"):
        sim_replica_argv(make_spec(engine_config={"sim_embedding_random": "yes"}))


def test_the_latency_target_is_the_platforms_and_reaches_no_engine() -> None:
    target = make_spec(engine_config={"latency_target_ms": 250})
    assert vllm_serve_argv(target) == vllm_serve_argv(make_spec())
    assert sim_replica_argv(target) == sim_replica_argv(make_spec())


def test_the_simulator_gets_the_quality_by_category() -> None:
    spec = make_spec(
        weights_dir="", engine_config={"sim_quality_by_category": {"maths": 0.5}}
    )
    argv = sim_replica_argv(spec)
    assert argv[argv.index("--sim-quality-by-category") + 1] == '{"maths": 0.5}'
    _, faults = options_from_args(build_parser().parse_args(argv[3:]))
    assert faults.quality_by_category == {"maths": 0.5}
    real = make_spec(engine_config={"sim_quality_by_category": {"maths": 0.5}})
    assert vllm_serve_argv(real) == vllm_serve_argv(make_spec())
    assert sim_quality_by_category_for(make_spec()) == {}


@pytest.mark.parametrize(
    "value", [[0.5], {"poetry": 0.5}, {"maths": 1.5}, {"maths": True}]
)
def test_a_bad_quality_by_category_is_refused(value: object) -> None:
    spec = make_spec(engine_config={"sim_quality_by_category": value})
    with pytest.raises(ValueError, match=r"sim_quality_by_category|sim quality"):
        sim_replica_argv(spec)

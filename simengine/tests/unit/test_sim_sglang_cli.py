"""The simulated replica's SGLang command line (``--sim-engine sglang``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_nodes.domain.replica_argv import (
    ReplicaSpec,
    sglang_launch_argv,
    sim_replica_argv,
)
from simengine.cli import build_parser, config_file_args, options_from_args
from simengine.cli import parse_args as cli_parse_args
from simengine.replica import SimOptions, SimReplica


def parse(argv: list[str]) -> SimOptions:
    options, _ = options_from_args(cli_parse_args(build_parser(), argv))
    return options


def spec(**engine_config: object) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id="chat-7b-v4-local-0",
        model="chat-7b",
        version="v4",
        served_model_name="chat-7b@v4",
        precision="int8",
        gpus_per_replica=2,
        engine_config={"engine": "sglang", **engine_config},
        weights_dir="/weights/chat-7b",
        host="127.0.0.1",
        port=8102,
        max_model_len=4096,
    )


def test_the_platforms_sglang_command_line_starts_a_radix_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GIVEN the argv the platform builds for a simulated SGLang replica, its key
    in a 0600 --config YAML file (JSON text, as the actuator writes it)
    WHEN the simulator parses it
    THEN it runs SGLang's engine (radix cache), the model path, context length,
    cache report and metrics the flags say, and the file's key."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config = tmp_path / "key.yaml"
    config.write_text(json.dumps({"api-key": "sk-from-file"}))
    argv = sim_replica_argv(
        spec(enable_prefix_caching=False), config_file=str(config), profile="cpu-tiny"
    )
    options = parse(argv[3:])
    assert options.engine == "sglang"
    assert options.model == "/weights/chat-7b"
    assert options.served_model_names == ["chat-7b@v4"]
    assert options.max_model_len == 4096
    assert options.enable_prefix_caching is False  # --disable-radix-cache
    assert options.enable_cache_report and options.enable_metrics
    assert options.api_keys == ("sk-from-file",)
    replica = SimReplica(options)
    assert replica.config.cache == "radix"
    assert replica.engine.radix_cache is None  # caching off


def test_the_real_sglang_flags_are_accepted_too(tmp_path: Path) -> None:
    """GIVEN sglang_launch_argv's flags (--dtype, --quantization included)
    WHEN the simulator is started with them under --sim-engine sglang
    THEN it parses them all; caching stays on without --disable-radix-cache."""
    real = sglang_launch_argv(spec(), python="/py")
    options = parse(["--sim-engine", "sglang", *real[3:]])
    assert options.engine == "sglang" and options.enable_prefix_caching


def test_config_yaml_keys_take_dashes_or_underscores_and_the_cli_wins(
    tmp_path: Path,
) -> None:
    """GIVEN a YAML --config with underscores, a boolean and a value the command
    line also gives
    WHEN parsed
    THEN its flags apply before the command line's, as SGLang merges them."""
    config = tmp_path / "server.yaml"
    config.write_text("api_key: sk-yaml\ncontext-length: 1024\nenable_metrics: true\n")
    assert config_file_args(str(config)) == [
        "--api-key",
        "sk-yaml",
        "--context-length",
        "1024",
        "--enable-metrics",
    ]
    options = parse(
        [
            "--sim-engine",
            "sglang",
            "--model-path",
            "m",
            "--config",
            str(config),
            "--context-length",
            "2048",
        ]
    )
    assert options.api_keys == ("sk-yaml",)
    assert options.max_model_len == 2048
    assert options.enable_metrics


def test_the_env_key_still_works_without_a_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "sk-env")
    options = parse(["--sim-engine", "sglang", "--model-path", "m"])
    assert options.api_keys == ("sk-env",)
    assert not options.enable_metrics and not options.enable_cache_report


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "m", "--disable-radix-cache"],
        ["--model-path", "m"],
        ["--model", "m", "--config", "/nope.yaml"],
        ["--sim-engine", "sglang", "--model", "m", "--model-path", "m"],
        ["--sim-engine", "sglang"],
    ],
)
def test_sglang_flags_need_sglang_and_a_model(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if "/nope.yaml" in argv:
        missing = tmp_path / "k.yaml"
        missing.write_text("{}")
        argv = [str(missing) if a == "/nope.yaml" else a for a in argv]
    with pytest.raises(SystemExit):
        cli_parse_args(build_parser(), argv)
    assert "error:" in capsys.readouterr().err


def test_a_config_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match="mapping"):
        config_file_args(str(config))


def test_a_json_named_config_is_refused_as_sglang_refuses_it(tmp_path: Path) -> None:
    """SGLang 0.5.23 takes only .yaml/.yml (real: "Config file must be YAML
    format, got: .json"); so does the simulator, so the actuator's file name is
    held to what the real server accepts."""
    config = tmp_path / "key.json"
    config.write_text('{"api-key": "k"}')
    with pytest.raises(ValueError, match=r"must be YAML format, got: \.json"):
        config_file_args(str(config))


def test_vllm_mode_is_unchanged() -> None:
    options = parse(["--model", "m"])
    assert options.engine == "vllm"
    assert SimReplica(options).config.cache == "block"

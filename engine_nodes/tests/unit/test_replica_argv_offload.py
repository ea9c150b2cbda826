"""The CPU offload tier on the replica command lines (vLLM's flag names)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine_nodes.domain.replica_argv import (
    ReplicaSpec,
    sim_replica_argv,
    vllm_serve_argv,
)
from simengine.cli import build_parser, options_from_args


def make_spec(engine_config: dict[str, Any]) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id="chat-7b-v3-local-0",
        model="chat-7b",
        version="v3",
        served_model_name="chat-7b@v3",
        precision="fp16",
        gpus_per_replica=1,
        engine_config=engine_config,
        weights_dir="/weights/chat-7b",
        host="127.0.0.1",
        port=8101,
    )


def tail_after(argv: list[str], flag: str) -> list[str]:
    return argv[argv.index(flag) :]


def test_offload_flags_reach_vllm_serve_in_its_spelling() -> None:
    spec = make_spec(
        {"kv_offloading_size": 64, "kv_offloading_backend": "native", "max_num_seqs": 8}
    )
    argv = vllm_serve_argv(spec)

    assert tail_after(argv, "--kv-offloading-backend") == [
        "--kv-offloading-backend",
        "native",
        "--kv-offloading-size",
        "64",
        "--max-num-seqs",
        "8",
    ]
    lmcache = make_spec({"kv_offloading_size": 0.5, "kv_offloading_backend": "lmcache"})
    assert tail_after(vllm_serve_argv(lmcache), "--kv-offloading-backend") == [
        "--kv-offloading-backend",
        "lmcache",
        "--kv-offloading-size",
        "0.5",
    ]


def test_offload_flags_reach_the_simulated_replica_and_its_engine() -> None:
    spec = make_spec({"kv_offloading_size": 0.0625, "max_num_seqs": 8})
    argv = sim_replica_argv(spec)

    assert tail_after(argv, "--kv-offloading-size") == [
        "--kv-offloading-size",
        "0.0625",
        "--max-num-seqs",
        "8",
    ]
    options, _ = options_from_args(build_parser().parse_args(argv[3:]))
    assert (options.kv_offloading_size, options.kv_offloading_backend) == (
        0.0625,
        "native",
    )


def test_without_the_keys_no_offload_flag_is_passed() -> None:
    spec = make_spec({"max_num_seqs": 8})

    for argv in (vllm_serve_argv(spec), sim_replica_argv(spec)):
        assert not any(arg.startswith("--kv-offloading") for arg in argv)


@pytest.mark.parametrize("size", [0, 0.0, -1, -0.5, math.nan, math.inf, True, "8"])
def test_an_offload_size_that_is_not_a_number_above_zero_is_refused(
    size: object,
) -> None:
    spec = make_spec({"kv_offloading_size": size})

    for build in (vllm_serve_argv, sim_replica_argv):
        with pytest.raises(ValueError, match=r"kv_offloading_size.*above 0"):
            build(spec)


@pytest.mark.parametrize("backend", ["mooncake", "NATIVE", 1, None])
def test_an_unknown_offload_backend_is_refused(backend: object) -> None:
    spec = make_spec({"kv_offloading_size": 1, "kv_offloading_backend": backend})

    for build in (vllm_serve_argv, sim_replica_argv):
        with pytest.raises(ValueError, match="kv_offloading_backend"):
            build(spec)

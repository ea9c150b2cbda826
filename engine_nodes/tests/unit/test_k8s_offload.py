"""A pool whose version offloads KV to CPU memory asks Kubernetes for that memory."""

from __future__ import annotations

from typing import Any

from engine_nodes.domain.k8s import PoolSpec, render_deployment
from engine_nodes.domain.replica_argv import ReplicaSpec, vllm_serve_argv


def container_for(engine_config: dict[str, Any]) -> dict[str, Any]:
    replica = ReplicaSpec(
        replica_id="chat-70b-v2-us-east-0",
        model="chat-70b",
        version="v2",
        served_model_name="chat-70b@v2",
        precision="fp16",
        gpus_per_replica=4,
        engine_config=engine_config,
        weights_dir="/weights/chat-70b",
        host="0.0.0.0",
        port=8000,
    )
    pool = PoolSpec(
        model="chat-70b",
        version="v2",
        region="us-east",
        replicas=2,
        image="vllm/vllm-openai:v0.32.0",
        gpus_per_replica=4,
        argv=tuple(vllm_serve_argv(replica)),
        weights_dir="/weights/chat-70b",
        weights_pvc="model-weights",
    )
    [container] = render_deployment(namespace="serving", spec=pool)["spec"]["template"][
        "spec"
    ]["containers"]
    return container


def test_the_offload_flags_pass_through_and_size_the_memory_request() -> None:
    container = container_for(
        {"kv_offloading_size": 64, "kv_offloading_backend": "native"}
    )

    args = container["args"]
    at = args.index("--kv-offloading-size")
    assert args[at + 1] == "64"
    assert args[args.index("--kv-offloading-backend") + 1] == "native"
    assert container["resources"]["requests"] == {
        "nvidia.com/gpu": "4",
        "memory": "65536Mi",
    }
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}


def test_a_fractional_size_rounds_up_to_whole_mebibytes() -> None:
    container = container_for({"kv_offloading_size": 0.0001})

    assert container["resources"]["requests"]["memory"] == "1Mi"


def test_without_offloading_no_memory_is_requested() -> None:
    container = container_for({"max_num_seqs": 64})

    assert container["resources"]["requests"] == {"nvidia.com/gpu": "4"}

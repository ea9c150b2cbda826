"""Tests for a pool pod's placement, its engine key and the weights node labels."""

from __future__ import annotations

from typing import Any

import pytest

from engine_nodes.domain.k8s import (
    SGLANG_CONFIG_PATH,
    DeploymentTemplate,
    PoolSpec,
    render_deployment,
)
from engine_nodes.domain.k8s_placement import weights_label, weights_label_patch

HASH = "ab" * 32
SGLANG_ARGV = (
    "python3",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "/weights/x",
    "--config",
    SGLANG_CONFIG_PATH,
)


def make_pool(**overrides: Any) -> PoolSpec:
    fields: dict[str, Any] = {
        "model": "chat-70b",
        "version": "v2",
        "region": "us-east",
        "replicas": 3,
        "image": "vllm/vllm-openai:v0.32.0",
        "gpus_per_replica": 2,
        "argv": ("vllm", "serve", "/weights/x"),
        "weights_dir": "/weights/x",
        "weights_host_path": f"/var/lib/platform/weights/{HASH}",
    }
    fields.update(overrides)
    return PoolSpec(**fields)


def pod_of(spec: PoolSpec) -> dict[str, Any]:
    pod: dict[str, Any] = render_deployment(namespace="n", spec=spec)["spec"][
        "template"
    ]["spec"]
    return pod


def test_vllm_pod_reads_the_api_key_from_the_secret_never_its_value() -> None:
    pod = pod_of(make_pool(api_key_secret="platform-secrets"))
    [container] = pod["containers"]
    [key] = [e for e in container["env"] if e["name"] == "VLLM_API_KEY"]
    assert key == {
        "name": "VLLM_API_KEY",
        "valueFrom": {
            "secretKeyRef": {"name": "platform-secrets", "key": "engine-api-key"}
        },
    }
    assert "initContainers" not in pod
    assert "--api-key" not in container["args"]


def test_pod_without_a_key_secret_has_no_key() -> None:
    [container] = pod_of(make_pool())["containers"]
    assert "VLLM_API_KEY" not in {e["name"] for e in container["env"]}


def test_sglang_pod_gets_its_key_file_from_an_init_container() -> None:
    pod = pod_of(
        make_pool(
            engine="sglang",
            image="lmsysorg/sglang:v0.5.9",
            argv=SGLANG_ARGV,
            api_key_secret="platform-secrets",
        )
    )
    [init] = pod["initContainers"]
    [container] = pod["containers"]
    assert init["image"] == container["image"] == "lmsysorg/sglang:v0.5.9"
    assert init["env"] == [
        {
            "name": "ENGINE_API_KEY",
            "valueFrom": {
                "secretKeyRef": {"name": "platform-secrets", "key": "engine-api-key"}
            },
        }
    ]
    assert SGLANG_CONFIG_PATH in init["command"][2]
    assert "VLLM_API_KEY" not in {e["name"] for e in container["env"]}
    assert {"name": "engine-config", "mountPath": "/run/engine", "readOnly": True} in (
        container["volumeMounts"]
    )
    [volume] = [v for v in pod["volumes"] if v["name"] == "engine-config"]
    assert volume["emptyDir"]["medium"] == "Memory"


def test_sglang_pool_with_a_key_must_read_the_config_file() -> None:
    with pytest.raises(ValueError, match="--config"):
        make_pool(engine="sglang", argv=SGLANG_ARGV[:-2], api_key_secret="s")


def test_gpu_type_is_a_required_node_affinity_weights_a_preferred_one() -> None:
    pod = pod_of(make_pool(gpu_product="NVIDIA-H100-80GB-HBM3", weights_hash=HASH))
    affinity = pod["affinity"]["nodeAffinity"]
    [term] = affinity["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"] == [
        {
            "key": "nvidia.com/gpu.product",
            "operator": "In",
            "values": ["NVIDIA-H100-80GB-HBM3"],
        }
    ]
    [preferred] = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["preference"]["matchExpressions"] == [
        {
            "key": f"weights.platform/{HASH[:32]}",
            "operator": "In",
            "values": ["verified"],
        }
    ]
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_pool_pods_spread_over_nodes_without_going_pending() -> None:
    spec = make_pool()
    manifest = render_deployment(namespace="n", spec=spec)
    pod = manifest["spec"]["template"]["spec"]
    assert "affinity" not in pod  # no GPU type, no weights label: no affinity
    [spread] = pod["topologySpreadConstraints"]
    assert spread == {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": manifest["spec"]["selector"],
    }


@pytest.mark.parametrize("product", ["", "H100 80GB", "x" * 64])
def test_a_gpu_type_that_is_no_label_value_is_refused(product: str) -> None:
    with pytest.raises(ValueError, match="label value"):
        make_pool(gpu_product=product)
    with pytest.raises(ValueError, match="label value"):
        DeploymentTemplate(image="i", weights_pvc="w", gpu_products=(("m", product),))


def test_template_gpu_type_most_specific_ref_wins() -> None:
    template = DeploymentTemplate(
        image="i",
        weights_pvc="w",
        gpu_products=(("*", "A"), ("chat", "B"), ("chat@v2", "C")),
    )
    assert template.gpu_product_for("chat", "v2") == "C"
    assert template.gpu_product_for("chat", "v1") == "B"
    assert template.gpu_product_for("embed", "v1") == "A"
    bare = DeploymentTemplate(image="i", weights_pvc="w")
    assert bare.gpu_product_for("chat", "v1") is None
    assert bare.api_key_secret == "platform-secrets"


def test_weights_label_patch_adds_missing_and_removes_stale_labels_only() -> None:
    other = "cd" * 32
    labels = {
        weights_label(other): "verified",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    }
    assert weights_label_patch(labels, [HASH]) == {
        weights_label(HASH): "verified",
        weights_label(other): None,
    }
    assert weights_label_patch({weights_label(HASH): "verified"}, [HASH]) == {}
    # A tree being verified again (a restarted pod) keeps its label meanwhile.
    assert weights_label_patch(labels, [], pending=[other]) == {}
    with pytest.raises(ValueError, match="hex"):
        weights_label("not-a-hash")

"""Tests for the pool Deployment manifest."""

from __future__ import annotations

import re
from typing import Any

import pytest

from engine_nodes.domain.k8s import (
    SPEC_DIGEST_ANNOTATION,
    DeploymentTemplate,
    FollowAction,
    PoolSpec,
    deployment_name,
    follow_action,
    label_value,
    render_deployment,
    scale_body,
    spec_digest,
)

ARGV = (
    "vllm",
    "serve",
    "/weights/chat-70b",
    "--served-model-name",
    "chat-70b@v2",
    "--host",
    "0.0.0.0",
    "--port",
    "8000",
    "--tensor-parallel-size",
    "2",
)
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")


def make_pool(**overrides: Any) -> PoolSpec:
    fields: dict[str, Any] = {
        "model": "chat-70b",
        "version": "v2",
        "region": "us-east",
        "replicas": 3,
        "image": "vllm/vllm-openai:v0.32.0",
        "gpus_per_replica": 2,
        "argv": ARGV,
        "weights_dir": "/weights/chat-70b",
        "weights_pvc": "model-weights",
    }
    fields.update(overrides)
    return PoolSpec(**fields)


def container_of(manifest: dict[str, Any]) -> dict[str, Any]:
    [container] = manifest["spec"]["template"]["spec"]["containers"]
    return container


def test_render_deployment_identity_and_labels() -> None:
    manifest = render_deployment(namespace="serving", spec=make_pool())
    assert manifest["apiVersion"] == "apps/v1"
    assert manifest["kind"] == "Deployment"
    assert manifest["metadata"]["name"] == "vllm-chat-70b-v2-us-east"
    assert manifest["metadata"]["namespace"] == "serving"
    selector = {
        "app.kubernetes.io/name": "vllm",
        "platform/model": "chat-70b",
        "platform/version": "v2",
        "platform/region": "us-east",
    }
    assert manifest["spec"]["selector"] == {"matchLabels": selector}
    pod_labels = manifest["spec"]["template"]["metadata"]["labels"]
    assert pod_labels.items() >= selector.items()
    assert manifest["metadata"]["labels"] == pod_labels
    assert manifest["spec"]["replicas"] == 3


def test_render_deployment_container_runs_argv_with_gpus() -> None:
    container = container_of(render_deployment(namespace="ns", spec=make_pool()))
    assert container["name"] == "vllm"
    assert container["image"] == "vllm/vllm-openai:v0.32.0"
    assert [*container["command"], *container["args"]] == list(ARGV)
    assert container["command"] == ["vllm"]
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": "2"},
        "requests": {"nvidia.com/gpu": "2"},
    }
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"}
    ]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1"


def test_render_deployment_exposes_the_kv_events_port_only_when_set() -> None:
    plain = container_of(render_deployment(namespace="ns", spec=make_pool()))
    publishing = container_of(
        render_deployment(namespace="ns", spec=make_pool(kv_events_port=5557))
    )
    assert [p["name"] for p in plain["ports"]] == ["http"]
    assert publishing["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
    ]


@pytest.mark.parametrize("port", [-1, 8000, 65536])
def test_pool_spec_refuses_a_kv_events_port_that_is_no_free_port(port: int) -> None:
    with pytest.raises(ValueError, match="kv_events_port"):
        make_pool(kv_events_port=port)


def test_render_deployment_probes_health_with_a_long_startup() -> None:
    container = container_of(render_deployment(namespace="ns", spec=make_pool()))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 300


def test_render_deployment_startup_budget_rounds_up() -> None:
    pool = make_pool(startup_timeout_s=605)
    startup = container_of(render_deployment(namespace="ns", spec=pool))["startupProbe"]
    assert startup["failureThreshold"] == 61


def test_render_deployment_mounts_weights_read_only_and_shm_in_memory() -> None:
    manifest = render_deployment(namespace="ns", spec=make_pool())
    pod = manifest["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in container_of(manifest)["volumeMounts"]}
    assert mounts["weights"] == {
        "name": "weights",
        "mountPath": "/weights/chat-70b",
        "readOnly": True,
    }
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["weights"]["persistentVolumeClaim"] == {
        "claimName": "model-weights",
        "readOnly": True,
    }
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert pod["terminationGracePeriodSeconds"] == 120


def test_render_deployment_host_path_weights_and_sub_path() -> None:
    pool = make_pool(weights_pvc=None, weights_host_path="/srv/weights/abc")
    volumes = render_deployment(namespace="ns", spec=pool)["spec"]["template"]["spec"][
        "volumes"
    ]
    assert volumes[0] == {
        "name": "weights",
        "hostPath": {"path": "/srv/weights/abc", "type": "Directory"},
    }
    sub = container_of(
        render_deployment(namespace="ns", spec=make_pool(weights_sub_path="abc"))
    )["volumeMounts"][0]
    assert sub["subPath"] == "abc"


def test_render_deployment_tolerates_gpu_taint_and_keeps_capacity_on_update() -> None:
    manifest = render_deployment(namespace="ns", spec=make_pool())
    assert manifest["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
    }
    assert {
        "key": "nvidia.com/gpu",
        "operator": "Exists",
        "effect": "NoSchedule",
    } in manifest["spec"]["template"]["spec"]["tolerations"]


def test_deployment_name_sanitizes_to_dns_label() -> None:
    assert deployment_name("Chat_7B.instruct", "v13", "EU--West") == (
        "vllm-chat-7b-instruct-v13-eu-west"
    )


def test_deployment_name_long_names_are_cut_and_stay_distinct() -> None:
    one = deployment_name("m" * 64, "v1", "us-east-1")
    two = deployment_name("m" * 64, "v2", "us-east-1")
    assert len(one) == 63
    assert DNS_1123_LABEL.fullmatch(one)
    assert DNS_1123_LABEL.fullmatch(two)
    assert one != two


@pytest.mark.parametrize(
    ("model", "version", "region"),
    [
        ("chat-7b", "v1", "local"),
        ("a" * 64, "v999999999", "b" * 64),
        ("x.y_z", "v2", "-edge-"),
        ("m", "v1", "r" * 50 + "-" + "s" * 5),
    ],
)
def test_deployment_name_is_always_a_dns_label(
    model: str, version: str, region: str
) -> None:
    name = deployment_name(model, version, region)
    assert len(name) <= 63
    assert DNS_1123_LABEL.fullmatch(name), name


def test_label_value_is_valid_for_long_and_odd_text() -> None:
    assert label_value("chat-7b") == "chat-7b"
    assert label_value("_odd name!_") == "odd-name"
    assert len(label_value("a" * 100)) == 63


@pytest.mark.parametrize(
    "overrides",
    [
        {"replicas": -1},
        {"gpus_per_replica": 0},
        {"argv": ()},
        {"image": ""},
        {"weights_dir": "weights"},
        {"weights_pvc": None},
        {"weights_host_path": "/srv/w"},
        {"weights_pvc": None, "weights_host_path": "/w", "weights_sub_path": "x"},
        {"port": 0},
        {"drain_s": 0},
    ],
)
def test_pool_spec_rejects_invalid_fields(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_pool(**overrides)


def test_render_deployment_replicas_are_the_spec_s_and_carry_a_spec_digest() -> None:
    manifest = render_deployment(namespace="serving", spec=make_pool(replicas=4))
    assert manifest["spec"]["replicas"] == 4
    digest = manifest["metadata"]["annotations"][SPEC_DIGEST_ANNOTATION]
    assert digest == spec_digest(manifest)
    assert re.fullmatch(r"[0-9a-f]{64}", digest)


def test_spec_digest_leaves_out_the_replica_count_only() -> None:
    def digest(**overrides: Any) -> str:
        manifest = render_deployment(namespace="serving", spec=make_pool(**overrides))
        return str(manifest["metadata"]["annotations"][SPEC_DIGEST_ANNOTATION])

    assert digest(replicas=1) == digest(replicas=9)
    assert digest(image="vllm/vllm-openai:v0.33.0") != digest()
    assert digest(drain_s=30) != digest()


def test_follow_action_creates_patches_scales_or_leaves_alone() -> None:
    manifest = render_deployment(namespace="serving", spec=make_pool(replicas=3))
    digest = manifest["metadata"]["annotations"][SPEC_DIGEST_ANNOTATION]

    def action(*, present: bool = True, digest: str | None, replicas: int) -> str:
        return follow_action(
            manifest,
            existing_digest=digest,
            existing_replicas=replicas,
            is_present=present,
        )

    assert action(present=False, digest=None, replicas=0) == FollowAction.CREATE
    assert action(digest=digest, replicas=3) == FollowAction.NONE
    assert action(digest=digest, replicas=2) == FollowAction.SCALE
    assert action(digest="0" * 64, replicas=3) == FollowAction.PATCH
    # Written by hand (no annotation): patched whole, replicas included.
    assert action(digest=None, replicas=2) == FollowAction.PATCH


def test_scale_body_sets_replicas_and_refuses_negative_counts() -> None:
    assert scale_body(0) == {"spec": {"replicas": 0}}
    with pytest.raises(ValueError, match="negative"):
        scale_body(-1)


def test_deployment_template_lays_weights_out_by_hash() -> None:
    pvc = DeploymentTemplate(image="i", weights_pvc="model-weights")
    assert pvc.weights_dir("ab" * 32) == f"/weights/{'ab' * 32}"
    assert pvc.volume("ab" * 32) == {
        "weights_pvc": "model-weights",
        "weights_sub_path": "ab" * 32,
    }
    host = DeploymentTemplate(image="i", weights_host_root="/srv/cache/")
    assert host.volume("cd" * 32) == {"weights_host_path": f"/srv/cache/{'cd' * 32}"}
    with pytest.raises(ValueError, match="exactly one"):
        DeploymentTemplate(image="i")
    with pytest.raises(ValueError, match="absolute"):
        DeploymentTemplate(image="i", weights_pvc="w", weights_mount="weights")


def test_a_pools_own_env_follows_the_platforms_in_the_container() -> None:
    protocol = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    manifest = render_deployment(namespace="ns", spec=make_pool(env=[protocol]))
    [container] = manifest["spec"]["template"]["spec"]["containers"]
    names = [item["name"] for item in container["env"]]
    assert names[-1] == protocol[0]
    assert container["env"][-1]["value"] == protocol[1]
    assert names.index("HF_HUB_OFFLINE") < names.index(protocol[0])


def test_a_pool_env_name_must_be_a_c_identifier() -> None:
    with pytest.raises(ValueError, match="no C identifier"):
        make_pool(env=[("BAD-NAME", "x")])

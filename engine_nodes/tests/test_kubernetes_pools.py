"""Pools on Kubernetes: each Deployment's replicas follow the pool's target.

No cluster: the API stand-in keeps what it is sent as the official client's models
(``V1Deployment``), as ``AppsV1Api`` returns them, so the manifests and patches are
checked against the client's own schema.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from engine_nodes import services
from engine_nodes.domain.k8s import DeploymentTemplate, FollowAction
from engine_nodes.domain.k8s_warm import WARM_PRIORITY_CLASS
from engine_nodes.kubernetes_actuator import KubernetesActuator
from models_registry import services as registry_services
from models_registry.models import ModelVersion, Pool
from tests.factories import VERSION_BODY

pytestmark = pytest.mark.django_db

client = pytest.importorskip("kubernetes.client")

TEMPLATE = DeploymentTemplate(
    image="vllm/vllm-openai:v0.32.0", weights_pvc="model-weights", drain_s=600
)
NAME = "vllm-chat-7b-v1-eu-west"
WARM_NAME = "warm-chat-7b-v1-eu-west"


class NotFound(Exception):
    status = 404


class ClientAppsV1:
    """Holds Deployments as ``V1Deployment`` models; records every call."""

    def __init__(self) -> None:
        self.api_client = client.ApiClient()
        self.objects: dict[str, Any] = {}
        self.calls: list[tuple[str, Any]] = []

    def model(self, body: dict[str, Any]) -> Any:
        deployment = self.api_client._ApiClient__deserialize(body, "V1Deployment")
        # Nothing the client does not know was sent (it would be dropped).
        assert self.api_client.sanitize_for_serialization(deployment) == body
        return deployment

    def read_namespaced_deployment(self, name: str, namespace: str) -> Any:
        self.calls.append(("read", name))
        if name not in self.objects:
            raise NotFound
        return self.objects[name]

    def create_namespaced_deployment(self, namespace: str, body: Any) -> Any:
        self.calls.append(("create", body))
        self.objects[body["metadata"]["name"]] = self.model(body)
        return self.objects[body["metadata"]["name"]]

    def patch_namespaced_deployment(self, name: str, namespace: str, body: Any) -> Any:
        self.calls.append(("patch", body))
        self.objects[name] = self.model(body)
        return self.objects[name]

    def patch_namespaced_deployment_scale(
        self, name: str, namespace: str, body: Any
    ) -> Any:
        self.calls.append(("scale", body))
        scale = self.api_client._ApiClient__deserialize(body, "V1Scale")
        self.objects[name].spec.replicas = scale.spec.replicas
        return scale

    def delete_namespaced_deployment(self, name: str, namespace: str) -> Any:
        raise AssertionError("following a pool never deletes its Deployment")


@pytest.fixture
def pool(chat_v1: ModelVersion) -> Pool:
    return Pool.objects.create(
        model_id="chat-7b",
        version=chat_v1,
        region="eu-west",
        min_replicas=1,
        max_replicas=4,
        desired_replicas=3,
    )


def follow(api: ClientAppsV1, template: DeploymentTemplate = TEMPLATE) -> Any:
    return services.follow_pools_on_kubernetes(
        actuator=KubernetesActuator(api, "serving"), region="eu-west", template=template
    )


def set_desired(pool: Pool, desired: int) -> None:
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=desired)


def test_the_pool_s_deployment_is_created_at_its_target_size(pool: Pool) -> None:
    api = ClientAppsV1()
    assert follow(api) == {NAME: FollowAction.CREATE}
    deployment = api.objects[NAME]
    assert deployment.spec.replicas == 3
    container = deployment.spec.template.spec.containers[0]
    weights_dir = f"/weights/{pool.version.weights_hash}"
    assert container.image == TEMPLATE.image
    assert container.command == ["vllm"]
    assert container.args[:2] == ["serve", weights_dir]
    assert container.resources.limits == {"nvidia.com/gpu": "1"}
    [mount] = [m for m in container.volume_mounts if m.name == "weights"]
    assert (mount.mount_path, mount.sub_path) == (
        weights_dir,
        pool.version.weights_hash,
    )
    assert deployment.spec.template.spec.termination_grace_period_seconds == 600


def test_an_sglang_version_s_pool_runs_sglang_in_its_own_image(
    chat_v1: ModelVersion,
) -> None:
    """GIVEN the 70B INT8 version on 2 GPUs with engine sglang
    WHEN its pool follows on Kubernetes
    THEN the Deployment runs SGLang's launch_server from the SGLang image in a
    container named sglang, 2 GPUs, tensor parallel 2, INT8 weights, cache report
    on; without an SGLang image the pool is skipped, the others still follow."""
    body = {
        **VERSION_BODY,
        "weights_hash": "b" * 64,
        "precision": "int8",
        "gpus_per_replica": 2,
        "engine_config": {"engine": "sglang"},
    }
    version = registry_services.register_version(model_id="chat-7b", **body)
    Pool.objects.create(
        model_id="chat-7b",
        version=version,
        region="eu-west",
        min_replicas=1,
        max_replicas=2,
        desired_replicas=1,
    )
    name = f"vllm-chat-7b-{version.version}-eu-west"
    api = ClientAppsV1()
    assert follow(api) == {}  # no SGLang image: skipped (and logged)

    template = DeploymentTemplate(
        image=TEMPLATE.image,
        sglang_image="lmsysorg/sglang:v0.5.9",
        weights_pvc="model-weights",
        drain_s=600,
    )
    assert follow(api, template) == {name: FollowAction.CREATE}
    container = api.objects[name].spec.template.spec.containers[0]
    assert container.name == "sglang"
    assert container.image == "lmsysorg/sglang:v0.5.9"
    assert container.command == ["python3"]
    args = container.args
    assert args[:4] == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        f"/weights/{'b' * 64}",
    ]
    assert args[args.index("--tp-size") + 1] == "2"
    assert args[args.index("--quantization") + 1] == "w8a8_int8"
    assert "--enable-cache-report" in args and "--enable-metrics" in args
    assert container.resources.limits == {"nvidia.com/gpu": "2"}
    assert container.readiness_probe.http_get.path == "/health"
    # Its API key: --config names the file the init container writes from the
    # Secret; the key itself is nowhere in the manifest.
    assert args[args.index("--config") + 1] == "/run/engine/sglang.yaml"
    [init] = api.objects[name].spec.template.spec.init_containers
    assert init.env[0].value_from.secret_key_ref.name == "platform-secrets"


def test_the_deployment_scales_with_the_pool_s_target_and_only_then(
    pool: Pool,
) -> None:
    api = ClientAppsV1()
    follow(api)
    api.calls.clear()
    assert follow(api) == {NAME: FollowAction.NONE}
    # The pool's Deployment, then its warm nodes' (none asked for, none there).
    assert api.calls == [("read", NAME), ("read", WARM_NAME)]

    set_desired(pool, 2)  # the autoscaler scaled down
    api.calls.clear()
    assert follow(api) == {NAME: FollowAction.SCALE}
    assert api.calls == [
        ("read", NAME),
        ("scale", {"spec": {"replicas": 2}}),
        ("read", WARM_NAME),
    ]
    assert api.objects[NAME].spec.replicas == 2

    set_desired(pool, 9)  # held at max_replicas, as Pool.target_replicas is
    follow(api)
    assert api.objects[NAME].spec.replicas == 4


def test_the_pods_demand_the_key_on_their_version_s_gpu_near_its_weights(
    pool: Pool,
) -> None:
    """GIVEN a template on the nodes' caches with a GPU type for the model
    WHEN the pool follows
    THEN its pods read VLLM_API_KEY from the Secret, need that GPU type, and
    prefer nodes labelled with the version's weights."""
    api = ClientAppsV1()
    template = DeploymentTemplate(
        image=TEMPLATE.image,
        weights_host_root="/var/lib/platform/weights",
        gpu_products=(("*", "NVIDIA-A100-SXM4-80GB"), ("chat-7b", "NVIDIA-L4")),
    )
    assert follow(api, template) == {NAME: FollowAction.CREATE}
    pod = api.objects[NAME].spec.template.spec
    [key] = [e for e in pod.containers[0].env if e.name == "VLLM_API_KEY"]
    assert key.value is None
    assert key.value_from.secret_key_ref.key == "engine-api-key"
    affinity = pod.affinity.node_affinity
    [term] = (
        affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    )
    assert term.match_expressions[0].values == ["NVIDIA-L4"]
    [preferred] = affinity.preferred_during_scheduling_ignored_during_execution
    label = preferred.preference.match_expressions[0].key
    assert label == f"weights.platform/{pool.version.weights_hash[:32]}"


def test_the_warm_nodes_follow_the_autoscalers_target(pool: Pool) -> None:
    """GIVEN a pool whose autoscaler asked for 2 warm nodes at its last tick
    WHEN the pools are followed, and again after the target falls to 0
    THEN a placeholder Deployment holds one replica's GPUs per warm node, below
    every serving pod's priority and outside the pool's selector; it scales to 0
    rather than leaving GPUs held."""
    Pool.objects.filter(pk=pool.pk).update(
        warm_nodes_max=4, autoscaler_state={"last": {"warm_nodes": 2}}
    )
    api = ClientAppsV1()
    assert follow(api) == {NAME: FollowAction.CREATE, WARM_NAME: FollowAction.CREATE}
    warm = api.objects[WARM_NAME]
    assert warm.spec.replicas == 2
    spec = warm.spec.template.spec
    assert spec.priority_class_name == WARM_PRIORITY_CLASS
    [container] = spec.containers
    assert container.resources.limits == {"nvidia.com/gpu": "1"}
    pool_selector = api.objects[NAME].spec.selector.match_labels
    assert not set(pool_selector.items()) <= set(warm.metadata.labels.items())

    Pool.objects.filter(pk=pool.pk).update(autoscaler_state={"last": {"warm_nodes": 0}})
    assert follow(api)[WARM_NAME] == FollowAction.SCALE
    assert api.objects[WARM_NAME].spec.replicas == 0
    assert follow(api) == {NAME: FollowAction.NONE}  # at 0, nothing to say


def test_a_changed_template_patches_the_whole_deployment(pool: Pool) -> None:
    api = ClientAppsV1()
    follow(api)
    api.calls.clear()
    newer = DeploymentTemplate(
        image="vllm/vllm-openai:v0.33.0", weights_pvc="model-weights", drain_s=600
    )
    assert follow(api, newer) == {NAME: FollowAction.PATCH}
    assert [call for call, _ in api.calls] == ["read", "patch", "read"]
    assert api.objects[NAME].spec.template.spec.containers[0].image == newer.image
    assert api.objects[NAME].spec.replicas == 3


class _ApiServer(ThreadingHTTPServer):
    """The Deployment paths of a Kubernetes API server, in memory, over HTTP."""

    deployments: dict[str, dict[str, Any]]
    requests: list[tuple[str, str]]


class _ApiHandler(BaseHTTPRequestHandler):
    server: _ApiServer
    PREFIX = "/apis/apps/v1/namespaces/serving/deployments"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def _route(self) -> tuple[str | None, bool]:
        if not self.path.startswith(self.PREFIX):
            return None, False
        rest = self.path[len(self.PREFIX) :].split("?")[0].strip("/")
        name, _, sub = rest.partition("/")
        return name or None, sub == "scale"

    def _missing(self, name: str) -> None:
        self._send(
            404,
            {
                "kind": "Status",
                "status": "Failure",
                "reason": "NotFound",
                "code": 404,
                "message": f'deployments.apps "{name}" not found',
            },
        )

    def do_GET(self) -> None:
        if self.path.startswith("/api/v1/namespaces/serving/pods"):
            # No pod ever runs here: a scale-down finds none to drain.
            self.server.requests.append(("GET pods", self.path))
            self._send(200, {"kind": "PodList", "apiVersion": "v1", "items": []})
            return
        name, _ = self._route()
        self.server.requests.append(("GET", self.path))
        if name is None or name not in self.server.deployments:
            self._missing(str(name))
            return
        self._send(200, self.server.deployments[name])

    def do_POST(self) -> None:
        body = self._body()
        self.server.requests.append(("POST", self.path))
        self.server.deployments[body["metadata"]["name"]] = body
        self._send(201, body)

    def do_PATCH(self) -> None:
        name, is_scale = self._route()
        body = self._body()
        self.server.requests.append(
            ("PATCH scale" if is_scale else "PATCH", self.headers["Content-Type"])
        )
        if name is None or name not in self.server.deployments:
            self._missing(str(name))
            return
        deployment = self.server.deployments[name]
        if is_scale:
            deployment["spec"]["replicas"] = body["spec"]["replicas"]
            self._send(200, {"kind": "Scale", "spec": body["spec"]})
            return
        self.server.deployments[name] = {**deployment, **body}
        self._send(200, self.server.deployments[name])


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[tuple[_ApiServer, Path]]:
    server = _ApiServer(("127.0.0.1", 0), _ApiHandler)
    server.deployments, server.requests = {}, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "test",
                        "cluster": {"server": f"http://127.0.0.1:{server.server_port}"},
                    }
                ],
                "users": [{"name": "test", "user": {"token": "not-a-secret"}}],
                "contexts": [
                    {"name": "test", "context": {"cluster": "test", "user": "test"}}
                ],
                "current-context": "test",
            }
        )
    )
    try:
        yield server, kubeconfig
    finally:
        server.shutdown()
        server.server_close()


def test_kubernetes_pools_command_follows_the_target_through_the_official_client(
    pool: Pool, api_server: tuple[_ApiServer, Path]
) -> None:
    server, kubeconfig = api_server
    argv = [
        "kubernetes_pools",
        "--once",
        "--region=eu-west",
        "--namespace=serving",
        f"--image={TEMPLATE.image}",
        "--weights-pvc=model-weights",
        f"--kubeconfig={kubeconfig}",
    ]
    out = io.StringIO()
    call_command(*argv, stdout=out)
    assert out.getvalue().strip() == f"{NAME}: create"
    assert server.deployments[NAME]["spec"]["replicas"] == 3

    set_desired(pool, 2)  # the autoscaler scaled down: only the count moves
    server.requests.clear()
    out = io.StringIO()
    call_command(*argv, stdout=out)
    assert out.getvalue().strip() == f"{NAME}: scale"
    # No pod runs, none to drain: the pods are listed, then it scales at once;
    # then the warm nodes' Deployment is read (none); then the beats list the
    # pods again (none to register, none to beat).
    assert [method for method, _ in server.requests] == [
        "GET",
        "GET pods",
        "PATCH scale",
        "GET",
        "GET pods",
    ]
    assert server.deployments[NAME]["spec"]["replicas"] == 2

    out = io.StringIO()
    call_command(*argv, stdout=out)
    assert out.getvalue().strip() == f"{NAME}: none"


def test_kubernetes_pools_command_says_what_is_wrong(
    pool: Pool, api_server: tuple[_ApiServer, Path]
) -> None:
    _, kubeconfig = api_server
    with pytest.raises(CommandError, match="--weights-pvc"):
        call_command(
            "kubernetes_pools",
            "--once",
            "--namespace=serving",
            f"--image={TEMPLATE.image}",
            f"--kubeconfig={kubeconfig}",
        )
    with pytest.raises(CommandError, match="settle_s"):
        call_command(
            "kubernetes_pools",
            "--once",
            "--namespace=serving",
            f"--image={TEMPLATE.image}",
            "--weights-pvc=w",
            "--settle-s=-1",
            f"--kubeconfig={kubeconfig}",
        )
    with pytest.raises(CommandError, match="interval"):
        call_command(
            "kubernetes_pools",
            "--namespace=serving",
            f"--image={TEMPLATE.image}",
            "--weights-pvc=w",
            "--interval-s=0",
            f"--kubeconfig={kubeconfig}",
        )
    for bad, match in (("H100", "REF=PRODUCT"), ("*=H100 80GB", "label value")):
        with pytest.raises(CommandError, match=match):
            call_command(
                "kubernetes_pools",
                "--once",
                "--namespace=serving",
                f"--image={TEMPLATE.image}",
                "--weights-pvc=w",
                f"--gpu-product={bad}",
                f"--kubeconfig={kubeconfig}",
            )


def test_kubernetes_pools_command_without_drain_scales_down_directly(
    pool: Pool, api_server: tuple[_ApiServer, Path]
) -> None:
    server, kubeconfig = api_server
    argv = [
        "kubernetes_pools",
        "--once",
        "--no-drain",
        "--no-beats",
        "--region=eu-west",
        "--namespace=serving",
        f"--image={TEMPLATE.image}",
        "--weights-pvc=model-weights",
        f"--kubeconfig={kubeconfig}",
    ]
    call_command(*argv, stdout=io.StringIO())
    set_desired(pool, 2)
    server.requests.clear()
    out = io.StringIO()
    call_command(*argv, stdout=out)
    assert out.getvalue().strip() == f"{NAME}: scale"
    # Neither drain nor beats: no pods access at all (the last read is the warm
    # nodes' Deployment).
    assert [method for method, _ in server.requests] == ["GET", "PATCH scale", "GET"]
    assert server.deployments[NAME]["spec"]["replicas"] == 2

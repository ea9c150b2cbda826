"""The Kubernetes package (platform/kubernetes/, docs/kubernetes.md), without a cluster.

Each overlay is built with ``kubectl kustomize`` and every object is validated,
strictly (unknown fields fail), against the OpenAPI schemas of three Kubernetes
versions that kubernetes-validate ships: 1.35, 1.36 and 1.37. The pool Deployment
that the actuator renders is validated the same way. The pool actuator's Role is
held equal to what the actuator calls: its loop runs against a recording API
server through scale up, spec change and scale down.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
import yaml
from django.conf import settings
from django.core.management import call_command

from engine_nodes import services
from engine_nodes.domain.k8s import (
    SGLANG_CONFIG_PATH,
    DeploymentTemplate,
    PoolSpec,
    render_deployment,
)
from engine_nodes.domain.k8s_pods import PodFacts, plan_pod_replicas
from engine_nodes.domain.k8s_warm import WARM_PRIORITY_CLASS, render_warm_nodes
from localrun.processes import gateway_argv
from localrun.seeding import VERSION_BODY, version_body
from models_registry import services as registry_services
from models_registry.models import Model, ModelVersion, Pool
from tests.factories import accept

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZE = ROOT / "platform" / "kubernetes"
OVERLAYS = ("region-a", "region-b")
KUBERNETES_VERSIONS = ("1.35.0", "1.36.0", "1.37.0")
NAMESPACE = "llm-platform"
# The drain's one call this run cannot reach: it patches the leaving pod's
# deletion cost (and draining-since) annotations only once a pod is chosen, and
# the recording server has no pods. engine_nodes/tests/test_kubernetes_drain.py
# makes that call against its stateful API. The scale-down's pod list is called
# here.
DRAIN_POD_RULES = frozenset({("", "pods", "patch")})


@functools.cache
def build(kubectl: str, overlay: str) -> tuple[dict[str, Any], ...]:
    """Return the objects ``kubectl kustomize`` builds for an overlay."""
    out = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def find(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    [found] = [o for o in objects if (o["kind"], o["metadata"]["name"]) == (kind, name)]
    return found


def pod_specs(objects: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, Any]]:
    for o in objects:
        if o["kind"] in ("Deployment", "Job", "DaemonSet"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def validate(obj: dict[str, Any]) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_builds_and_validates_strictly(
    overlay: str, kubectl_binary: str
) -> None:
    objects = build(kubectl_binary, overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= kinds
    assert {"PodDisruptionBudget", "NetworkPolicy", "Ingress", "Role"} <= kinds
    assert {"DaemonSet", "ClusterRole", "ClusterRoleBinding"} <= kinds
    for obj in objects:
        validate(obj)
    [config] = [o for o in objects if o["kind"] == "ConfigMap"]
    assert config["data"]["PLATFORM_REGION"] == overlay


def test_a_planted_error_fails_validation(kubectl_binary: str) -> None:
    gateway = find(build(kubectl_binary, "region-a"), "Deployment", "gateway")
    as_string = copy.deepcopy(gateway)
    as_string["spec"]["replicas"] = "2"
    unknown = copy.deepcopy(gateway)
    unknown["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    for bad in (as_string, unknown):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(bad)


@pytest.mark.parametrize(
    "volume",
    [
        {"weights_pvc": "model-weights", "weights_sub_path": "ab12"},
        {
            "weights_host_path": "/var/lib/platform/weights/ab12",
            "weights_hash": "ab" * 32,
            "gpu_product": "NVIDIA-H100-80GB-HBM3",
        },
    ],
)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_rendered_pool_deployment_validates_strictly(
    volume: dict[str, Any], engine: str
) -> None:
    argv = ("vllm", "serve", "/weights/ab12", "--kv-offloading-size", "16")
    if engine == "sglang":
        argv = ("python3", "-m", "sglang.launch_server", "--config", SGLANG_CONFIG_PATH)
    spec = PoolSpec(
        model="chat-7b",
        version="v1",
        region="region-a",
        replicas=2,
        image="vllm/vllm-openai:v0.32.0",
        gpus_per_replica=2,
        argv=argv,
        weights_dir="/weights/ab12",
        engine=engine,
        api_key_secret="platform-secrets",
        **volume,
    )
    validate(render_deployment(namespace=NAMESPACE, spec=spec))
    warm = render_warm_nodes(namespace=NAMESPACE, spec=spec, replicas=3)
    validate(warm)
    assert warm["spec"]["template"]["spec"]["priorityClassName"] == (
        WARM_PRIORITY_CLASS
    )


def test_the_warm_nodes_priority_class_is_below_serving_and_never_preempts(
    kubectl_binary: str,
) -> None:
    objects = build(kubectl_binary, "region-a")
    found = find(objects, "PriorityClass", WARM_PRIORITY_CLASS)
    assert found["value"] < 0  # serving pods run at 0
    assert found["preemptionPolicy"] == "Never"
    assert found["globalDefault"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_beat_is_one_pod_never_two(overlay: str, kubectl_binary: str) -> None:
    beat = find(build(kubectl_binary, overlay), "Deployment", "beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_values_are_shipped(overlay: str, kubectl_binary: str) -> None:
    objects = build(kubectl_binary, overlay)
    assert [o for o in objects if o["kind"] == "Secret"] == []
    refs = set()
    for _, pod in pod_specs(objects):
        for container in pod["containers"]:
            for var in container.get("env", []):
                assert "value" not in var or not _is_secret_name(var["name"]), var
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add(ref["name"])
    assert refs == {"platform-secrets"}


def _is_secret_name(name: str) -> bool:
    return name in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"} or name.endswith(
        ("_KEY", "_TOKEN")
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_as_non_root(overlay: str, kubectl_binary: str) -> None:
    for name, pod in pod_specs(build(kubectl_binary, overlay)):
        pod_context = pod.get("securityContext", {})
        for container in pod["containers"]:
            context = {**pod_context, **container.get("securityContext", {})}
            assert context.get("runAsNonRoot") is True, name
            assert context.get("runAsUser", 1) != 0, name
            assert context.get("allowPrivilegeEscalation") is False, name
            assert context.get("readOnlyRootFilesystem") is True, name


def test_the_processes_run_the_local_command_lines(kubectl_binary: str) -> None:
    """The gateway's command is gateway_argv's, and every Celery queue that
    settings route to (and the default one) has a worker consuming it."""
    objects = build(kubectl_binary, "region-a")
    [gateway] = find(objects, "Deployment", "gateway")["spec"]["template"]["spec"][
        "containers"
    ]
    local = gateway_argv(8000, host="0.0.0.0", log_level="info", server="uvicorn")
    assert gateway["command"] == ["python", *local[1:]]
    queues = {"celery"} | {r["queue"] for r in settings.CELERY_TASK_ROUTES.values()}
    consumed = set()
    for _, pod in pod_specs(objects):
        for container in pod["containers"]:
            command = container["command"]
            if command[:4] == ["celery", "-A", "config", "worker"]:
                [option] = [a for a in command if a.startswith("--queues=")]
                consumed |= set(option.removeprefix("--queues=").split(","))
    assert consumed == queues


def test_the_engine_policy_selects_the_rendered_pool_pods(kubectl_binary: str) -> None:
    policy = find(
        build(kubectl_binary, "region-a"), "NetworkPolicy", "engine-replicas-ingress"
    )
    spec = PoolSpec(
        model="chat-7b",
        version="v1",
        region="region-a",
        replicas=1,
        image="vllm/vllm-openai:v0.32.0",
        gpus_per_replica=1,
        argv=("vllm", "serve", "/weights/ab12"),
        weights_dir="/weights/ab12",
        weights_pvc="model-weights",
    )
    manifest = render_deployment(namespace=NAMESPACE, spec=spec)
    labels = manifest["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= labels.items()


@pytest.mark.django_db
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_traced_pools_engine_exports_its_own_spans(
    engine: str, chat_model: Model
) -> None:
    """GIVEN a template with an OTLP traces endpoint (PLATFORM_TRACES_ENGINE_ENDPOINT
    through ``kubernetes_pools --otlp-traces-endpoint``)
    WHEN a pool's Deployment is rendered, for vLLM and for SGLang
    THEN it validates strictly, the engine gets its own tracing flags (SGLang's
    with --enable-trace) and OTLP over HTTP; without the endpoint, neither."""
    body = version_body(
        version="v1",
        engine_config={**VERSION_BODY["engine_config"], "engine": engine},
    )
    version = accept(registry_services.register_version(model_id="chat-7b", **body))
    pool = Pool.objects.create(
        model_id="chat-7b",
        version=version,
        region="region-a",
        min_replicas=1,
        max_replicas=1,
        desired_replicas=1,
    )
    url = "http://otel-collector.observability:4318/v1/traces"
    flags = {
        "vllm": ["--otlp-traces-endpoint", url],
        "sglang": ["--enable-trace", "--otlp-traces-endpoint", url],
    }[engine]
    for endpoint in (url, ""):
        template = DeploymentTemplate(
            image="vllm/vllm-openai:v0.32.0",
            sglang_image="lmsysorg/sglang:v0.5.9",
            weights_pvc="model-weights",
            otlp_traces_endpoint=endpoint,
        )
        manifest = render_deployment(
            namespace=NAMESPACE, spec=services.kubernetes_pool_spec(pool, template)
        )
        validate(manifest)
        [container] = manifest["spec"]["template"]["spec"]["containers"]
        env = {item["name"]: item.get("value") for item in container["env"]}
        if endpoint:
            assert container["args"][-len(flags) :] == flags
            assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        else:
            assert "--otlp-traces-endpoint" not in container["args"]
            assert "--enable-trace" not in container["args"]
            assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in env


@pytest.mark.django_db
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_kv_events_pool_exposes_its_events_port_to_the_gateway_alone(
    engine: str, chat_model: Model, kubectl_binary: str
) -> None:
    """GIVEN a version with kv_events on (vLLM or SGLang) and its pool's spec
    WHEN its Deployment is rendered and a pod of it is listed
    THEN the Deployment validates strictly, its engine binds the kv-events port
    it exposes, the pod's replica records tcp://<pod IP>:<port>, and the engine
    policy lets the gateway, and nothing else, reach that port."""
    body = version_body(
        version="v1",
        engine_config={
            **VERSION_BODY["engine_config"],
            "engine": engine,
            "kv_events": True,
        },
    )
    version = accept(registry_services.register_version(model_id="chat-7b", **body))
    pool = Pool.objects.create(
        model_id="chat-7b",
        version=version,
        region="region-a",
        min_replicas=1,
        max_replicas=1,
        desired_replicas=1,
    )
    template = DeploymentTemplate(
        image="vllm/vllm-openai:v0.32.0",
        sglang_image="lmsysorg/sglang:v0.5.9",
        weights_pvc="model-weights",
    )
    spec = services.kubernetes_pool_spec(pool, template)
    manifest = render_deployment(namespace=NAMESPACE, spec=spec)
    validate(manifest)
    [container] = manifest["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    kv_port = services.KUBERNETES_KV_EVENTS_PORT
    assert ports == {"http": spec.port, "kv-events": kv_port}
    args = container["args"]
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["endpoint"] == f"tcp://*:{kv_port}"

    pod = PodFacts(
        name=f"{spec.name}-5d4f-a", phase="Running", is_ready=True, pod_ip="10.4.0.9"
    )
    plan = plan_pod_replicas(
        deployment=spec.name,
        port=spec.port,
        kv_events_port=spec.kv_events_port,
        pods=[pod],
        rows={},
    )
    assert [r.kv_events_url for r in plan.replicas] == [f"tcp://10.4.0.9:{kv_port}"]

    policy = find(
        build(kubectl_binary, "region-a"), "NetworkPolicy", "engine-replicas-ingress"
    )
    reaching = [
        rule["from"]
        for rule in policy["spec"]["ingress"]
        if {"port": kv_port, "protocol": "TCP"} in rule["ports"]
    ]
    gateway = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "llm-platform",
                "app.kubernetes.io/component": "gateway",
            }
        }
    }
    assert reaching == [[gateway]]


# --- The pool actuator's Role, against what it calls --------------------------


class _RecordingApi(ThreadingHTTPServer):
    """Any namespaced resource path of a Kubernetes API server, in memory.

    Records (api group, resource[/subresource], verb, namespace) per request, as
    the API server's authorizer sees it.
    """

    objects: dict[str, dict[str, Any]]
    calls: set[tuple[str, str, str, str]]


class _Handler(BaseHTTPRequestHandler):
    server: _RecordingApi

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

    def _record(self, method: str) -> tuple[str, str | None, str]:
        """Record the request; return (collection path, name, subresource)."""
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if parts[0] == "api":  # /api/v1/namespaces/NS/RESOURCE[/NAME[/SUB]]
            group, rest = "", parts[2:]
        else:  # /apis/GROUP/VERSION/namespaces/NS/...
            group, rest = parts[1], parts[3:]
        if rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
            base = len(parts) - len(rest) + 1
        else:  # a cluster-scoped resource (nodes): no namespace
            namespace, base = "", len(parts) - len(rest) + 1
        resource = rest[0]
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else ""
        if method == "GET" and name is None:
            is_watch = parse_qs(url.query).get("watch") == ["true"]
            verb = "watch" if is_watch else "list"
        else:
            verb = {
                "GET": "get",
                "POST": "create",
                "PATCH": "patch",
                "PUT": "update",
                "DELETE": "delete" if name else "deletecollection",
            }[method]
        full = f"{resource}/{sub}" if sub else resource
        self.server.calls.add((group, full, verb, namespace))
        collection = "/".join(parts[:base])
        return collection, name, sub

    def _missing(self) -> None:
        self._send(404, {"kind": "Status", "status": "Failure", "code": 404})

    def do_GET(self) -> None:
        collection, name, _ = self._record("GET")
        if name is None:
            items = [
                o for k, o in self.server.objects.items() if k.startswith(collection)
            ]
            self._send(200, {"kind": "List", "metadata": {}, "items": items})
        elif f"{collection}/{name}" in self.server.objects:
            self._send(200, self.server.objects[f"{collection}/{name}"])
        else:
            self._missing()

    def do_POST(self) -> None:
        collection, _, _ = self._record("POST")
        body = self._body()
        self.server.objects[f"{collection}/{body['metadata']['name']}"] = body
        self._send(201, body)

    def do_PATCH(self) -> None:
        collection, name, sub = self._record("PATCH")
        body = self._body()
        key = f"{collection}/{name}"
        if key not in self.server.objects:
            self._missing()
        elif sub == "scale":
            self.server.objects[key]["spec"]["replicas"] = body["spec"]["replicas"]
            self._send(200, {"kind": "Scale", "metadata": {}, "spec": body["spec"]})
        else:
            self.server.objects[key] = {**self.server.objects[key], **body}
            self._send(200, self.server.objects[key])


@pytest.fixture
def recording_api(tmp_path: Path) -> Iterator[tuple[_RecordingApi, Path]]:
    server = _RecordingApi(("127.0.0.1", 0), _Handler)
    server.objects, server.calls = {}, set()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    cluster = {"server": f"http://127.0.0.1:{server.server_port}"}
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": cluster}],
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


def role_rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.django_db
def test_the_actuator_role_allows_exactly_what_the_actuator_calls(
    chat_v1: ModelVersion,
    recording_api: tuple[_RecordingApi, Path],
    kubectl_binary: str,
) -> None:
    """GIVEN the pool actuator's command line from the manifest, against an API
    server that records each call's group, resource and verb
    WHEN it follows a pool through scale up, a spec change and scale down
    THEN its Role allows exactly those calls plus the drain's pod patch."""
    pytest.importorskip("kubernetes.client")
    server, kubeconfig = recording_api
    objects = build(kubectl_binary, "region-a")
    [container] = find(objects, "Deployment", "pool-actuator")["spec"]["template"][
        "spec"
    ]["containers"]
    assert container["command"][:3] == ["python", "manage.py", "kubernetes_pools"]
    assert "--in-cluster" in container["command"]
    argv = [
        a.replace("$(POD_NAMESPACE)", NAMESPACE)
        for a in container["command"][2:]
        if a != "--in-cluster"
    ]
    argv += ["--once", "--region=region-a", f"--kubeconfig={kubeconfig}"]
    pool = Pool.objects.create(
        model_id="chat-7b",
        version=chat_v1,
        region="region-a",
        min_replicas=1,
        max_replicas=4,
        desired_replicas=1,
    )

    def follow(*extra: str) -> str:
        out = io.StringIO()
        call_command(*argv, *extra, stdout=out)
        return out.getvalue().strip().rpartition(": ")[2]

    assert follow() == "create"
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=3)
    assert follow() == "scale"  # up
    assert follow("--image=vllm/vllm-openai:v0.33.0") == "patch"
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=1)
    assert follow("--image=vllm/vllm-openai:v0.33.0") == "scale"  # down
    # Traces on: the engines' tracing flags change the pod spec.
    traced = "--otlp-traces-endpoint=http://otel-collector:4318/v1/traces"
    assert follow("--image=vllm/vllm-openai:v0.33.0", traced) == "patch"

    assert {namespace for *_, namespace in server.calls} == {NAMESPACE}
    called = {(group, resource, verb) for group, resource, verb, _ in server.calls}
    assert ("apps", "deployments/scale", "patch") in called
    assert ("", "pods", "list") in called  # the drain reads the pool's pods
    role = find(objects, "Role", "pool-actuator")
    assert role_rules(role) == called | DRAIN_POD_RULES
    binding = find(objects, "RoleBinding", "pool-actuator")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pool-actuator", "namespace": NAMESPACE}
    ]


# --- The weights DaemonSet ------------------------------------------------------


def test_the_weights_daemon_set_fills_the_cache_the_pool_pods_mount(
    kubectl_binary: str,
) -> None:
    objects = build(kubectl_binary, "region-a")
    pod = find(objects, "DaemonSet", "weights-prefetch")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    [cache] = [a for a in container["command"] if a.startswith("--cache-dir=")]
    [actuator] = find(objects, "Deployment", "pool-actuator")["spec"]["template"][
        "spec"
    ]["containers"]
    host_root = cache.removeprefix("--cache-dir=")
    assert f"--weights-host-root={host_root}" in actuator["command"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "weights"]
    assert volume["hostPath"] == {"path": host_root, "type": "Directory"}
    assert {"name": "weights", "mountPath": host_root} in container["volumeMounts"]
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


@pytest.mark.django_db
def test_the_weights_cluster_role_allows_exactly_what_the_prefetch_calls(
    chat_model: Any,
    tmp_path: Path,
    settings: Any,
    recording_api: tuple[_RecordingApi, Path],
    kubectl_binary: str,
) -> None:
    """GIVEN the weights DaemonSet's command line, against an API server that
    records each call, and a pool whose version's weights are on a file:// root
    WHEN it runs once for its node
    THEN the node is labelled with the weights, and its ClusterRole allows
    exactly the calls it made (nodes get and patch), bound to its account."""
    pytest.importorskip("kubernetes.client")
    from engine_nodes.domain.k8s_placement import weights_label
    from engine_nodes.tests.test_agent import file_version

    server, kubeconfig = recording_api
    server.objects["api/v1/nodes/gpu-1"] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "gpu-1", "labels": {}},
    }
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    version = file_version(tmp_path)
    Pool.objects.create(
        model_id="chat-7b", version=version, region="region-a", min_replicas=0
    )
    objects = build(kubectl_binary, "region-a")
    [container] = find(objects, "DaemonSet", "weights-prefetch")["spec"]["template"][
        "spec"
    ]["containers"]
    argv = [
        a
        for a in container["command"][2:]
        if a != "--in-cluster" and not a.startswith("--cache-dir=")
    ]
    assert "--node=$(NODE_NAME)" in argv
    argv.remove("--node=$(NODE_NAME)")
    call_command(
        *argv,
        "--once",
        "--region=region-a",
        "--node=gpu-1",
        f"--cache-dir={tmp_path / 'cache'}",
        f"--kubeconfig={kubeconfig}",
        stdout=io.StringIO(),
    )
    node = server.objects["api/v1/nodes/gpu-1"]
    assert node["metadata"]["labels"] == {
        weights_label(version.weights_hash): "verified"
    }
    assert server.calls == {("", "nodes", "get", ""), ("", "nodes", "patch", "")}
    role = find(objects, "ClusterRole", "llm-platform-weights-prefetch")
    assert role_rules(role) == {("", "nodes", "get"), ("", "nodes", "patch")}
    binding = find(objects, "ClusterRoleBinding", "llm-platform-weights-prefetch")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "weights-prefetch", "namespace": NAMESPACE}
    ]

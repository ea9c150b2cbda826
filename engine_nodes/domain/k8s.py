"""A pool as a Kubernetes Deployment: one Deployment per (model, version, region).

Public surface: ``PoolSpec``, ``DeploymentTemplate``, ``FollowAction``,
``render_deployment``, ``deployment_name``, ``label_value``, ``pool_labels``,
``spec_digest``, ``scale_body``, ``follow_action``, ``SPEC_DIGEST_ANNOTATION``.

The manifest is a plain dict in the API's camelCase shape, ready for
``AppsV1Api.create_namespaced_deployment(body=...)`` or ``kubectl apply``. It runs
``argv`` (from ``replica_argv.vllm_serve_argv``, or ``sglang_launch_argv`` for a
version whose engine is SGLang) in a container named after the engine (``vllm``
or ``sglang``; the image is the template's ``image`` or ``sglang_image``):

- ``resources``: ``nvidia.com/gpu`` = ``gpus_per_replica`` in both requests and
  limits (extended resources must have them equal), written as a string quantity,
  as the API returns it; with CPU offloading of the KV cache (``--kv-offloading-size
  N`` in ``argv``, passed through like every flag) a ``memory`` request of ``N``
  GiB (in whole MiB, rounded up), so the pod lands on a node with that much host
  memory for vLLM's pinned offload buffer (no limit: the process needs more);
- with ``kv_events_port`` (a version with ``kv_events``: its engine publishes
  KV-cache events there, ``replica_argv.kv_events_config_for``) a second
  containerPort named ``kv-events``, where the gateways subscribe on the pod's IP;
- probes on ``GET /health``: a startup probe that allows ``startup_timeout_s``
  (weights load and CUDA graph capture take minutes), then readiness (out of the
  Service within ~15 s) and liveness (restart after ~60 s of failures);
- the weights volume (a PVC or a host path) mounted read-only at ``weights_dir``,
  and ``/dev/shm`` as an in-memory emptyDir, which tensor parallelism needs (the
  container runtime's default 64 MiB is too small for NCCL);
- ``terminationGracePeriodSeconds`` = ``drain_s``, so in-flight streams can finish
  after SIGTERM; vLLM exits on SIGTERM once its server stops;
- ``env``: the engine's own settings beside the platform's offline ones (with
  traces on, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, ``replica_argv.engine_trace_env``);
- the engine API key from a Secret (``api_key_secret``, never its value): vLLM
  reads ``VLLM_API_KEY``; SGLang reads ``--config SGLANG_CONFIG_PATH``, a file an
  init container writes into an in-memory emptyDir from the same Secret key;
- placement (``engine_nodes.domain.k8s_placement``): the GPU type as a required
  node affinity, nodes holding the weights preferred, replicas spread over nodes,
  the GPU taint tolerated.

The selector labels (name, model, version, region) never change for a given
Deployment name: a Deployment's selector is immutable, so patching stays legal.

The Deployment's ``replicas`` follow the pool's target (``Pool.target_replicas``,
which the autoscaler moves). ``follow_action`` says what brings a Deployment
there: create it when absent; patch the whole manifest when anything but the
replica count changed (``spec_digest``, kept in the ``platform/spec-digest``
annotation, leaves the count out); else patch only the scale subresource
(``scale_body``) when the count differs; else nothing. A scale-down goes through
``engine_nodes.domain.k8s_drain``: the leaving pod's replica is drained first (its
streams finish or ``drain_s`` passes), then its pod-deletion-cost makes it the pod
the controller removes; ``terminationGracePeriodSeconds`` still covers a pod
stopped otherwise (a rollout, a node drain).
"""

from __future__ import annotations

import copy
import enum
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from engine_nodes.domain.k8s_placement import (
    is_label_value,
    pod_affinity_fields,
    weights_label,
)

__all__ = [
    "APP_NAME",
    "CONTAINER_NAME",
    "ENGINE_CONTAINERS",
    "KV_EVENTS_PORT_NAME",
    "MAX_NAME_LEN",
    "SGLANG_CONFIG_PATH",
    "SPEC_DIGEST_ANNOTATION",
    "DeploymentTemplate",
    "FollowAction",
    "PoolSpec",
    "deployment_name",
    "follow_action",
    "label_value",
    "pool_labels",
    "render_deployment",
    "scale_body",
    "spec_digest",
]

APP_NAME = "vllm"
CONTAINER_NAME = "vllm"
# The engine's container name (a vLLM pool's stays "vllm", as it always was).
ENGINE_CONTAINERS = {"vllm": CONTAINER_NAME, "sglang": "sglang"}
# The engine container's port of KV-cache events (a version with kv_events).
KV_EVENTS_PORT_NAME = "kv-events"
MANAGED_BY = "gpu-serving-platform"
MAX_NAME_LEN = 63
GPU_RESOURCE = "nvidia.com/gpu"
SPEC_DIGEST_ANNOTATION = "platform/spec-digest"
HEALTH_PATH = "/health"
STARTUP_PERIOD_S = 10
# SGLang takes its API key from a YAML file of server arguments (``--config``);
# JSON is YAML. In an in-memory emptyDir: the key never reaches a disk.
SGLANG_CONFIG_DIR = "/run/engine"
SGLANG_CONFIG_PATH = f"{SGLANG_CONFIG_DIR}/sglang.yaml"
_WRITE_SGLANG_CONFIG = (
    "import json, os; "
    f"fd = os.open({SGLANG_CONFIG_PATH!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "
    "0o600); "
    "os.write(fd, json.dumps({'api-key': os.environ['ENGINE_API_KEY']}).encode()); "
    "os.close(fd)"
)

_INVALID_NAME_CHARS = re.compile(r"[^a-z0-9-]+")
_INVALID_LABEL_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# Engine replicas read weights from the verified volume; they never reach the Hub.
_CONTAINER_ENV = (
    ("DO_NOT_TRACK", "1"),
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("VLLM_NO_USAGE_STATS", "1"),
)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The desired replicas of one version in one region, as a workload.

    Invariants (``ValueError`` otherwise): ``replicas >= 0``,
    ``gpus_per_replica >= 1``, ``argv`` is non-empty, ``weights_dir`` is absolute,
    exactly one of ``weights_pvc`` / ``weights_host_path`` is set, ``port`` is a
    valid port, ``startup_timeout_s`` and ``drain_s`` are positive,
    ``gpu_product`` is a label value, an SGLang pool with ``api_key_secret`` has
    ``--config SGLANG_CONFIG_PATH`` in its argv, ``kv_events_port`` is 0 (no KV
    events) or a valid port other than ``port``, ``env`` names are C identifiers.
    """

    model: str
    version: str
    region: str
    replicas: int
    image: str
    gpus_per_replica: int
    argv: tuple[str, ...]
    weights_dir: str
    weights_pvc: str | None = None
    weights_host_path: str | None = None
    weights_sub_path: str = ""
    port: int = 8000
    startup_timeout_s: int = 300
    drain_s: int = 120
    shm_size: str | None = "8Gi"
    engine: str = "vllm"  # the container's name: "vllm" or "sglang"
    # The Secret and key holding the engine API key; None: /v1 is left open.
    api_key_secret: str | None = None
    api_key_secret_key: str = "engine-api-key"
    gpu_product: str | None = None  # required: nvidia.com/gpu.product
    weights_hash: str = ""  # preferred: nodes labelled as holding it
    kv_events_port: int = 0  # where the engine publishes KV events; 0: it does not
    # The engine's own environment, (name, value) pairs, after the platform's.
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "env", tuple(tuple(pair) for pair in self.env))
        for key, _ in self.env:
            if not _ENV_NAME.match(key):
                raise ValueError(f"env name {key!r} is no C identifier")
        if self.gpu_product is not None and not (
            self.gpu_product and is_label_value(self.gpu_product)
        ):
            raise ValueError(f"gpu_product {self.gpu_product!r} is no label value")
        if self.weights_hash:
            weights_label(self.weights_hash)  # ValueError unless a SHA-256
        if (
            self.engine == "sglang"
            and self.api_key_secret
            and not _has_flag(self.argv, "--config", SGLANG_CONFIG_PATH)
        ):
            raise ValueError(
                f"an sglang pool's key needs --config {SGLANG_CONFIG_PATH}"
            )
        if self.engine not in ENGINE_CONTAINERS:
            raise ValueError(
                f"engine must be one of {list(ENGINE_CONTAINERS)}, not {self.engine!r}"
            )
        if self.replicas < 0:
            raise ValueError("replicas must not be negative")
        if self.gpus_per_replica < 1:
            raise ValueError("gpus_per_replica must be at least 1")
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError("argv must be a non-empty sequence of strings")
        if not self.image:
            raise ValueError("image must not be empty")
        if not self.weights_dir.startswith("/"):
            raise ValueError("weights_dir must be an absolute path in the container")
        if (self.weights_pvc is None) == (self.weights_host_path is None):
            raise ValueError("set exactly one of weights_pvc and weights_host_path")
        if self.weights_sub_path and self.weights_pvc is None:
            raise ValueError("weights_sub_path applies to a PVC only")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is out of range")
        if self.kv_events_port and not (
            1 <= self.kv_events_port <= 65535 and self.kv_events_port != self.port
        ):
            raise ValueError(f"kv_events_port {self.kv_events_port} is no free port")
        if self.startup_timeout_s < 1 or self.drain_s < 1:
            raise ValueError("startup_timeout_s and drain_s must be positive")

    @property
    def name(self) -> str:
        """Return the Deployment name, ``vllm-<model>-<version>-<region>``."""
        return deployment_name(self.model, self.version, self.region)


@dataclass(frozen=True, slots=True)
class DeploymentTemplate:
    """What every pool's Deployment in a cluster shares: image, weights volume, ports.

    Weights are laid out as the node agents' caches are, one directory per
    ``weights_hash``: on a PVC (``weights_pvc``, mounted with that directory as
    its ``subPath``) or on each GPU node's disk (``weights_host_root``, the warm
    pool's cache). Exactly one of the two is set (``ValueError`` otherwise).
    """

    image: str
    weights_pvc: str | None = None
    weights_host_root: str | None = None
    weights_mount: str = "/weights"
    port: int = 8000
    startup_timeout_s: int = 300
    drain_s: int = 600
    # The image of SGLang versions (e.g. lmsysorg/sglang:<tag>); None: refused.
    sglang_image: str | None = None
    # The Secret holding the engine API key (platform/kubernetes/base's names).
    api_key_secret: str | None = "platform-secrets"
    api_key_secret_key: str = "engine-api-key"
    # GPU type by ``model@version``, ``model`` or ``*`` (the most specific wins).
    gpu_products: tuple[tuple[str, str], ...] = ()
    # Where the engines export their own spans (OTLP/HTTP); empty: none.
    otlp_traces_endpoint: str = ""

    def __post_init__(self) -> None:
        if (self.weights_pvc is None) == (self.weights_host_root is None):
            raise ValueError("set exactly one of weights_pvc and weights_host_root")
        if not self.weights_mount.startswith("/"):
            raise ValueError("weights_mount must be an absolute path")
        for ref, product in self.gpu_products:
            if not (product and is_label_value(product)):
                raise ValueError(f"GPU type {product!r} of {ref!r} is no label value")

    def gpu_product_for(self, model: str, version: str) -> str | None:
        """Return the GPU type a version's pods need (``gpu_products``), or None."""
        products = dict(self.gpu_products)
        for ref in (f"{model}@{version}", model, "*"):
            if ref in products:
                return products[ref]
        return None

    def image_for(self, engine: str) -> str:
        """Return the image that runs ``engine``.

        Raises:
            ValueError: an SGLang version, and no ``sglang_image`` is set.
        """
        if engine != "sglang":
            return self.image
        if not self.sglang_image:
            raise ValueError(
                "this version runs on sglang and no SGLang image is set "
                "(kubernetes_pools --sglang-image)"
            )
        return self.sglang_image

    def weights_dir(self, weights_hash: str) -> str:
        """Return where a version's weights appear inside the container."""
        return f"{self.weights_mount.rstrip('/')}/{weights_hash}"

    def volume(self, weights_hash: str) -> dict[str, str]:
        """Return the ``PoolSpec`` volume fields for a version's weights."""
        if self.weights_pvc is not None:
            return {"weights_pvc": self.weights_pvc, "weights_sub_path": weights_hash}
        assert self.weights_host_root is not None
        return {
            "weights_host_path": f"{self.weights_host_root.rstrip('/')}/{weights_hash}"
        }


class FollowAction(enum.StrEnum):
    """What brings a pool's Deployment to its spec."""

    CREATE = "create"  # absent
    PATCH = "patch"  # the manifest changed beyond its replica count
    SCALE = "scale"  # only the replica count differs
    NONE = "none"  # as wanted


def deployment_name(model: str, version: str, region: str) -> str:
    """Return a DNS-1123 label (<= 63 chars) naming the pool's Deployment.

    ``vllm-<model>-<version>-<region>``, lowercased, with every run of characters
    outside ``[a-z0-9-]`` replaced by ``-``. A name that would be longer than 63
    characters is cut and suffixed with 8 hex digits of its SHA-256, so two long
    names that share a prefix still differ.
    """
    raw = f"{APP_NAME}-{model}-{version}-{region}".lower()
    name = _INVALID_NAME_CHARS.sub("-", raw)
    name = re.sub(r"-{2,}", "-", name).strip("-")
    if len(name) > MAX_NAME_LEN:
        digest = hashlib.sha256(raw.encode("utf-8")).hexdigest()[:8]
        name = f"{name[: MAX_NAME_LEN - 9].rstrip('-')}-{digest}"
    if _DNS_1123_LABEL.fullmatch(name) is None:  # pragma: no cover - by construction
        raise ValueError(f"{name!r} is not a DNS-1123 label")
    return name


def label_value(text: str) -> str:
    """Return ``text`` as a valid label value: <= 63 chars of ``[A-Za-z0-9._-]``.

    Invalid runs become ``-``; leading and trailing non-alphanumerics are dropped.
    """
    value = _INVALID_LABEL_CHARS.sub("-", text)[:MAX_NAME_LEN]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def pool_labels(spec: PoolSpec) -> dict[str, str]:
    """Return the selector labels that identify the pool's pods."""
    return {
        "app.kubernetes.io/name": APP_NAME,
        "platform/model": label_value(spec.model),
        "platform/version": label_value(spec.version),
        "platform/region": label_value(spec.region),
    }


def render_deployment(*, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """Return the ``apps/v1`` Deployment manifest for ``spec`` in ``namespace``."""
    name = spec.name
    selector = pool_labels(spec)
    labels = {
        **selector,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    gpus = str(spec.gpus_per_replica)
    requests: dict[str, str] = {GPU_RESOURCE: gpus}
    offload = _offload_memory(spec.argv)
    if offload is not None:
        requests["memory"] = offload
    ports: list[dict[str, Any]] = [
        {"name": "http", "containerPort": spec.port, "protocol": "TCP"}
    ]
    if spec.kv_events_port:
        ports.append(
            {
                "name": KV_EVENTS_PORT_NAME,
                "containerPort": spec.kv_events_port,
                "protocol": "TCP",
            }
        )
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINERS[spec.engine],
        "image": spec.image,
        "command": [spec.argv[0]],
        "args": list(spec.argv[1:]),
        "env": [
            {"name": key, "value": value} for key, value in (*_CONTAINER_ENV, *spec.env)
        ],
        "ports": ports,
        "resources": {
            "limits": {GPU_RESOURCE: gpus},
            "requests": requests,
        },
        "startupProbe": _health_probe(
            period_s=STARTUP_PERIOD_S,
            failure_threshold=math.ceil(spec.startup_timeout_s / STARTUP_PERIOD_S),
        ),
        "readinessProbe": _health_probe(period_s=5, failure_threshold=3),
        "livenessProbe": _health_probe(period_s=10, failure_threshold=6),
        "volumeMounts": _volume_mounts(spec),
    }
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.drain_s,
        "containers": [container],
        "volumes": _volumes(spec),
        "tolerations": [
            {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        ],
        **pod_affinity_fields(
            selector=selector,
            gpu_product=spec.gpu_product,
            weights_hash=spec.weights_hash,
        ),
    }
    if spec.api_key_secret:
        key_ref = {
            "secretKeyRef": {
                "name": spec.api_key_secret,
                "key": spec.api_key_secret_key,
            }
        }
        if spec.engine == "sglang":
            _add_sglang_config(pod, container, key_ref)
        else:
            container["env"].append({"name": "VLLM_API_KEY", "valueFrom": key_ref})
    manifest: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector},
            # Keep serving capacity while pods are replaced; a surge pod waits for
            # a free GPU rather than taking a serving replica down first.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(spec.port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod,
            },
        },
    }
    manifest["metadata"]["annotations"] = {
        SPEC_DIGEST_ANNOTATION: spec_digest(manifest)
    }
    return manifest


def spec_digest(manifest: dict[str, Any]) -> str:
    """Return the SHA-256 of a Deployment manifest less its replica count.

    Two manifests with the same digest differ at most in ``spec.replicas`` (and
    in this annotation), so a change of size alone needs only a scale patch.
    """
    body = copy.deepcopy(manifest)
    body.get("spec", {}).pop("replicas", None)
    body.get("metadata", {}).get("annotations", {}).pop(SPEC_DIGEST_ANNOTATION, None)
    if not body.get("metadata", {}).get("annotations", True):
        del body["metadata"]["annotations"]
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def scale_body(replicas: int) -> dict[str, Any]:
    """Return the scale subresource patch that sets a Deployment's replica count."""
    if replicas < 0:
        raise ValueError("replicas must not be negative")
    return {"spec": {"replicas": replicas}}


def follow_action(
    manifest: dict[str, Any],
    *,
    existing_digest: str | None,
    existing_replicas: int | None,
    is_present: bool,
) -> FollowAction:
    """Return what brings the Deployment in the cluster to ``manifest``.

    ``existing_digest`` is the live object's ``platform/spec-digest`` annotation
    (None when it has none: written by hand or by an older platform, so it is
    patched whole) and ``existing_replicas`` its ``spec.replicas``.
    """
    if not is_present:
        return FollowAction.CREATE
    if existing_digest != manifest["metadata"]["annotations"][SPEC_DIGEST_ANNOTATION]:
        return FollowAction.PATCH
    if existing_replicas != manifest["spec"]["replicas"]:
        return FollowAction.SCALE
    return FollowAction.NONE


def _has_flag(argv: tuple[str, ...], flag: str, value: str) -> bool:
    return any(a == flag and b == value for a, b in itertools.pairwise(argv))


def _add_sglang_config(
    pod: dict[str, Any], container: dict[str, Any], key_ref: dict[str, Any]
) -> None:
    """Write SGLang's ``--config`` (its API key) in an init container."""
    mount = {"name": "engine-config", "mountPath": SGLANG_CONFIG_DIR}
    pod["initContainers"] = [
        {
            "name": "sglang-config",
            "image": container["image"],
            "command": ["python3", "-c", _WRITE_SGLANG_CONFIG],
            "env": [{"name": "ENGINE_API_KEY", "valueFrom": key_ref}],
            "volumeMounts": [mount],
        }
    ]
    pod["volumes"].append(
        {"name": "engine-config", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
    )
    container["volumeMounts"].append({**mount, "readOnly": True})


def _offload_memory(argv: tuple[str, ...]) -> str | None:
    """Return the memory quantity of ``--kv-offloading-size`` GiB, or None."""
    value: str | None = None
    for k, arg in enumerate(argv):
        if arg == "--kv-offloading-size" and k + 1 < len(argv):
            value = argv[k + 1]
        elif arg.startswith("--kv-offloading-size="):
            value = arg.partition("=")[2]
    if value is None:
        return None
    try:
        gib = float(value)
    except ValueError:
        return None  # vLLM refuses it at start; nothing to reserve
    if not math.isfinite(gib) or gib <= 0:
        return None
    return f"{math.ceil(gib * 1024)}Mi"


def _health_probe(*, period_s: int, failure_threshold: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }


def _volume_mounts(spec: PoolSpec) -> list[dict[str, Any]]:
    weights: dict[str, Any] = {
        "name": "weights",
        "mountPath": spec.weights_dir,
        "readOnly": True,
    }
    if spec.weights_sub_path:
        weights["subPath"] = spec.weights_sub_path
    return [weights, {"name": "dshm", "mountPath": "/dev/shm"}]


def _volumes(spec: PoolSpec) -> list[dict[str, Any]]:
    weights: dict[str, Any] = {"name": "weights"}
    if spec.weights_pvc is not None:
        weights["persistentVolumeClaim"] = {
            "claimName": spec.weights_pvc,
            "readOnly": True,
        }
    else:
        weights["hostPath"] = {"path": spec.weights_host_path, "type": "Directory"}
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.shm_size is not None:
        shm["sizeLimit"] = spec.shm_size
    return [weights, {"name": "dshm", "emptyDir": shm}]

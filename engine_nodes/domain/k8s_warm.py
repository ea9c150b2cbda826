"""A pool's warm nodes on Kubernetes: placeholders that keep GPU nodes up and ready.

Public surface: ``WARM_PRIORITY_CLASS``, ``PAUSE_IMAGE``, ``warm_deployment_name``,
``warm_labels``, ``render_warm_nodes``.

The autoscaler's policy asks, per pool, for a number of idle warm nodes
(``models_registry.domain.warm_nodes``): GPU nodes that are up, with the
version's weights on their disk, so that a new replica costs load and warm-up
instead of a node start. On Kubernetes that is the cluster-overprovisioning
pattern: a Deployment of placeholder pods (``pause``), each requesting the GPUs
of one replica on the version's GPU type, at a priority below every serving pod
(``WARM_PRIORITY_CLASS``, a negative value, ``platform/kubernetes/base``). The
cluster autoscaler keeps nodes up for them; the weights DaemonSet
(``manage.py prefetch_weights``) fills each GPU node's cache; when a replica of
the pool needs the GPUs the scheduler preempts a placeholder (it may: its
priority is higher), and the replica starts on a node that is up and holds its
weights. The placeholder then waits, Pending, for the next node: the cluster
autoscaler's cue to bring one up, ahead of need again.

The placeholders prefer the nodes that hold the version's weights, as the pool's
pods do (``k8s_placement.pod_affinity_fields``), and spread over nodes. Their
labels are not the pool's (``app.kubernetes.io/name: warm-node``), so the pool's
Deployment never counts them. The manifest carries the same
``platform/spec-digest`` annotation as a pool's (``k8s.spec_digest``), so
``k8s.follow_action`` says how to bring it to its count.
"""

from __future__ import annotations

from typing import Any

from engine_nodes.domain.k8s import (
    MANAGED_BY,
    MAX_NAME_LEN,
    SPEC_DIGEST_ANNOTATION,
    PoolSpec,
    label_value,
    spec_digest,
)
from engine_nodes.domain.k8s_placement import pod_affinity_fields

__all__ = [
    "PAUSE_IMAGE",
    "WARM_NAME",
    "WARM_PRIORITY_CLASS",
    "render_warm_nodes",
    "warm_deployment_name",
    "warm_labels",
]

WARM_NAME = "warm-node"
WARM_PRIORITY_CLASS = "platform-warm-node"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
_GPU_RESOURCE = "nvidia.com/gpu"


def warm_deployment_name(spec: PoolSpec) -> str:
    """Return the placeholders' Deployment name: the pool's, ``vllm-`` -> ``warm-``.

    The pool's name is a DNS-1123 label of at most 63 characters starting with
    ``vllm-``; swapping that prefix keeps both properties.
    """
    name = f"warm-{spec.name.removeprefix('vllm-')}"
    if len(name) > MAX_NAME_LEN:  # pragma: no cover - same length by construction
        raise ValueError(f"{name!r} is too long")
    return name


def warm_labels(spec: PoolSpec) -> dict[str, str]:
    """Return the selector labels of a pool's placeholder pods."""
    return {
        "app.kubernetes.io/name": WARM_NAME,
        "platform/model": label_value(spec.model),
        "platform/version": label_value(spec.version),
        "platform/region": label_value(spec.region),
    }


def render_warm_nodes(
    *,
    namespace: str,
    spec: PoolSpec,
    replicas: int,
    priority_class: str = WARM_PRIORITY_CLASS,
    image: str = PAUSE_IMAGE,
) -> dict[str, Any]:
    """Return the ``apps/v1`` Deployment of ``replicas`` placeholders for ``spec``'s
    pool: each holds one replica's GPUs on its GPU type, at ``priority_class``.

    Raises:
        ValueError: ``replicas`` is negative.
    """
    if replicas < 0:
        raise ValueError("replicas must not be negative")
    name = warm_deployment_name(spec)
    selector = warm_labels(spec)
    labels = {
        **selector,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/component": "warm-node",
    }
    gpus = {_GPU_RESOURCE: str(spec.gpus_per_replica)}
    container = {
        "name": "pause",
        "image": image,
        "resources": {
            "limits": dict(gpus),
            "requests": {**gpus, "cpu": "10m", "memory": "16Mi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": 65535,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod: dict[str, Any] = {
        "priorityClassName": priority_class,
        # A preempted placeholder holds nothing worth waiting for.
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "containers": [container],
        "tolerations": [
            {"key": _GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        ],
        **pod_affinity_fields(
            selector=selector,
            gpu_product=spec.gpu_product,
            weights_hash=spec.weights_hash,
        ),
    }
    manifest: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    manifest["metadata"]["annotations"] = {
        SPEC_DIGEST_ANNOTATION: spec_digest(manifest)
    }
    return manifest

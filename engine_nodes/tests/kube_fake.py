"""A stateful in-memory Kubernetes API: Deployments (and their scale) and pods.

It answers as ``AppsV1Api`` and ``CoreV1Api`` do, with the official client's models
(``V1Deployment``, ``V1Scale``, ``V1PodList``), and enforces what the pool actuator
relies on:

- a Deployment's ``spec.selector`` is immutable: a patch that changes it is a 422;
- a write whose ``metadata.resourceVersion`` is not the object's current one is a
  409 (``interfere`` makes another writer move it between a read and a write);
- the ReplicaSet controller, at once after every write: pods are created up to
  ``spec.replicas`` (ready, newest last) and, on a scale-down, removed in
  Kubernetes' order as far as it matters here: unready first, then the lowest
  ``controller.kubernetes.io/pod-deletion-cost``, then the newest; a changed
  pod template replaces every pod (an instant rollout);
- a removed pod's open streams end with the gateway's error event (``cut``).

Why not PyPI ``kmock``: its stateful mode stores objects but keeps no
``resourceVersion`` (no 409), no subresources, no immutable fields and no
controller, and it serves over aiohttp: the behaviours above would all be ours.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
from collections.abc import Callable
from typing import Any

from kubernetes import client

COST = "controller.kubernetes.io/pod-deletion-cost"
EPOCH = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


class ApiError(Exception):
    """Stands for ``kubernetes.client.exceptions.ApiException``: its ``status``."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"({status}) {reason}")
        self.status = status
        self.reason = reason


class KubeFake:
    """One namespace's Deployments and pods; every call recorded in ``calls``."""

    def __init__(self) -> None:
        self.api_client = client.ApiClient()
        self.deployments: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.owner: dict[str, str] = {}
        self.streams: dict[str, int] = {}
        self.removed: list[str] = []
        self.cut: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []
        self.interfere: list[Callable[[], None]] = []
        self._version = 0
        self._created = 0

    # -- apps/v1 -----------------------------------------------------------------

    def read_namespaced_deployment(self, name: str, namespace: str) -> Any:
        self.calls.append(("get deployments", name))
        return self._model(self._deployment(name), "V1Deployment")

    def create_namespaced_deployment(self, namespace: str, body: Any) -> Any:
        name = body["metadata"]["name"]
        self.calls.append(("create deployments", name))
        self._write()
        if name in self.deployments:
            raise ApiError(409, "AlreadyExists")
        deployment = copy.deepcopy(body)
        deployment["metadata"]["generation"] = 1
        deployment["metadata"]["resourceVersion"] = self._next_version()
        self.deployments[name] = deployment
        self._reconcile(name)
        return self._model(deployment, "V1Deployment")

    def patch_namespaced_deployment(self, name: str, namespace: str, body: Any) -> Any:
        self.calls.append(("patch deployments", name))
        self._write()
        deployment = self._deployment(name)
        self._check_version(deployment, body)
        merged = _merge(deployment, body)
        if merged["spec"]["selector"] != deployment["spec"]["selector"]:
            raise ApiError(422, "Invalid: spec.selector: field is immutable")
        merged["metadata"]["resourceVersion"] = self._next_version()
        if merged["spec"] != deployment["spec"]:
            merged["metadata"]["generation"] = deployment["metadata"]["generation"] + 1
        self.deployments[name] = merged
        self._reconcile(name)
        return self._model(merged, "V1Deployment")

    def patch_namespaced_deployment_scale(
        self, name: str, namespace: str, body: Any
    ) -> Any:
        self.calls.append(("patch deployments/scale", name))
        self._write()
        deployment = self._deployment(name)
        self._check_version(deployment, body)
        deployment["spec"]["replicas"] = body["spec"]["replicas"]
        deployment["metadata"]["resourceVersion"] = self._next_version()
        self._reconcile(name)
        scale = {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                "name": name,
                "resourceVersion": deployment["metadata"]["resourceVersion"],
            },
            "spec": {"replicas": deployment["spec"]["replicas"]},
        }
        return self._model(scale, "V1Scale")

    def delete_namespaced_deployment(self, name: str, namespace: str) -> Any:
        self.calls.append(("delete deployments", name))
        self._deployment(name)
        for pod in [p for p, owner in self.owner.items() if owner == name]:
            self._remove(pod)
        del self.deployments[name]

    # -- v1 pods -----------------------------------------------------------------

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> Any:
        self.calls.append(("list pods", label_selector))
        wanted = dict(term.split("=", 1) for term in label_selector.split(","))
        items = [
            pod
            for pod in self.pods.values()
            if wanted.items() <= pod["metadata"]["labels"].items()
        ]
        body = {"apiVersion": "v1", "kind": "PodList", "items": items}
        return self._model(body, "V1PodList")

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any) -> Any:
        self.calls.append(("patch pods", name))
        self._write()
        if name not in self.pods:
            raise ApiError(404, "NotFound")
        pod = self.pods[name]
        self._check_version(pod, body)
        merged = _merge(pod, body)
        merged["metadata"]["resourceVersion"] = self._next_version()
        self.pods[name] = merged
        return self._model(merged, "V1Pod")

    # -- the test's hands ------------------------------------------------------------

    def pods_of(self, deployment: str) -> list[str]:
        """Return the names of ``deployment``'s pods, oldest first."""
        return [pod for pod, owner in self.owner.items() if owner == deployment]

    def set_ready(self, pod: str, *, is_ready: bool) -> None:
        """Make a pod pass or fail its readiness probe."""
        conditions = self.pods[pod]["status"]["conditions"]
        conditions[0]["status"] = "True" if is_ready else "False"

    def place(self, pod: str, *, ip: str, node: str = "gpu-1") -> None:
        """Schedule a pod on ``node`` and give it ``ip`` (the kubelet's part)."""
        self.pods[pod]["spec"]["nodeName"] = node
        self.pods[pod]["status"]["podIP"] = ip

    def annotations(self, pod: str) -> dict[str, str]:
        """Return a pod's annotations."""
        return dict(self.pods[pod]["metadata"].get("annotations") or {})

    # -- the controller --------------------------------------------------------------

    def _reconcile(self, name: str) -> None:
        """Do what the Deployment and ReplicaSet controllers would, at once."""
        deployment = self.deployments[name]
        template = deployment["spec"]["template"]
        template_hash = hashlib.sha256(
            json.dumps(template, sort_keys=True).encode()
        ).hexdigest()[:10]
        for pod in self.pods_of(name):
            labels = self.pods[pod]["metadata"]["labels"]
            if labels["pod-template-hash"] != template_hash:
                self._remove(pod)  # a rollout, all at once
        owned = self.pods_of(name)
        while len(owned) < deployment["spec"]["replicas"]:
            owned.append(self._create_pod(name, template, template_hash))
        excess = len(owned) - deployment["spec"]["replicas"]
        for pod in sorted(owned, key=self._deletion_rank)[: max(excess, 0)]:
            self._remove(pod)

    def _deletion_rank(self, name: str) -> tuple[bool, int, float]:
        pod = self.pods[name]
        is_ready = pod["status"]["conditions"][0]["status"] == "True"
        cost = int((pod["metadata"].get("annotations") or {}).get(COST, "0"))
        created = dt.datetime.fromisoformat(pod["metadata"]["creationTimestamp"])
        return (is_ready, cost, -created.timestamp())

    def _create_pod(self, owner: str, template: dict[str, Any], hash_: str) -> str:
        self._created += 1
        name = f"{owner}-{hash_[:5]}-{self._created}"
        created = EPOCH + dt.timedelta(seconds=self._created)
        metadata = copy.deepcopy(template["metadata"])
        metadata["labels"]["pod-template-hash"] = hash_
        metadata.update(
            name=name,
            namespace="serving",
            resourceVersion=self._next_version(),
            creationTimestamp=created.isoformat().replace("+00:00", "Z"),
        )
        self.pods[name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": copy.deepcopy(template["spec"]),
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
        self.owner[name] = owner
        return name

    def _remove(self, pod: str) -> None:
        """Remove a pod: its engine stops, and any stream still open is cut."""
        del self.pods[pod]
        del self.owner[pod]
        self.removed.append(pod)
        if self.streams.get(pod):
            self.cut[pod] = self.streams[pod]

    # -- plumbing ------------------------------------------------------------------

    def _deployment(self, name: str) -> dict[str, Any]:
        if name not in self.deployments:
            raise ApiError(404, "NotFound")
        return self.deployments[name]

    def _write(self) -> None:
        """Let another writer act first, once, if a test asked for it."""
        if self.interfere:
            self.interfere.pop(0)()

    def _check_version(self, current: dict[str, Any], body: Any) -> None:
        sent = (body.get("metadata") or {}).get("resourceVersion")
        if sent is not None and sent != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict: the object has been modified")

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _model(self, body: dict[str, Any], kind: str) -> Any:
        return self.api_client._ApiClient__deserialize(copy.deepcopy(body), kind)


def _merge(current: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Return ``current`` with ``patch`` merged in (a JSON merge patch: maps merge,
    lists and values replace, None deletes), as far as these patches need."""
    merged = copy.deepcopy(current)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged

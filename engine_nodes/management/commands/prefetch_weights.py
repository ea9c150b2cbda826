"""``manage.py prefetch_weights --cache-dir D --node N``: keep the weights of every
version of this region's pools verified in this node's cache, and say so on the node.

The weights DaemonSet (``platform/kubernetes/base/weights-prefetch.yaml``) runs it
on each GPU node, over the host directory the pool pods mount
(``kubernetes_pools --weights-host-root``). It pulls as the node agent's warm pool
does (``engine_nodes.warm_pool.WarmPool``: one pull at a time, from the region's
ready copy, verified against the version's hash before it appears under its hash)
and, with ``--node``, keeps the node's ``weights.platform/<hash prefix>`` labels
equal to the trees it holds (``engine_nodes.domain.k8s_placement``), so a pool's
pods prefer the nodes that hold their weights. Nothing is evicted: a version whose
pool is gone loses its label, its tree stays on disk.

API calls: nodes get, patch (its own node's labels).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, Protocol

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import prefetch_related_objects

from engine_nodes import services
from engine_nodes.agent import weights_ref
from engine_nodes.domain.k8s_placement import weights_label_patch
from engine_nodes.management.commands.kubernetes_pools import kube_apis
from engine_nodes.warm_pool import Readiness, WarmPool, WeightsRef


class NodesLike(Protocol):
    """The part of ``kubernetes.client.CoreV1Api`` this command uses (nodes)."""

    def read_node(self, name: str) -> Any: ...

    def patch_node(self, name: str, body: Any) -> Any: ...


def node_api(*, in_cluster: bool, kubeconfig: Path | None) -> NodesLike:
    """Return the official client's ``CoreV1Api`` with the chosen credentials."""
    kube_apis(in_cluster=in_cluster, kubeconfig=kubeconfig)  # loads them
    from kubernetes import client

    api: NodesLike = client.CoreV1Api()
    return api


class Command(BaseCommand):
    help = (
        "Pull and verify the weights of every version of this region's pools into "
        "this node's cache; label the node with the weights it holds."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--region", default=None, help="Defaults to PLATFORM_REGION."
        )
        parser.add_argument(
            "--cache-dir",
            type=Path,
            required=True,
            help="The node's weights cache: kubernetes_pools --weights-host-root.",
        )
        parser.add_argument(
            "--node",
            default=None,
            help="This node's name, to label it; without it, no labels.",
        )
        parser.add_argument("--interval-s", type=float, default=60.0)
        parser.add_argument(
            "--once",
            action="store_true",
            help="Pull what is missing, wait for it (--pull-timeout-s), label, exit.",
        )
        parser.add_argument("--pull-timeout-s", type=float, default=3600.0)
        parser.add_argument("--in-cluster", action="store_true")
        parser.add_argument("--kubeconfig", type=Path, default=None)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["interval_s"] <= 0:
            raise CommandError("--interval-s must be positive")
        region = options["region"] or settings.PLATFORM_REGION
        node = options["node"]
        core = None
        if node:
            core = node_api(
                in_cluster=options["in_cluster"], kubeconfig=options["kubeconfig"]
            )
        warm = WarmPool(
            kind="vllm",
            cache_dir=options["cache_dir"],
            storage_roots=settings.PLATFORM_STORAGE_ROOTS,
        )
        stop = threading.Event()
        if not options["once"]:
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, lambda *_: stop.set())
        try:
            while True:
                try:
                    self._tick(warm, region, node, core, options)
                except Exception as exc:  # the database or the API: next time
                    if options["once"]:
                        raise CommandError(f"prefetching failed: {exc}") from exc
                    self.stderr.write(f"prefetching failed: {type(exc).__name__}")
                if options["once"] or stop.wait(options["interval_s"]):
                    return
        finally:
            warm.close()

    def _tick(
        self,
        warm: WarmPool,
        region: str,
        node: str | None,
        core: NodesLike | None,
        options: dict[str, Any],
    ) -> None:
        refs = region_refs(region)
        warm.hold(refs)
        if options["once"] and not warm.wait_idle(options["pull_timeout_s"]):
            raise CommandError("pulls still running at --pull-timeout-s")
        held = warm.warm_version_ids()
        present = sorted({r.weights_hash for r in refs if r.version_id in held})
        pending = sorted(
            {
                r.weights_hash
                for r in refs
                if r.weights_hash not in present
                and warm.readiness(r)[0] == Readiness.PULLING
            }
        )
        for ref in refs:
            state = "verified" if ref.weights_hash in present else "missing"
            if ref.weights_hash in pending:
                state = "pulling"
            self.stdout.write(f"{ref.weights_hash}: {state}")
        if node and core is not None:
            current = core.read_node(name=node).metadata.labels or {}
            patch = weights_label_patch(current, present, pending)
            if patch:
                core.patch_node(name=node, body={"metadata": {"labels": patch}})


def region_refs(region: str) -> list[WeightsRef]:
    """Return the weights of every version of ``region``'s pools (the agent's list)."""
    versions = services.pool_versions(region=region)
    prefetch_related_objects(versions, "regions")
    return [weights_ref(version, region) for version in versions]

"""``manage.py kubernetes_pools --namespace N --image I --weights-pvc P``: keep each
pool's Deployment in this region at the pool's target, as the node agent does for
local processes.

On Kubernetes the cluster runs the replicas; this loop is the platform's side of it.
Every ``--interval-s`` it reads the region's pools and brings each Deployment to
its spec (``engine_nodes.services.follow_pools_on_kubernetes``): created when
absent, patched when the manifest changed, scaled through the scale subresource
when only the autoscaler's count moved up. A scale-down never lets Kubernetes
pick the pod: one pod at a time, the replica with the fewest streams leaves the
gateways' rings (marked draining in the database), its streams finish or
``--drain-s`` passes, its ``controller.kubernetes.io/pod-deletion-cost`` is set
low, and only then does the Deployment lose one replica
(``engine_nodes.domain.k8s_drain``; ``docs/kubernetes-pools.md``). ``--no-drain``
scales down directly, as before.

Every ``PLATFORM_HEARTBEAT_S`` (in a thread of its own, so a slow API call of
the follow never holds a beat) it also lists each pool's pods, keeps a replica row
per pod and beats for it as a node agent does (``engine_nodes.kubernetes_beats``),
so the gateways route to the pods; ``--no-beats`` leaves that to someone else.

API calls: deployments get, create, patch; deployments/scale patch; pods list,
patch (annotations only). Listing per beat needs no ``watch``.

The official ``kubernetes`` client is the ``kubernetes`` extra
(``pip install '.[kubernetes]'``); credentials come from the pod's service account
(``--in-cluster``) or a kubeconfig (``--kubeconfig``, else the client's default).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from engine_nodes import services
from engine_nodes.domain.k8s import DeploymentTemplate, FollowAction
from engine_nodes.heartbeats import RedisBeatStore
from engine_nodes.kubernetes_actuator import (
    AppsV1Like,
    CoreV1Like,
    DrainOptions,
    KubernetesActuator,
)
from engine_nodes.kubernetes_beats import KubernetesBeats


def kube_apis(
    *, in_cluster: bool, kubeconfig: Path | None
) -> tuple[AppsV1Like, CoreV1Like]:
    """Return the official client's ``AppsV1Api`` and ``CoreV1Api`` with the chosen
    credentials."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise CommandError(
            "the kubernetes client is not installed: pip install '.[kubernetes]'"
        ) from None
    if in_cluster:
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=str(kubeconfig) if kubeconfig else None)
    apps: AppsV1Like = client.AppsV1Api()
    core: CoreV1Like = client.CoreV1Api()
    return apps, core


class Command(BaseCommand):
    help = (
        "Keep every pool's Deployment in this region at the pool's target: create, "
        "patch when its spec changed, scale up when only the count moved, and "
        "scale down one drained pod at a time (it leaves the rings, its streams "
        "finish, then its pod-deletion-cost makes it the one removed)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--region", default=None, help="Defaults to PLATFORM_REGION."
        )
        parser.add_argument("--namespace", required=True)
        parser.add_argument("--image", required=True, help="The vLLM image.")
        parser.add_argument(
            "--sglang-image",
            default=None,
            help="The SGLang image, for versions whose engine is sglang (e.g. "
            "lmsysorg/sglang:<tag>); without it their pools are skipped.",
        )
        weights = parser.add_mutually_exclusive_group(required=True)
        weights.add_argument(
            "--weights-pvc", help="A volume claim holding one directory per hash."
        )
        weights.add_argument(
            "--weights-host-root",
            help="Each GPU node's weights cache (the warm pool's directory).",
        )
        parser.add_argument(
            "--engine-api-key-secret",
            default="platform-secrets",
            help="The Secret whose key engine-api-key the replicas demand on /v1 "
            "(VLLM_API_KEY; SGLang's --config file). Empty: /v1 stays open.",
        )
        parser.add_argument(
            "--gpu-product",
            action="append",
            default=[],
            metavar="REF=PRODUCT",
            help="The GPU type (nvidia.com/gpu.product) a version's pods need, by "
            "model@version, model or * (the most specific wins); repeatable.",
        )
        parser.add_argument(
            "--otlp-traces-endpoint",
            default=settings.PLATFORM_TRACES_ENGINE_ENDPOINT,
            help="Where the engines export their own spans (an OTLP/HTTP traces "
            "URL): vLLM's --otlp-traces-endpoint, SGLang's with --enable-trace. "
            "Default PLATFORM_TRACES_ENGINE_ENDPOINT; empty: none.",
        )
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--startup-timeout-s", type=int, default=300)
        parser.add_argument(
            "--drain-s",
            type=int,
            default=int(settings.PLATFORM_DRAIN_TIMEOUT_S),
            help="How long a leaving replica's streams may finish: the drain's "
            "deadline and the pods' termination grace.",
        )
        parser.add_argument(
            "--settle-s",
            type=float,
            default=None,
            help="How long a drained replica stays after its last stream, so the "
            "gateways' snapshots drop it (default: the missed-beat window).",
        )
        parser.add_argument(
            "--no-drain",
            action="store_true",
            help="Scale down directly and let Kubernetes pick the pod (no pods "
            "access needed).",
        )
        parser.add_argument(
            "--no-beats",
            action="store_true",
            help="Do not register the pods as replicas nor beat for them (the "
            "gateways then never route to them).",
        )
        parser.add_argument("--interval-s", type=float, default=5.0)
        parser.add_argument("--once", action="store_true", help="Follow once and exit.")
        parser.add_argument("--in-cluster", action="store_true")
        parser.add_argument("--kubeconfig", type=Path, default=None)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["interval_s"] <= 0:
            raise CommandError("--interval-s must be positive")
        products = []
        for item in options["gpu_product"]:
            ref, sep, product = item.partition("=")
            if not (sep and ref and product):
                raise CommandError(f"--gpu-product {item!r}: expected REF=PRODUCT")
            products.append((ref, product))
        try:
            template = DeploymentTemplate(
                image=options["image"],
                sglang_image=options["sglang_image"],
                weights_pvc=options["weights_pvc"],
                weights_host_root=options["weights_host_root"],
                port=options["port"],
                startup_timeout_s=options["startup_timeout_s"],
                drain_s=options["drain_s"],
                api_key_secret=options["engine_api_key_secret"] or None,
                gpu_products=tuple(products),
                otlp_traces_endpoint=options["otlp_traces_endpoint"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        settle_s = options["settle_s"]
        if settle_s is None:
            settle_s = settings.PLATFORM_HEARTBEAT_S * settings.PLATFORM_MISSED_BEATS
        try:
            drain = DrainOptions(drain_timeout_s=options["drain_s"], settle_s=settle_s)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        apps, core = kube_apis(
            in_cluster=options["in_cluster"], kubeconfig=options["kubeconfig"]
        )
        actuator = (
            KubernetesActuator(apps, options["namespace"])
            if options["no_drain"]
            else KubernetesActuator(
                apps,
                options["namespace"],
                core=core,
                ledger=services.DatabaseReplicaLedger(),
                drain=drain,
            )
        )
        region = options["region"] or settings.PLATFORM_REGION
        beats = None
        if not options["no_beats"]:
            beats = KubernetesBeats(
                core,
                options["namespace"],
                region=region,
                template=template,
                sink=_beat_sink(),
                engine_api_key=settings.PLATFORM_ENGINE_API_KEY,
            )
        stop = threading.Event()
        if options["once"]:
            try:
                self._follow(actuator, region, template, once=True)
                if beats is not None:
                    beats.tick(now=timezone.now())
            finally:
                if beats is not None:
                    beats.close()
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        beating = None
        if beats is not None:
            beating = threading.Thread(
                target=beats.run,
                args=(stop,),
                kwargs={"beat_s": settings.PLATFORM_HEARTBEAT_S},
                name="kubernetes-beats",
                daemon=True,
            )
            beating.start()
        try:
            while not stop.is_set():
                self._follow(actuator, region, template, once=False)
                stop.wait(options["interval_s"])
        finally:
            stop.set()
            if beating is not None and beats is not None:
                beating.join()
                beats.close()

    def _follow(
        self,
        actuator: KubernetesActuator,
        region: str,
        template: DeploymentTemplate,
        *,
        once: bool,
    ) -> None:
        """Follow every pool once; report what moved (all of it with ``once``)."""
        try:
            actions = services.follow_pools_on_kubernetes(
                actuator=actuator, region=region, template=template
            )
        except Exception as exc:  # the API or the database: try again next time
            if once:
                raise CommandError(f"following pools failed: {exc}") from exc
            self.stderr.write(f"following pools failed: {type(exc).__name__}")
            return
        for name, action in sorted(actions.items()):
            if once or action != FollowAction.NONE:
                self.stdout.write(f"{name}: {action}")


def _beat_sink() -> RedisBeatStore | None:
    """Return the region's Redis beat store (None without Redis: database only)."""
    if not settings.REDIS_URL:
        return None
    return RedisBeatStore.from_url(
        settings.REDIS_URL,
        prefix=settings.REDIS_KEY_PREFIX,
        ttl_s=settings.PLATFORM_HEARTBEAT_S * settings.PLATFORM_MISSED_BEATS,
    )

"""Pods of a pool's Deployment become replicas that beat as a node agent's do.

The API is ``kube_fake.KubeFake``; each pod's IP and the Deployment's port lead
to a real simulated engine process (127.0.0.1) or to nothing (127.0.0.2); the
rows are the platform's and the beats land in Redis, read as gateways read them.
"""

from __future__ import annotations

import http.server
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import redis
from django.utils import timezone

from engine_nodes import services
from engine_nodes.domain.k8s import DeploymentTemplate
from engine_nodes.domain.k8s_drain import DRAINING_SINCE_ANNOTATION
from engine_nodes.heartbeats import RedisBeatStore
from engine_nodes.kubernetes_actuator import KubernetesActuator, pod_facts
from engine_nodes.kubernetes_beats import KubernetesBeats
from engine_nodes.models import Replica
from engine_nodes.tests.kube_fake import KubeFake
from localrun.processes import Process, sim_replica
from localrun.seeding import VERSION_BODY, version_body
from models_registry import services as registry_services
from models_registry.models import ModelVersion, Pool
from routing import services as routing_services
from tests.factories import accept

NAME = "vllm-chat-7b-v1-eu-west"


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Process]:
    with sim_replica(tmp_path) as process:
        yield process


@pytest.fixture
def beat_store(redis_url: str) -> Iterator[RedisBeatStore]:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    store = RedisBeatStore(redis.Redis.from_url(redis_url), prefix=prefix, ttl_s=3.0)
    yield store
    for key in store.client.scan_iter(f"{prefix}:*"):
        store.client.delete(key)


@pytest.mark.django_db
def test_pods_register_as_replicas_and_beat_to_redis(
    chat_v1: ModelVersion, sim: Process, beat_store: RedisBeatStore
) -> None:
    """GIVEN three pods: ready on a live engine, ready on a silent IP, unready
    WHEN the beat loop ticks
    THEN each has its row, and only the live one and the starting one beat;
    a drained pod beats as draining, a removed pod's row and beat go."""
    port = int(sim.url.rsplit(":", 1)[1])
    pool = Pool.objects.create(
        model_id="chat-7b",
        version=chat_v1,
        region="eu-west",
        min_replicas=1,
        max_replicas=4,
        desired_replicas=3,
    )
    template = DeploymentTemplate(
        image="vllm/vllm-openai:v0.32.0", weights_pvc="model-weights", port=port
    )
    kube = KubeFake()
    spec = services.kubernetes_pool_spec(pool, template)
    KubernetesActuator(kube, "serving").follow_pool(spec)
    live, silent, unready = kube.pods_of(NAME)
    kube.place(live, ip="127.0.0.1")
    kube.place(silent, ip="127.0.0.2")
    kube.set_ready(unready, is_ready=False)
    beats = KubernetesBeats(
        kube, "serving", region="eu-west", template=template, sink=beat_store
    )
    try:
        beats.tick(now=timezone.now())

        rows = {r.replica_id: r for r in Replica.objects.all()}
        assert set(rows) == {live, silent, unready}
        assert (rows[live].state, rows[live].url) == ("serving", sim.url)
        assert rows[live].node == "gpu-1"
        assert rows[live].last_heartbeat is not None
        assert rows[silent].state == "serving"
        assert rows[silent].url == f"http://127.0.0.2:{port}"
        assert rows[silent].last_heartbeat is None
        assert (rows[unready].state, rows[unready].url) == ("starting", "")
        heard = {b.replica_id: b for b in beat_store.read_region("eu-west")}
        assert set(heard) == {live, unready}
        assert heard[live].url == sim.url
        assert (heard[live].state, heard[live].model) == ("serving", "chat-7b")
        assert heard[live].version == "v1"
        assert heard[unready].state == "starting"

        # The drain marks the row, then stamps the pod; the pod beats as draining.
        Replica.objects.filter(pk=live).update(state="draining")
        kube.patch_namespaced_pod(
            live,
            "serving",
            {"metadata": {"annotations": {DRAINING_SINCE_ANNOTATION: "1.0"}}},
        )
        # The pool shrinks: Kubernetes removes the unready pod first.
        kube.patch_namespaced_deployment_scale(
            NAME, "serving", {"spec": {"replicas": 2}}
        )
        assert unready not in kube.pods
        beats.tick(now=timezone.now())

        assert not Replica.objects.filter(pk=unready).exists()
        assert Replica.objects.get(pk=live).state == "draining"
        heard = {b.replica_id: b for b in beat_store.read_region("eu-west")}
        assert set(heard) == {live}
        assert heard[live].state == "draining"
    finally:
        beats.close()


@pytest.mark.django_db
def test_pods_of_a_kv_events_version_record_where_they_publish(
    chat_v1: ModelVersion,
) -> None:
    """GIVEN pools of chat-7b@v1 (no kv_events) and v2 (kv_events on)
    WHEN their Deployments are followed and the beat loop lists their pods
    THEN only v2's pod exposes the events port and records its kv_events_url on
    the pod's IP, which the routing snapshot hands the gateways."""
    body = version_body(
        version="v2",
        engine_config={**VERSION_BODY["engine_config"], "kv_events": True},
    )
    v2 = accept(registry_services.register_version(model_id="chat-7b", **body))
    template = DeploymentTemplate(
        image="vllm/vllm-openai:v0.32.0", weights_pvc="model-weights"
    )
    kube = KubeFake()
    for version in (chat_v1, v2):
        pool = Pool.objects.create(
            model_id="chat-7b",
            version=version,
            region="eu-west",
            min_replicas=1,
            max_replicas=1,
            desired_replicas=1,
        )
        KubernetesActuator(kube, "serving").follow_pool(
            services.kubernetes_pool_spec(pool, template)
        )
    [plain] = kube.pods_of(NAME)
    [publishing] = kube.pods_of("vllm-chat-7b-v2-eu-west")
    kube.place(plain, ip="127.0.0.2")
    kube.place(publishing, ip="127.0.0.3")
    ports = {
        name: [
            (p["name"], p["containerPort"])
            for p in kube.deployments[name]["spec"]["template"]["spec"]["containers"][
                0
            ]["ports"]
        ]
        for name in (NAME, "vllm-chat-7b-v2-eu-west")
    }
    assert ports == {
        NAME: [("http", 8000)],
        "vllm-chat-7b-v2-eu-west": [("http", 8000), ("kv-events", 5557)],
    }
    beats = KubernetesBeats(
        kube,
        "serving",
        region="eu-west",
        template=template,
        sink=None,
        scrape_timeout_s=0.2,
    )
    try:
        beats.tick(now=timezone.now())
    finally:
        beats.close()

    rows = {r.replica_id: r for r in Replica.objects.all()}
    assert (rows[plain].url, rows[plain].kv_events_url) == ("http://127.0.0.2:8000", "")
    assert rows[publishing].url == "http://127.0.0.3:8000"
    assert rows[publishing].kv_events_url == "tcp://127.0.0.3:5557"
    snapshot = routing_services.build_snapshot(
        region="eu-west", default_policy="cache_aware"
    )
    assert {r.replica_id: r.kv_events_url for r in snapshot.replicas} == {
        plain: "",
        publishing: "tcp://127.0.0.3:5557",
    }


def test_pod_facts_read_the_apis_json() -> None:
    facts = pod_facts(
        {
            "metadata": {
                "name": "p-1",
                "annotations": {"a": "b"},
                "deletionTimestamp": "2026-12-05T00:00:00Z",
            },
            "spec": {"nodeName": "gpu-3"},
            "status": {
                "phase": "Running",
                "podIP": "10.1.2.3",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    )
    assert (facts.name, facts.node, facts.pod_ip) == ("p-1", "gpu-3", "10.1.2.3")
    assert facts.is_ready and facts.is_terminating
    assert facts.annotations == {"a": "b"}


class _HungMetrics(http.server.BaseHTTPRequestHandler):
    """An engine whose /metrics answers only after the test is over."""

    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.hits.append(self.path)
        time.sleep(1.5)
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.django_db
def test_a_hung_pod_is_not_beaten_and_its_scrape_not_repeated(
    chat_v1: ModelVersion, beat_store: RedisBeatStore
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HungMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _HungMetrics.hits.clear()
    pool = Pool.objects.create(
        model_id="chat-7b", version=chat_v1, region="eu-west", min_replicas=1
    )
    template = DeploymentTemplate(
        image="vllm/vllm-openai:v0.32.0",
        weights_pvc="model-weights",
        port=server.server_port,
    )
    kube = KubeFake()
    KubernetesActuator(kube, "serving").follow_pool(
        services.kubernetes_pool_spec(pool, template)
    )
    (pod,) = kube.pods
    kube.place(pod, ip="127.0.0.1")
    beats = KubernetesBeats(
        kube,
        "serving",
        region="eu-west",
        template=template,
        sink=beat_store,
        scrape_timeout_s=0.2,
    )
    try:
        started = time.monotonic()
        assert beats.tick(now=timezone.now()) == []
        assert beats.tick(now=timezone.now()) == []
        assert time.monotonic() - started < 1.2  # each beat waits 0.2 s, no more
        assert Replica.objects.get(pk=pod).state == "serving"
        assert beat_store.read_region("eu-west") == []
        assert _HungMetrics.hits == ["/metrics"]  # still waited on, not sent twice
    finally:
        beats.close()
        server.shutdown()
        server.server_close()

"""A gateway routes a chat request to a pod that only the Kubernetes beats announce.

No node agent runs: the pool's pods live on the stateful fake API, the one pod's
IP and the Deployment's port lead to a real simulated engine, and
``KubernetesBeats`` (in a thread, as ``kubernetes_pools`` runs it) registers the
pod's replica and beats for it. A real gateway process, reading the database and
Redis, answers through it; the openai SDK is the client.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest
from django.core.management import call_command
from django.utils import timezone

from engine_nodes import services
from engine_nodes.domain.k8s import DeploymentTemplate
from engine_nodes.heartbeats import RedisBeatStore
from engine_nodes.kubernetes_actuator import KubernetesActuator
from engine_nodes.kubernetes_beats import KubernetesBeats
from engine_nodes.models import Replica
from engine_nodes.tests.kube_fake import KubeFake
from localrun.processes import sim_replica, start_gateway, wait_until
from localrun.seeding import (
    VERSION_BODY,
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    digest,
    seed_platform,
    version_body,
)
from models_registry.models import Pool
from tests.live import extra_of, platform_env

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REGION = "e2e"


@pytest.fixture
def key(
    django_db_setup: None, django_db_blocker: DjangoDbBlocker, redis_url: str
) -> Iterator[str]:
    """Seed chat-7b@v1 live with a one-replica pool in region e2e; return a key."""
    version = VersionSeed(
        "v1",
        version_body(
            weights_hash=digest("weights v1"),
            engine_config=dict(VERSION_BODY["engine_config"]),
        ),
        min_replicas=1,
        max_replicas=1,
    )
    with django_db_blocker.unblock():
        seeded = seed_platform(
            seed=PlatformSeed(
                region=REGION,
                teams=(TeamSeed("alpha"),),
                models=(ModelSeed(model_id="chat-7b", versions=(version,)),),
                limits=(
                    LimitSeed(
                        team_id="alpha",
                        model_id="chat-7b",
                        tokens_per_minute=10**9,
                        max_concurrency=100,
                    ),
                ),
            ),
            now=timezone.now(),
        )
        try:
            yield dict(seeded.keys)["alpha"]
        finally:
            call_command("flush", interactive=False, verbosity=0)


def test_a_gateway_routes_to_the_pod_the_beats_announce(
    key: str, tmp_path: Path, django_db_blocker: DjangoDbBlocker, redis_url: str
) -> None:
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    stop = threading.Event()
    with django_db_blocker.unblock(), sim_replica(tmp_path) as sim:
        port = int(sim.url.rsplit(":", 1)[1])
        template = DeploymentTemplate(
            image="vllm/vllm-openai:v0.32.0", weights_pvc="model-weights", port=port
        )
        kube = KubeFake()
        pool = Pool.objects.select_related("version").get(region=REGION)
        KubernetesActuator(kube, "serving").follow_pool(
            services.kubernetes_pool_spec(pool, template)
        )
        (pod,) = kube.pods
        kube.place(pod, ip="127.0.0.1")
        store = RedisBeatStore.from_url(redis_url, prefix=prefix, ttl_s=3.0)
        beats = KubernetesBeats(
            kube, "serving", region=REGION, template=template, sink=store
        )
        beating = threading.Thread(
            target=beats.run, args=(stop,), kwargs={"beat_s": 0.5}, daemon=True
        )
        beating.start()
        gateway = None
        try:
            wait_until(
                lambda: Replica.objects.filter(pk=pod, state="serving").exists(),
                message="the pod's replica to serve",
            )
            gateway = start_gateway(
                platform_env(region=REGION, prefix=prefix, REDIS_URL=redis_url),
                tmp_path,
            )
            client = openai.OpenAI(
                base_url=f"{gateway.url}/v1", api_key=key, max_retries=0
            )
            answer = client.chat.completions.create(
                model="chat-7b",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=3,
            )
            assert answer.choices[0].message.content
            assert extra_of(answer)["replica_id"] == pod
        finally:
            stop.set()
            beating.join(timeout=5)
            beats.close()
            if gateway is not None:
                gateway.stop()
            for stale in store.client.scan_iter(f"{prefix}:*"):
                store.client.delete(stale)

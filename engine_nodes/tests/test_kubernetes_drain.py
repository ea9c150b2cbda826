"""A pool's Deployment scaled down on a stateful API: the drained pod is the one removed.

The API is ``kube_fake.KubeFake`` (immutable selectors, resourceVersion conflicts,
the ReplicaSet controller's deletion order); the replicas are the platform's rows,
keyed by pod name, as the gateways read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from django.utils import timezone

from engine_nodes import services
from engine_nodes.domain.k8s import DeploymentTemplate, FollowAction
from engine_nodes.domain.k8s_drain import (
    DELETION_COST_ANNOTATION,
    DRAINING_SINCE_ANNOTATION,
)
from engine_nodes.kubernetes_actuator import DrainOptions, KubernetesActuator
from engine_nodes.models import Replica
from engine_nodes.tests.kube_fake import ApiError, KubeFake
from models_registry.models import ModelVersion, Pool

pytestmark = pytest.mark.django_db

TEMPLATE = DeploymentTemplate(
    image="vllm/vllm-openai:v0.32.0", weights_pvc="model-weights", drain_s=60
)
NAME = "vllm-chat-7b-v1-eu-west"


class Clock:
    """Seconds since the epoch, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


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


@pytest.fixture
def kube() -> KubeFake:
    return KubeFake()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def follow(
    kube: KubeFake, clock: Clock, pool: Pool
) -> Callable[..., dict[str, FollowAction]]:
    actuator = KubernetesActuator(
        kube,
        "serving",
        core=kube,
        ledger=services.DatabaseReplicaLedger(),
        drain=DrainOptions(drain_timeout_s=60, settle_s=5),
        clock=clock,
    )

    def tick(template: DeploymentTemplate = TEMPLATE) -> dict[str, FollowAction]:
        actions = services.follow_pools_on_kubernetes(
            actuator=actuator, region="eu-west", template=template
        )
        for pod in kube.pods_of(NAME):  # each new pod's replica beats from now on
            Replica.objects.get_or_create(
                replica_id=pod,
                defaults={
                    "model_id": pool.model_id,
                    "version": pool.version,
                    "region": "eu-west",
                    "node": "gpu-1",
                    "state": "serving",
                    "last_heartbeat": timezone.now(),
                },
            )
        return actions

    return tick


def set_desired(pool: Pool, desired: int) -> None:
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=desired)


def set_streams(kube: KubeFake, pod: str, streams: int, tokens: int = 0) -> None:
    """The pod's replica beats with ``streams`` open (``tokens`` in flight)."""
    kube.streams[pod] = streams
    Replica.objects.filter(pk=pod).update(
        tokens_in_flight=tokens if streams else 0, last_heartbeat=timezone.now()
    )


def test_drain_scale_up_is_direct(
    pool: Pool, kube: KubeFake, follow: Callable[..., dict[str, FollowAction]]
) -> None:
    assert follow() == {NAME: FollowAction.CREATE}
    assert len(kube.pods_of(NAME)) == 3
    set_desired(pool, 4)
    kube.calls.clear()
    assert follow() == {NAME: FollowAction.SCALE}
    assert len(kube.pods_of(NAME)) == 4
    assert [c for c, _ in kube.calls] == [
        "get deployments",
        "list pods",
        "patch deployments/scale",
        "get deployments",  # the warm nodes' placeholders: none
    ]


def test_drain_scale_down_removes_the_drained_pod_once_its_stream_ended(
    pool: Pool,
    kube: KubeFake,
    clock: Clock,
    follow: Callable[..., dict[str, FollowAction]],
) -> None:
    """GIVEN three serving pods, the oldest with the fewest tokens in flight
    WHEN the target falls to two
    THEN that pod's replica drains, the Deployment keeps three replicas while its
    stream runs, and once the stream ended the pod is annotated, then the
    Deployment scaled, and the controller removes that pod and no other."""
    follow()
    oldest, middle, newest = kube.pods_of(NAME)
    set_streams(kube, oldest, 1, tokens=100)
    set_streams(kube, middle, 2, tokens=500)
    set_streams(kube, newest, 2, tokens=900)
    set_desired(pool, 2)

    assert follow() == {NAME: FollowAction.NONE}
    assert Replica.objects.get(pk=oldest).state == "draining"
    assert kube.annotations(oldest)[DRAINING_SINCE_ANNOTATION] == "1000.0"
    clock.now += 30
    assert follow() == {NAME: FollowAction.NONE}  # its stream still runs
    assert kube.deployments[NAME]["spec"]["replicas"] == 3
    assert kube.removed == []

    set_streams(kube, oldest, 0)
    kube.calls.clear()
    assert follow() == {NAME: FollowAction.SCALE}
    writes = [c for c in kube.calls if c[0].startswith("patch")]
    assert writes == [("patch pods", oldest), ("patch deployments/scale", NAME)]
    assert kube.removed == [oldest]
    assert kube.cut == {}
    assert kube.deployments[NAME]["spec"]["replicas"] == 2
    assert follow() == {NAME: FollowAction.NONE}
    assert kube.pods_of(NAME) == [middle, newest]
    for pod in (middle, newest):
        assert DELETION_COST_ANNOTATION not in kube.annotations(pod)


def test_drain_deadline_ends_the_open_stream_then_removes_the_pod(
    pool: Pool,
    kube: KubeFake,
    clock: Clock,
    follow: Callable[..., dict[str, FollowAction]],
) -> None:
    follow()
    pods = kube.pods_of(NAME)
    for pod in pods:
        set_streams(kube, pod, 3, tokens=700)
    set_streams(kube, pods[1], 1, tokens=50)
    set_desired(pool, 2)

    follow()
    assert Replica.objects.get(pk=pods[1]).state == "draining"
    clock.now += 59
    assert follow() == {NAME: FollowAction.NONE}
    assert kube.removed == []
    clock.now += 1  # the drain deadline: its stream ends with the error event
    assert follow() == {NAME: FollowAction.SCALE}
    assert kube.removed == [pods[1]]
    assert kube.cut == {pods[1]: 1}


def test_drain_scale_conflict_is_read_and_decided_again(
    pool: Pool,
    kube: KubeFake,
    clock: Clock,
    follow: Callable[..., dict[str, FollowAction]],
) -> None:
    follow()
    pods = kube.pods_of(NAME)
    set_desired(pool, 2)
    follow()  # the newest (all idle) drains
    clock.now += 10

    def another_writer() -> None:  # e.g. kubectl annotating the Deployment
        meta = kube.deployments[NAME]["metadata"]
        meta["resourceVersion"] = kube._next_version()

    kube.interfere.append(another_writer)
    kube.calls.clear()
    assert follow() == {NAME: FollowAction.SCALE}
    scales = [c for c, _ in kube.calls if c == "patch deployments/scale"]
    assert len(scales) == 2  # one refused (409), one done after a fresh read
    assert kube.calls.count(("get deployments", NAME)) == 2
    assert kube.removed == [pods[2]]
    assert kube.deployments[NAME]["spec"]["replicas"] == 2


def test_drain_unready_pod_goes_first_without_a_drain(
    pool: Pool, kube: KubeFake, follow: Callable[..., dict[str, FollowAction]]
) -> None:
    follow()
    pods = kube.pods_of(NAME)
    kube.set_ready(pods[0], is_ready=False)
    set_desired(pool, 2)
    assert follow() == {NAME: FollowAction.SCALE}
    assert kube.removed == [pods[0]]
    assert Replica.objects.filter(state="draining").count() == 0


def test_drain_spec_change_is_patched_once_and_keeps_the_count(
    pool: Pool, kube: KubeFake, follow: Callable[..., dict[str, FollowAction]]
) -> None:
    follow()
    newer = replace(TEMPLATE, image="vllm/vllm-openai:v0.33.0")
    set_desired(pool, 2)
    kube.calls.clear()
    assert follow(newer) == {NAME: FollowAction.PATCH}
    writes = [c for c, _ in kube.calls if c.startswith(("patch", "create"))]
    assert writes == ["patch deployments"]
    deployment = kube.deployments[NAME]
    assert deployment["spec"]["replicas"] == 3  # down only through a drain
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == newer.image
    kube.calls.clear()
    assert follow(newer) == {NAME: FollowAction.NONE}  # now it drains one
    assert "patch deployments" not in [c for c, _ in kube.calls]


def test_kube_fake_refuses_a_selector_change(
    kube: KubeFake, follow: Callable[..., dict[str, FollowAction]]
) -> None:
    follow()
    body = {"spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "x"}}}}
    with pytest.raises(ApiError) as refused:
        kube.patch_namespaced_deployment(name=NAME, namespace="serving", body=body)
    assert refused.value.status == 422

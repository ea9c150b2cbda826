from __future__ import annotations

from engine_nodes.domain.k8s_drain import DRAINING_SINCE_ANNOTATION
from engine_nodes.domain.k8s_pods import (
    PodFacts,
    PodReplica,
    ReplicaRow,
    plan_pod_replicas,
)
from engine_nodes.domain.liveness import ReplicaState

DEPLOYMENT = "vllm-chat-7b-v1-eu-west"


def pod(
    name: str = "a",
    *,
    phase: str = "Running",
    is_ready: bool = True,
    pod_ip: str | None = "10.0.0.7",
    node: str = "gpu-1",
    is_terminating: bool = False,
    annotations: dict[str, str] | None = None,
) -> PodFacts:
    return PodFacts(
        name=f"{DEPLOYMENT}-5d4f-{name}",
        phase=phase,
        is_ready=is_ready,
        pod_ip=pod_ip,
        node=node,
        is_terminating=is_terminating,
        annotations=annotations,
    )


def plan_one(
    facts: PodFacts,
    row: ReplicaRow | None = None,
    *,
    port: int = 8000,
    kv_events_port: int = 0,
) -> PodReplica:
    rows = {} if row is None else {facts.name: row}
    plan = plan_pod_replicas(
        deployment=DEPLOYMENT,
        port=port,
        pods=[facts],
        rows=rows,
        kv_events_port=kv_events_port,
    )
    assert plan.removed == ()
    (replica,) = plan.replicas
    return replica


def test_ready_pod_serves_at_its_ip_and_the_deployments_port() -> None:
    replica = plan_one(pod(), port=8123)
    assert replica.replica_id == f"{DEPLOYMENT}-5d4f-a"
    assert replica.url == "http://10.0.0.7:8123"
    assert replica.node == "gpu-1"
    assert replica.state == ReplicaState.SERVING
    assert replica.was is None
    assert replica.is_changed


def test_unready_pod_is_starting() -> None:
    assert plan_one(pod(is_ready=False)).state == ReplicaState.STARTING


def test_pending_pod_without_ip_is_starting_with_no_url() -> None:
    replica = plan_one(pod(phase="Pending", is_ready=False, pod_ip=None, node=""))
    assert replica.state == ReplicaState.STARTING
    assert replica.url == ""


def test_ready_condition_without_running_phase_is_not_serving() -> None:
    assert plan_one(pod(phase="Succeeded")).state == ReplicaState.STARTING


def test_pod_stamped_by_the_drain_is_draining() -> None:
    facts = pod(annotations={DRAINING_SINCE_ANNOTATION: "1000.0"})
    assert plan_one(facts).state == ReplicaState.DRAINING


def test_terminating_pod_is_draining() -> None:
    assert plan_one(pod(is_terminating=True)).state == ReplicaState.DRAINING


def test_other_annotations_do_not_drain() -> None:
    facts = pod(annotations={"controller.kubernetes.io/pod-deletion-cost": "-1000"})
    assert plan_one(facts).state == ReplicaState.SERVING


def test_draining_row_stays_draining_while_the_pod_is_ready() -> None:
    # The ledger marks the row before it stamps the pod; only the undrain moves
    # it back (it clears the stamp, then marks serving).
    row = ReplicaRow(state="draining", url="http://10.0.0.7:8000", node="gpu-1")
    replica = plan_one(pod(), row)
    assert replica.state == ReplicaState.DRAINING
    assert not replica.is_changed


def test_gone_row_is_not_revived() -> None:
    row = ReplicaRow(state="gone", url="http://10.0.0.7:8000", node="gpu-1")
    assert plan_one(pod(), row).state == ReplicaState.GONE


def test_starting_row_serves_once_ready() -> None:
    row = ReplicaRow(state="starting", url="", node="")
    replica = plan_one(pod(), row)
    assert replica.state == ReplicaState.SERVING
    assert replica.is_changed


def test_serving_row_starts_again_when_its_pod_turns_unready() -> None:
    row = ReplicaRow(state="serving", url="http://10.0.0.7:8000", node="gpu-1")
    assert plan_one(pod(is_ready=False), row).state == ReplicaState.STARTING


def test_stalled_row_of_a_ready_pod_serves() -> None:
    row = ReplicaRow(state="stalled", url="http://10.0.0.7:8000", node="gpu-1")
    assert plan_one(pod(), row).state == ReplicaState.SERVING


def test_unchanged_row_is_not_written() -> None:
    row = ReplicaRow(state="serving", url="http://10.0.0.7:8000", node="gpu-1")
    assert not plan_one(pod(), row).is_changed


def test_new_ip_changes_the_url() -> None:
    row = ReplicaRow(state="serving", url="http://10.0.0.6:8000", node="gpu-1")
    replica = plan_one(pod(), row)
    assert replica.url == "http://10.0.0.7:8000"
    assert replica.is_changed


def test_pod_publishing_kv_events_records_them_on_its_ip() -> None:
    replica = plan_one(pod(), kv_events_port=5557)
    assert replica.url == "http://10.0.0.7:8000"
    assert replica.kv_events_url == "tcp://10.0.0.7:5557"
    assert plan_one(pod()).kv_events_url == ""
    assert plan_one(pod(pod_ip=None), kv_events_port=5557).kv_events_url == ""


def test_new_kv_events_url_changes_the_row() -> None:
    row = ReplicaRow(state="serving", url="http://10.0.0.7:8000", node="gpu-1")
    assert plan_one(pod(), row, kv_events_port=5557).is_changed
    row = ReplicaRow(
        state="serving",
        url="http://10.0.0.7:8000",
        node="gpu-1",
        kv_events_url="tcp://10.0.0.7:5557",
    )
    assert not plan_one(pod(), row, kv_events_port=5557).is_changed


def test_rows_of_absent_pods_are_removed_only_for_this_deployment() -> None:
    rows = {
        f"{DEPLOYMENT}-5d4f-a": ReplicaRow(state="serving"),
        f"{DEPLOYMENT}-5d4f-b": ReplicaRow(state="draining"),
        f"{DEPLOYMENT}-5d4f-c": ReplicaRow(state="gone"),
        "chat-7b-v1-eu-west-node1-8001-abc123": ReplicaRow(state="serving"),
        f"{DEPLOYMENT}x-1-1": ReplicaRow(state="serving"),
    }
    plan = plan_pod_replicas(deployment=DEPLOYMENT, port=8000, pods=[pod()], rows=rows)
    assert plan.removed == (f"{DEPLOYMENT}-5d4f-b", f"{DEPLOYMENT}-5d4f-c")
    assert [r.replica_id for r in plan.replicas] == [f"{DEPLOYMENT}-5d4f-a"]


def test_no_pods_removes_every_row_of_the_deployment() -> None:
    rows = {f"{DEPLOYMENT}-5d4f-a": ReplicaRow(state="serving")}
    plan = plan_pod_replicas(deployment=DEPLOYMENT, port=8000, pods=[], rows=rows)
    assert plan.replicas == ()
    assert plan.removed == (f"{DEPLOYMENT}-5d4f-a",)


def test_pods_are_planned_in_name_order() -> None:
    pods = [pod("c"), pod("a", is_ready=False), pod("b", pod_ip="10.0.0.8")]
    plan = plan_pod_replicas(deployment=DEPLOYMENT, port=8000, pods=pods, rows={})
    assert [(r.replica_id[-1], r.state) for r in plan.replicas] == [
        ("a", ReplicaState.STARTING),
        ("b", ReplicaState.SERVING),
        ("c", ReplicaState.SERVING),
    ]

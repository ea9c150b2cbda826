"""The gateway's snapshot of the control plane, built from the database."""

from __future__ import annotations

import hashlib

import pytest
from django.utils import timezone
from pytest_django import DjangoAssertNumQueries

from accounts import services as accounts
from accounts.models import ApiKey, Team
from models_registry import services as registry_services
from models_registry.models import ModelKind, ModelVersion, Pool
from rollouts import services as rollouts
from routing.domain.snapshot import MODEL_KINDS
from routing.services import build_snapshot
from tests.factories import (
    VERSION_BODY,
    ReplicaFactory,
    accept,
    digest,
    version_body,
)

pytestmark = pytest.mark.django_db


def test_snapshot_holds_only_active_keys(team: Team) -> None:
    _, kept = accounts.issue_key(team_id=team.team)
    revoked, secret = accounts.issue_key(team_id=team.team)
    accounts.revoke_key(team_id=team.team, key_id=revoked.pk, now=timezone.now())
    snapshot = build_snapshot(region="local", default_policy="prefix_affinity")
    assert hashlib.sha256(kept.encode()).hexdigest() in snapshot.keys
    assert hashlib.sha256(secret.encode()).hexdigest() not in snapshot.keys
    assert snapshot.keys[hashlib.sha256(kept.encode()).hexdigest()].team == team.team


def test_snapshot_marks_batch_keys(team: Team) -> None:
    _, person = accounts.issue_key(team_id=team.team)
    ApiKey.objects.create(
        team=team,
        key_hash=hashlib.sha256(b"sk-team-batch").hexdigest(),
        prefix="sk-team-batc",
        name="batch batch_1",
        purpose=ApiKey.Purpose.BATCH,
    )
    snapshot = build_snapshot(region="local", default_policy="prefix_affinity")
    batch = snapshot.keys[hashlib.sha256(b"sk-team-batch").hexdigest()]
    assert (batch.team, batch.batch) == (team.team, True)
    assert snapshot.keys[hashlib.sha256(person.encode()).hexdigest()].batch is False


def test_snapshot_carries_limits_aliases_canary_and_shadow(
    team: Team, chat_v1: ModelVersion
) -> None:
    from models_registry import services as registry

    rollouts.set_alias(model_id="chat-7b", version="v1")
    accept(
        registry.register_version(
            model_id="chat-7b", **version_body(weights_hash=digest("v2"))
        )
    )
    accounts.set_team_limit(
        team_id=team.team,
        model_id="chat-7b",
        tokens_per_minute=1000,
        max_concurrency=3,
        guaranteed_share=0.2,
    )
    rollouts.set_rollout(
        model_id="chat-7b", version="v2", stage="shadow", percent=1, now=timezone.now()
    )
    snapshot = build_snapshot(region="local", default_policy="least_tokens")
    model = snapshot.models["chat-7b"]
    assert (model.live_version, model.canary_version) == ("v1", None)
    assert (model.shadow_version, model.shadow_percent) == ("v2", 1.0)
    assert model.policy == "least_tokens"
    assert snapshot.limits[(team.team, "chat-7b")].max_concurrency == 3
    v1 = snapshot.versions[("chat-7b", "v1")]
    assert v1.max_model_len == 8192
    # What the gateway needs to count prompt tokens with the version's tokenizer.
    assert (v1.weights_uri, v1.tokenizer_hash, v1.chat_template) == (
        VERSION_BODY["weights_uri"],
        VERSION_BODY["tokenizer_hash"],
        VERSION_BODY["chat_template"],
    )
    rollouts.set_rollout(
        model_id="chat-7b", version="v2", stage="canary", percent=10, now=timezone.now()
    )
    model = build_snapshot(region="local", default_policy="x").models["chat-7b"]
    assert (model.canary_version, model.canary_percent) == ("v2", 10.0)
    assert model.shadow_version is None


def test_snapshot_says_when_a_rollout_runs_and_which_old_version_is_kept(
    chat_v1: ModelVersion,
) -> None:
    from models_registry import services as registry
    from rollouts import plans
    from rollouts.domain.plan import Decision
    from rollouts.models import Rollout

    rollouts.set_alias(model_id="chat-7b", version="v1")
    accept(
        registry.register_version(
            model_id="chat-7b", **version_body(weights_hash=digest("v2"))
        )
    )
    model = build_snapshot(region="local", default_policy="x").models["chat-7b"]
    assert (model.rollout_pending, model.retained_version) == (False, None)
    rollout = plans.start_plan(model_id="chat-7b", version="v2", now=timezone.now())
    model = build_snapshot(region="local", default_policy="x").models["chat-7b"]
    assert (model.rollout_pending, model.retained_version) == (True, None)
    # Promoted: v2 is live, v1 kept (and routable) until it is retired.
    Rollout.objects.filter(pk=rollout.pk).update(decision=Decision.PROMOTED)
    rollouts.set_alias(model_id="chat-7b", version="v2")
    Rollout.objects.filter(pk=rollout.pk).update(
        decision=Decision.PROMOTED, decided_at=timezone.now()
    )
    model = build_snapshot(region="local", default_policy="x").models["chat-7b"]
    assert (model.live_version, model.retained_version) == ("v2", "v1")
    assert model.rollout_pending is False
    Rollout.objects.filter(pk=rollout.pk).update(retired_at=timezone.now())
    model = build_snapshot(region="local", default_policy="x").models["chat-7b"]
    assert model.retained_version is None


def test_snapshot_lists_live_replicas_of_its_region(chat_v1: ModelVersion) -> None:
    now = timezone.now()
    ReplicaFactory(version=chat_v1, region="local", last_heartbeat=now)
    ReplicaFactory(version=chat_v1, region="local", state="gone", last_heartbeat=now)
    ReplicaFactory(version=chat_v1, region="elsewhere", last_heartbeat=now)
    snapshot = build_snapshot(region="local", default_policy="prefix_affinity")
    assert len(snapshot.replicas) == 1
    replica = snapshot.replicas[0]
    assert (replica.version, replica.state) == ("v1", "serving")
    assert replica.last_heartbeat_at == pytest.approx(now.timestamp())
    assert replica.kv_events_url == ""


def test_snapshot_says_where_a_replica_publishes_kv_events(
    chat_v1: ModelVersion,
) -> None:
    ReplicaFactory(
        version=chat_v1,
        region="local",
        last_heartbeat=timezone.now(),
        kv_events_url="tcp://10.0.0.7:9101",
    )
    snapshot = build_snapshot(region="local", default_policy="prefix_affinity")
    assert [r.kv_events_url for r in snapshot.replicas] == ["tcp://10.0.0.7:9101"]


def test_snapshot_says_which_versions_schedule_by_priority(
    chat_v1: ModelVersion,
) -> None:
    ranked = registry_services.register_version(
        model_id="chat-7b",
        **version_body(
            weights_hash=digest("weights ranked"),
            engine_config={
                **VERSION_BODY["engine_config"],
                "scheduling_policy": "priority",
            },
        ),
    )
    snapshot = build_snapshot(region="local", default_policy="prefix_affinity")
    assert snapshot.versions[("chat-7b", "v1")].priority_scheduling is False
    assert snapshot.versions[("chat-7b", ranked.version)].priority_scheduling is True


def test_snapshot_carries_the_share_of_traffic_a_pool_records(
    chat_v1: ModelVersion,
) -> None:
    Pool.objects.create(
        model_id="chat-7b", version=chat_v1, region="local", record_traffic_share=0.25
    )
    Pool.objects.create(
        model_id="chat-7b", version=chat_v1, region="elsewhere", record_traffic_share=1
    )
    snapshot = build_snapshot(region="local", default_policy="prefix_affinity")
    assert snapshot.versions[("chat-7b", "v1")].traffic_share == 0.25
    other = build_snapshot(region="third", default_policy="prefix_affinity")
    assert other.versions[("chat-7b", "v1")].traffic_share == 0.0


def test_snapshot_carries_a_models_kind_and_embedding_sizes(
    chat_v1: ModelVersion,
) -> None:
    registry_services.create_model(
        model_id="embed-1", kind="embedding", dimensions=384, max_input_tokens=512
    )
    snapshot = build_snapshot(region="local", default_policy="prefix_affinity")
    chat, embed = snapshot.models["chat-7b"], snapshot.models["embed-1"]
    assert (chat.kind, chat.dimensions, chat.max_input_tokens) == ("chat", 0, 0)
    assert (embed.kind, embed.dimensions, embed.max_input_tokens) == (
        "embedding",
        384,
        512,
    )
    assert embed.is_embedding and not chat.is_embedding


def test_the_snapshots_model_kinds_are_the_registrys() -> None:
    # /v1/models and its schema name the kinds from the snapshot's list.
    assert list(MODEL_KINDS) == list(ModelKind.values)


def test_snapshot_query_count_is_fixed(
    chat_v1: ModelVersion,
    team: Team,
    django_assert_max_num_queries: DjangoAssertNumQueries,
) -> None:
    for _ in range(5):
        ReplicaFactory(version=chat_v1, last_heartbeat=timezone.now())
        accounts.issue_key(team_id=team.team)
    accounts.set_team_entitlement(
        team_id=team.team, model_id="chat-7b", tiers=["standard"]
    )
    accounts.set_team_budget(team_id=team.team, model_id=None, monthly_usd=10.0)
    accounts.set_team_budget(team_id=team.team, model_id="chat-7b", monthly_usd=5.0)
    # The eight before budgets, then entitlements, budgets and one grouped query
    # over the month's usage of the teams with a budget.
    with django_assert_max_num_queries(11):
        build_snapshot(region="local", default_policy="prefix_affinity")

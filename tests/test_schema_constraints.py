"""The seed's tables hold their invariants in the database, not only in forms."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import DataError, IntegrityError, transaction

from accounts.models import ApiKey, Team, TeamLimit
from metering.models import Usage
from models_registry.models import ImmutableVersionError, Model, ModelVersion, Pool
from rollouts.models import Rollout
from tests.factories import digest, version_body

pytestmark = pytest.mark.django_db

MINUTE = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def raw_version(model: Model, **changes: Any) -> ModelVersion:
    """Create a version directly, bypassing the service's validation."""
    body = version_body(**changes)
    body.setdefault("chat_template_hash", digest(body["chat_template"]))
    body.setdefault("version", "v1")
    return ModelVersion.objects.create(model=model, **body)


def test_usage_is_unique_per_team_model_version_minute(
    team: Team, chat_v1: ModelVersion
) -> None:
    Usage.objects.create(
        team=team, model_id="chat-7b", version=chat_v1, minute=MINUTE, prompt_tokens=10
    )
    with pytest.raises(IntegrityError), transaction.atomic():
        Usage.objects.create(
            team=team,
            model_id="chat-7b",
            version=chat_v1,
            minute=MINUTE,
            prompt_tokens=5,
        )
    # Another minute, or another version, is another row.
    Usage.objects.create(
        team=team, model_id="chat-7b", version=chat_v1, minute=MINUTE.replace(minute=1)
    )
    assert Usage.objects.count() == 2


def test_usage_minute_must_be_truncated(team: Team, chat_v1: ModelVersion) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        Usage.objects.create(
            team=team,
            model_id="chat-7b",
            version=chat_v1,
            minute=MINUTE.replace(second=30),
        )


def test_usage_cached_tokens_within_prompt_tokens(
    team: Team, chat_v1: ModelVersion
) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        Usage.objects.create(
            team=team,
            model_id="chat-7b",
            version=chat_v1,
            minute=MINUTE,
            prompt_tokens=10,
            cached_tokens=11,
        )


@pytest.mark.parametrize(
    ("part", "whole"),
    [
        ("batch_requests", "requests"),
        ("batch_prompt_tokens", "prompt_tokens"),
        ("batch_output_tokens", "output_tokens"),
    ],
)
def test_usage_batch_counts_within_their_totals(
    team: Team, chat_v1: ModelVersion, part: str, whole: str
) -> None:
    row = {"team": team, "model_id": "chat-7b", "version": chat_v1, "minute": MINUTE}
    with pytest.raises(IntegrityError), transaction.atomic():
        Usage.objects.create(**row, **{whole: 1, part: 2})
    Usage.objects.create(**row, **{whole: 2, part: 2})  # all of it batch: allowed
    assert Usage.objects.count() == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("weights_uri", "s3://models/other/"),
        ("weights_hash", digest("other")),
        ("tokenizer_hash", digest("other")),
        ("chat_template", "{{ other }}"),
        ("precision", "int8"),
        ("gpus_per_replica", 2),
        ("engine_config", {"max_num_seqs": 1}),
        ("version", "v2"),
    ],
)
def test_version_identity_cannot_change_through_save(
    chat_v1: ModelVersion, field: str, value: object
) -> None:
    setattr(chat_v1, field, value)
    with pytest.raises(ImmutableVersionError, match=field):
        chat_v1.save()
    chat_v1.refresh_from_db()
    assert getattr(chat_v1, field) != value


@pytest.mark.parametrize(
    "field", ["weights_hash", "chat_template_hash", "model", "engine_config"]
)
def test_version_identity_cannot_change_through_update(
    chat_v1: ModelVersion, field: str
) -> None:
    value = {"model": "chat-7b", "engine_config": {}}.get(field, digest("x"))
    with pytest.raises(ImmutableVersionError):
        ModelVersion.objects.filter(pk=chat_v1.pk).update(**{field: value})


def test_version_identity_cannot_change_through_bulk_update(
    chat_v1: ModelVersion,
) -> None:
    chat_v1.weights_hash = digest("bulk")
    with pytest.raises(ImmutableVersionError):
        ModelVersion.objects.bulk_update([chat_v1], ["weights_hash"])
    assert ModelVersion.objects.get().weights_hash != digest("bulk")


def test_version_mutable_fields_can_change(chat_v1: ModelVersion) -> None:
    chat_v1.status = "ready"
    chat_v1.load_test_tokens_per_s = 2500.0
    chat_v1.load_test_tokens_in_flight = 110_000
    chat_v1.eval_report_uri = "s3://models/chat-7b/eval.html"
    chat_v1.save()
    # The same engine config with keys in another order is not a change.
    chat_v1.engine_config = dict(reversed(list(chat_v1.engine_config.items())))
    chat_v1.save()
    ModelVersion.objects.filter(pk=chat_v1.pk).update(status="live")
    assert ModelVersion.objects.get().status == "live"


@pytest.mark.parametrize(
    "field", ["weights_hash", "tokenizer_hash", "chat_template_hash"]
)
@pytest.mark.parametrize("bad", ["abc", "G" * 64, "A" * 64, "0" * 65])
def test_database_refuses_malformed_hashes(
    chat_model: Model, field: str, bad: str
) -> None:
    # PostgreSQL refuses 65 characters by the column's length (DataError).
    with pytest.raises((IntegrityError, DataError)), transaction.atomic():
        raw_version(chat_model, **{field: bad})


def test_database_refuses_unknown_precision_and_gpu_count(chat_model: Model) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        raw_version(chat_model, precision="fp8")
    with pytest.raises(IntegrityError), transaction.atomic():
        raw_version(chat_model, gpus_per_replica=0)


def test_version_label_unique_per_model(
    chat_v1: ModelVersion, chat_model: Model
) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        raw_version(chat_model, weights_hash=digest("dup"), version="v1")


def test_team_limit_unique_and_bounded(team: Team, chat_model: Model) -> None:
    TeamLimit.objects.create(
        team=team,
        model=chat_model,
        tokens_per_minute=1,
        max_concurrency=1,
        guaranteed_share=0.5,
    )
    with pytest.raises(IntegrityError), transaction.atomic():
        TeamLimit.objects.create(
            team=team, model=chat_model, tokens_per_minute=1, max_concurrency=1
        )
    TeamLimit.objects.all().delete()
    bad_limits: list[dict[str, float]] = [
        {"guaranteed_share": 1.01},
        {"guaranteed_share": -0.01},
        {"tokens_per_minute": 0},
        {"max_concurrency": 0},
    ]
    for bad in bad_limits:
        values: dict[str, float] = {
            "tokens_per_minute": 1,
            "max_concurrency": 1,
            "guaranteed_share": 0.0,
            **bad,
        }
        with pytest.raises(IntegrityError), transaction.atomic():
            TeamLimit.objects.create(team=team, model=chat_model, **values)


def test_pool_min_must_not_exceed_max(chat_v1: ModelVersion) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        Pool.objects.create(
            model_id="chat-7b",
            version=chat_v1,
            region="eu",
            min_replicas=3,
            max_replicas=2,
        )
    Pool.objects.create(
        model_id="chat-7b", version=chat_v1, region="eu", min_replicas=2, max_replicas=2
    )
    with pytest.raises(IntegrityError), transaction.atomic():
        Pool.objects.create(model_id="chat-7b", version=chat_v1, region="eu")


def test_one_pending_rollout_per_model(chat_v1: ModelVersion) -> None:
    now = MINUTE
    Rollout.objects.create(
        model_id="chat-7b", version=chat_v1, stage="canary", percent=1, started_at=now
    )
    with pytest.raises(IntegrityError), transaction.atomic():
        Rollout.objects.create(
            model_id="chat-7b",
            version=chat_v1,
            stage="canary",
            percent=10,
            started_at=now,
        )
    Rollout.objects.update(decision="rolled_back")
    Rollout.objects.create(
        model_id="chat-7b", version=chat_v1, stage="canary", percent=10, started_at=now
    )
    assert Rollout.objects.count() == 2


def test_rollout_percent_range(chat_v1: ModelVersion) -> None:
    for bad in [0, -1, 100.5]:
        with pytest.raises(IntegrityError), transaction.atomic():
            Rollout.objects.create(
                model_id="chat-7b",
                version=chat_v1,
                stage="canary",
                percent=bad,
                started_at=MINUTE,
            )


def test_canary_share_needs_a_canary_version(chat_model: Model) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        Model.objects.filter(pk="chat-7b").update(canary_percent=5.0)


def test_api_key_hash_must_be_hex(team: Team) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        ApiKey.objects.create(
            team=team, key_hash="sk-team-plaintext", prefix="sk-team-"
        )


def test_api_key_purpose_must_be_known(team: Team) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        ApiKey.objects.create(
            team=team, key_hash=digest("k"), prefix="sk-team-", purpose="robot"
        )


def test_database_refuses_hash_with_trailing_newline(chat_model: Model) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        raw_version(chat_model, weights_hash=digest("w")[:63] + "\n")

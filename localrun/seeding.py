"""Seed a usable platform: teams and keys, an admin token, models, versions, pools, limits.

Public surface: ``PlatformSeed``, ``TeamSeed``, ``AdminTokenSeed``, ``ModelSeed``,
``VersionSeed``, ``LimitSeed``, ``SeededPlatform``, ``seed_platform``,
``VERSION_BODY``, ``version_body``, ``digest``, ``remove_scratch_model``.

The one way the platform's rows are written for a run on this machine:
``manage.py bootstrap_local`` (``make up``), the end-to-end tests, the live drills
and the benchmarks all describe what they need as a ``PlatformSeed`` and call
``seed_platform``. It goes through the services, so the rows obey the same rules as
the REST API's, and it is idempotent: what exists is kept (a team, a version label,
a pool, a limit, the alias), what is missing is created, and a saved secret that
still opens the platform is handed back instead of a new one.

``VERSION_BODY`` is a valid version of ``chat-7b`` for simulated replicas, whose
weights are never pulled; ``version_body`` varies it (give each version its own
``weights_hash``, since an identity registers once).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction

from accounts import services as accounts
from accounts.models import Team, TeamLimit
from config.api import validated
from models_registry import services as registry
from models_registry.api.serializers import VersionRegisterSerializer
from models_registry.models import Model, ModelVersion, Pool
from rollouts import services as rollouts

__all__ = [
    "VERSION_BODY",
    "AdminTokenSeed",
    "LimitSeed",
    "ModelSeed",
    "PlatformSeed",
    "SeededPlatform",
    "TeamSeed",
    "VersionSeed",
    "digest",
    "remove_scratch_model",
    "seed_platform",
    "version_body",
]


def digest(text: str) -> str:
    """Return the SHA-256 hex digest of ``text``, for building valid hashes."""
    return hashlib.sha256(text.encode()).hexdigest()


VERSION_BODY: Mapping[str, Any] = {
    "weights_uri": "s3://models/chat-7b/2026-11-01/",
    "weights_hash": digest("chat-7b weights"),
    "tokenizer_hash": digest("chat-7b tokenizer"),
    "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}",
    "precision": "fp16",
    "gpus_per_replica": 1,
    "engine_config": {"max_num_seqs": 256, "enable_prefix_caching": True},
}


def version_body(**changes: Any) -> dict[str, Any]:
    """Return a copy of ``VERSION_BODY`` with ``changes`` applied."""
    return {**VERSION_BODY, **changes}


@dataclass(frozen=True, slots=True)
class TeamSeed:
    """A team, and the API key handed back for it.

    ``saved_key`` is returned again while it is an active key of this team;
    otherwise a new key is issued.
    """

    team_id: str
    name: str = ""
    saved_key: str | None = None


@dataclass(frozen=True, slots=True)
class AdminTokenSeed:
    """A control-plane admin token: ``saved_secret`` again while it works, else a new one."""

    name: str
    saved_secret: str | None = None


@dataclass(frozen=True, slots=True)
class VersionSeed:
    """A version (the body of POST /admin/models/{model}/versions) and its pool.

    A version already registered under ``label`` is kept as it is; the pool, in the
    seed's region, is created only when the version has none there.
    """

    label: str
    body: Mapping[str, Any]
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True, slots=True)
class ModelSeed:
    """A model and its versions; the first takes the alias when the model has none."""

    model_id: str
    versions: tuple[VersionSeed, ...]
    description: str = ""
    # The model's gate settings (``models_registry.domain.gates``), set when the
    # model is created; empty: the defaults.
    gate_config: Mapping[str, Any] = field(default_factory=dict)
    # The model's kind and, for an embedding model, its sizes (set at creation).
    kind: str = "chat"
    dimensions: int | None = None
    max_input_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class LimitSeed:
    """A team's limits on a model, set only when the team has none there yet."""

    team_id: str
    model_id: str
    tokens_per_minute: int
    max_concurrency: int
    guaranteed_share: float = 0.0


@dataclass(frozen=True, slots=True)
class PlatformSeed:
    """Everything one run needs, with the pools in ``region``."""

    region: str
    teams: tuple[TeamSeed, ...] = ()
    models: tuple[ModelSeed, ...] = ()
    limits: tuple[LimitSeed, ...] = ()
    admin_token: AdminTokenSeed | None = None
    key_name: str = ""


@dataclass(frozen=True, slots=True)
class SeededPlatform:
    """What was seeded: a key per team, the versions per model, the admin token."""

    keys: Mapping[str, str]
    versions: Mapping[str, tuple[ModelVersion, ...]]
    admin_token: str | None


def seed_platform(*, seed: PlatformSeed, now: datetime) -> SeededPlatform:
    """Create what ``seed`` describes and is missing, in one transaction.

    Versions are registered through the REST body's serializer and the registry's
    service, the alias is set through ``rollouts.services.set_alias``, limits through
    ``accounts.services.set_team_limit``: the rules of the API apply.

    Raises:
        PlatformError: a rule refuses a row (say, an identity already registered
            under another label, or guaranteed shares above 1).
    """
    with transaction.atomic():
        admin_token = (
            _admin_token(seed.admin_token, now=now) if seed.admin_token else None
        )
        keys = {
            team.team_id: _team_key(team, key_name=seed.key_name) for team in seed.teams
        }
        versions = {
            model.model_id: _model(model, region=seed.region) for model in seed.models
        }
        for limit in seed.limits:
            if not TeamLimit.objects.filter(
                team_id=limit.team_id, model_id=limit.model_id
            ).exists():
                accounts.set_team_limit(
                    team_id=limit.team_id,
                    model_id=limit.model_id,
                    tokens_per_minute=limit.tokens_per_minute,
                    max_concurrency=limit.max_concurrency,
                    guaranteed_share=limit.guaranteed_share,
                )
    return SeededPlatform(keys=keys, versions=versions, admin_token=admin_token)


def remove_scratch_model(
    model_id: str, *, region: str, team_id: str | None = None
) -> None:
    """Remove a live drill's scratch model from ``region`` (its replicas and
    pools), and the model itself with its versions, usage, figures and rollouts,
    and its scratch team ``team_id`` when named, once no other region (another
    run's) still has a pool of it."""
    from engine_nodes.models import Replica
    from metering.models import Usage, VersionFigure
    from rollouts.models import Rollout

    Replica.objects.filter(region=region).delete()
    Pool.objects.filter(region=region).delete()
    if Pool.objects.filter(model_id=model_id).exists():
        return  # another run's
    Usage.objects.filter(model_id=model_id).delete()
    VersionFigure.objects.filter(model_id=model_id).delete()
    Rollout.objects.filter(model_id=model_id).delete()
    Model.objects.filter(pk=model_id).update(
        live_version=None, canary_version=None, canary_percent=0.0
    )
    ModelVersion.objects.filter(model_id=model_id).delete()
    Model.objects.filter(pk=model_id).delete()
    if team_id is not None:
        Team.objects.filter(pk=team_id).delete()


def _admin_token(seed: AdminTokenSeed, *, now: datetime) -> str:
    saved = seed.saved_secret
    if saved and accounts.authenticate_admin_secret(saved, now=now):
        return saved
    return accounts.create_admin_token(name=seed.name)[1]


def _team_key(seed: TeamSeed, *, key_name: str) -> str:
    if not Team.objects.filter(pk=seed.team_id).exists():
        accounts.create_team(team_id=seed.team_id, name=seed.name)
    if seed.saved_key:
        key = accounts.find_active_team_key(seed.saved_key)
        if key is not None and key.team_id == seed.team_id:
            return seed.saved_key
    return accounts.issue_key(team_id=seed.team_id, name=key_name)[1]


def _model(seed: ModelSeed, *, region: str) -> tuple[ModelVersion, ...]:
    if not Model.objects.filter(pk=seed.model_id).exists():
        registry.create_model(
            model_id=seed.model_id,
            description=seed.description,
            kind=seed.kind,
            dimensions=seed.dimensions,
            max_input_tokens=seed.max_input_tokens,
        )
        if seed.gate_config:
            registry.set_gate_config(model_id=seed.model_id, raw=dict(seed.gate_config))
    versions = []
    for version_seed in seed.versions:
        version = ModelVersion.objects.filter(
            model_id=seed.model_id, version=version_seed.label
        ).first()
        if version is None:
            body = validated(
                VersionRegisterSerializer,
                {**version_seed.body, "version": version_seed.label},
            )
            version = registry.register_version(model_id=seed.model_id, **body)
            # A seeded fleet serves at once: its versions are the starting point
            # the gates compare later versions against, not candidates.
            version = registry.accept_version(
                model_id=seed.model_id,
                version=version.version,
                by="seed",
                reason="seeded from the fleet's seed file, not gated",
            )
        Pool.objects.get_or_create(
            version=version,
            region=region,
            defaults={
                "model_id": seed.model_id,
                "min_replicas": version_seed.min_replicas,
                "max_replicas": version_seed.max_replicas,
            },
        )
        versions.append(version)
    if versions and Model.objects.get(pk=seed.model_id).live_version_id is None:
        rollouts.set_alias(model_id=seed.model_id, version=versions[0].version)
    return tuple(versions)

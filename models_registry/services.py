"""Use-cases for models, versions and pools: what exists, not where traffic goes.

Moving the alias and rollouts is ``rollouts.services``; a pool's live state (its
replicas and hit rate) is ``engine_nodes.services.pool_state``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from accounts.domain.names import SLUG_RULE
from config.errors import Conflict, InvalidRequest, NotFound
from models_registry.domain.identity import (
    MAX_GPUS_PER_REPLICA,
    Precision,
    canonical_json,
    engine_config_errors,
    is_sha256_hex,
    is_valid_model_name,
    is_valid_version_label,
    next_version_label,
    sha256_text,
    uri_errors,
)
from models_registry.models import Model, ModelVersion, Pool


def get_model(model_id: str, *, for_update: bool = False) -> Model:
    """Return the model or raise NotFound."""
    queryset = Model.objects.select_for_update() if for_update else Model.objects
    model = queryset.filter(pk=model_id).first()
    if model is None:
        raise NotFound(f"no model named {model_id!r}", param="model")
    return model


def get_version(model_id: str, version: str) -> ModelVersion:
    """Return ``model@version`` or raise NotFound."""
    found = ModelVersion.objects.filter(model_id=model_id, version=version).first()
    if found is None:
        raise NotFound(f"{model_id} has no version {version!r}", param="version")
    return found


def create_model(*, model_id: str, description: str = "") -> Model:
    """Register a new model name; versions are registered under it afterwards."""
    if not is_valid_model_name(model_id):
        raise InvalidRequest(f"model must be {SLUG_RULE}", param="model")
    try:
        with transaction.atomic():
            return Model.objects.create(model=model_id, description=description)
    except IntegrityError:
        raise Conflict(f"model {model_id!r} already exists", param="model") from None


def register_version(
    *,
    model_id: str,
    weights_uri: str,
    weights_hash: str,
    tokenizer_hash: str,
    chat_template: str,
    precision: str,
    gpus_per_replica: int,
    engine_config: dict[str, Any],
    version: str | None = None,
    eval_report_uri: str = "",
) -> ModelVersion:
    """Register an immutable version of a model (seed: offline path step 1).

    The label is the next free ``vN`` unless one is given. Registering the same
    identity twice is a 409 naming the existing version, as is reusing a label.
    """
    weights_hash = weights_hash.strip().lower()
    tokenizer_hash = tokenizer_hash.strip().lower()
    _validate_identity(
        weights_uri=weights_uri,
        weights_hash=weights_hash,
        tokenizer_hash=tokenizer_hash,
        chat_template=chat_template,
        precision=precision,
        gpus_per_replica=gpus_per_replica,
        engine_config=engine_config,
        eval_report_uri=eval_report_uri,
    )
    if version is not None and not is_valid_version_label(version):
        raise InvalidRequest("version must be labelled v1, v2, ...", param="version")
    template_hash = sha256_text(chat_template)
    with transaction.atomic():
        # The model row lock serializes numbering: two registrations cannot both
        # take the same next label.
        model = get_model(model_id, for_update=True)
        existing = list(ModelVersion.objects.filter(model=model))
        wanted = canonical_json(engine_config)
        for other in existing:
            if (
                other.weights_hash == weights_hash
                and other.tokenizer_hash == tokenizer_hash
                and other.chat_template_hash == template_hash
                and other.precision == precision
                and other.gpus_per_replica == gpus_per_replica
                and canonical_json(other.engine_config) == wanted
            ):
                raise Conflict(
                    f"this identity is already registered as {other.ref}",
                    param="weights_hash",
                    code="duplicate_version",
                )
            if version is not None and other.version == version:
                raise Conflict(
                    f"{other.ref} already exists",
                    param="version",
                    code="duplicate_version",
                )
        label = version or next_version_label(v.version for v in existing)
        try:
            with transaction.atomic():
                return ModelVersion.objects.create(
                    model=model,
                    version=label,
                    weights_uri=weights_uri,
                    weights_hash=weights_hash,
                    tokenizer_hash=tokenizer_hash,
                    chat_template=chat_template,
                    chat_template_hash=template_hash,
                    precision=precision,
                    gpus_per_replica=gpus_per_replica,
                    engine_config=engine_config,
                    eval_report_uri=eval_report_uri,
                )
        except IntegrityError:
            raise Conflict(
                f"{model_id}@{label} already exists",
                param="version",
                code="duplicate_version",
            ) from None


def _validate_identity(
    *,
    weights_uri: str,
    weights_hash: str,
    tokenizer_hash: str,
    chat_template: str,
    precision: str,
    gpus_per_replica: int,
    engine_config: Any,
    eval_report_uri: str,
) -> None:
    roots = settings.PLATFORM_STORAGE_ROOTS
    problems = uri_errors(weights_uri, roots)
    if problems:
        raise InvalidRequest(f"weights_uri {problems[0]}", param="weights_uri")
    if eval_report_uri:
        problems = uri_errors(eval_report_uri, roots)
        if problems:
            raise InvalidRequest(
                f"eval_report_uri {problems[0]}", param="eval_report_uri"
            )
    for param, value in (
        ("weights_hash", weights_hash),
        ("tokenizer_hash", tokenizer_hash),
    ):
        if not is_sha256_hex(value):
            raise InvalidRequest(
                f"{param} must be a SHA-256 digest: 64 hex characters", param=param
            )
    if not chat_template.strip():
        raise InvalidRequest("chat_template must not be empty", param="chat_template")
    if precision not in {p.value for p in Precision}:
        raise InvalidRequest(
            f"precision must be one of {', '.join(p.value for p in Precision)}",
            param="precision",
        )
    if not 1 <= gpus_per_replica <= MAX_GPUS_PER_REPLICA:
        raise InvalidRequest(
            f"gpus_per_replica must be between 1 and {MAX_GPUS_PER_REPLICA}",
            param="gpus_per_replica",
        )
    problems = engine_config_errors(engine_config)
    if problems:
        raise InvalidRequest(f"engine_config {problems[0]}", param="engine_config")


def model_dict(model: Model) -> dict[str, Any]:
    """Return a model with its versions and pools as the API shows it.

    Where its traffic goes beyond the alias (the pending rollout) is added by
    ``rollouts.services.model_detail``, which sits on top of the registry.
    """
    versions = list(ModelVersion.objects.filter(model=model).order_by("created_at"))
    by_pk: dict[int | None, str] = {v.pk: v.version for v in versions}
    pools = Pool.objects.filter(model=model).select_related("version")
    return {
        "model": model.model,
        "description": model.description,
        "live_version": by_pk.get(model.live_version_id),
        "canary_version": by_pk.get(model.canary_version_id),
        "canary_percent": model.canary_percent,
        "versions": [version_dict(v) for v in versions],
        "pools": [
            {
                "version": p.version.version,
                "region": p.region,
                "min_replicas": p.min_replicas,
                "max_replicas": p.max_replicas,
            }
            for p in pools
        ],
    }


def version_dict(version: ModelVersion) -> dict[str, Any]:
    """Return a version as the API shows it (the chat template by its hash only)."""
    return {
        "model": version.model_id,
        "version": version.version,
        "weights_uri": version.weights_uri,
        "weights_hash": version.weights_hash,
        "tokenizer_hash": version.tokenizer_hash,
        "chat_template_hash": version.chat_template_hash,
        "precision": version.precision,
        "gpus_per_replica": version.gpus_per_replica,
        "engine_config": version.engine_config,
        "eval_report_uri": version.eval_report_uri or None,
        "load_test_tokens_per_s": version.load_test_tokens_per_s,
        "load_test_tokens_in_flight": version.load_test_tokens_in_flight,
        "status": version.status,
        "created_at": version.created_at.isoformat(),
    }

"""Use-cases for models, versions and pools: what exists, not where traffic goes.

Moving the alias and rollouts: ``rollouts.services``; a pool's live state (its
replicas, hit rate): ``engine_nodes.services.pool_state``. The API's shapes are
typed here (``ModelOut``, ``VersionOut``, ``PoolSizeOut``, ``GateRunOut``,
``GatesSummary``, ``GateHistory``); its serializers draw them.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any, TypedDict

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from config.celery import app as celery_app
from config.errors import Conflict, InvalidRequest, NotFound
from config.names import SLUG_RULE, is_valid_version_label
from models_registry import judge_labels
from models_registry.domain.gates import (
    GATE_ORDER,
    GATING_STATUSES,
    GateConfig,
    GateState,
    parse_gate_config,
    rerun_refusal,
)
from models_registry.domain.identity import (
    MAX_GPUS_PER_REPLICA,
    Precision,
    VersionStatus,
    canonical_json,
    engine_config_errors,
    head_count_errors,
    is_sha256_hex,
    is_valid_model_name,
    next_version_label,
    sha256_text,
    uri_errors,
)
from models_registry.model_config import read_model_config
from models_registry.models import (
    GateRun,
    Model,
    ModelKind,
    ModelVersion,
    Pool,
    VersionRegion,
)

logger = logging.getLogger(__name__)

# The Celery task that runs a version's gates (``control.gates``): it needs
# the node agents' staging replicas and the weights' copies, which sit above the
# registry, so the registry names the task rather than importing it.
RUN_GATES_TASK = "control.run_gates"


def get_model(model_id: str, *, for_update: bool = False) -> Model:
    """Return the model or raise NotFound. ``for_update``: FOR NO KEY UPDATE, so
    rows naming the model (a replica, a rollout) insert while its writers wait."""
    lock = Model.objects.select_for_update(no_key=True)
    model = (lock if for_update else Model.objects).filter(pk=model_id).first()
    if model is None:
        raise NotFound(f"no model named {model_id!r}", param="model")
    return model


def get_version(model_id: str, version: str) -> ModelVersion:
    """Return ``model@version`` or raise NotFound."""
    found = ModelVersion.objects.filter(model_id=model_id, version=version).first()
    if found is None:
        raise NotFound(f"{model_id} has no version {version!r}", param="version")
    return found


def create_model(
    *,
    model_id: str,
    description: str = "",
    kind: str = "chat",
    dimensions: int | None = None,
    max_input_tokens: int | None = None,
) -> Model:
    """Register a new model name; versions are registered under it afterwards.

    ``kind`` is fixed here: an ``embedding`` model needs its vector size
    (``dimensions``) and longest input (``max_input_tokens``); a ``chat`` model
    takes neither.
    """
    if not is_valid_model_name(model_id):
        raise InvalidRequest(f"model must be {SLUG_RULE}", param="model")
    _check_kind(kind, dimensions, max_input_tokens)
    try:
        with transaction.atomic():
            return Model.objects.create(
                model=model_id,
                description=description,
                kind=kind,
                dimensions=dimensions,
                max_input_tokens=max_input_tokens,
            )
    except IntegrityError:
        raise Conflict(f"model {model_id!r} already exists", param="model") from None


def _check_kind(
    kind: str, dimensions: int | None, max_input_tokens: int | None
) -> None:
    """Raise ``InvalidRequest`` naming the field a model of ``kind`` cannot have."""
    if kind not in ModelKind.values:
        raise InvalidRequest("kind must be chat or embedding", param="kind")
    sizes = {"dimensions": dimensions, "max_input_tokens": max_input_tokens}
    for name, value in sizes.items():
        if kind == ModelKind.EMBEDDING and (value is None or value < 1):
            raise InvalidRequest(
                f"an embedding model needs {name} (a positive integer)", param=name
            )
        if kind == ModelKind.CHAT and value is not None:
            raise InvalidRequest(f"{name} is for embedding models only", param=name)


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
    Its gates start once the registration commits (``start_gates``).
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
        if model.kind == ModelKind.CHAT and not chat_template.strip():
            raise InvalidRequest(
                "chat_template must not be empty: a chat model's version renders "
                "its prompts with it",
                param="chat_template",
            )
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
                created = ModelVersion.objects.create(
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
        # A version takes no traffic until its gates pass (seed: offline path).
        start_gates(created, requested_by="registration", now=timezone.now())
    return created


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
    problems = head_count_errors(gpus_per_replica, read_model_config(weights_uri))
    if problems:
        raise InvalidRequest(problems[0], param="gpus_per_replica")


# -- what the API shows ---------------------------------------------------------------


class GateRunOut(TypedDict):
    """One gate of one attempt."""

    gate: str  # a GateKind value
    attempt: int
    state: str
    detail: str
    progress: dict[str, int]  # {"done": n, "total": n}
    result: Any  # the gate's own JSON (GateRun.result)
    requested_by: str
    started_at: str | None  # ISO 8601
    finished_at: str | None


class GatesSummary(TypedDict):
    """A version's last gate attempt, gate by gate."""

    attempt: int
    gates: list[GateRunOut]


class GateHistory(TypedDict):
    """Every gate attempt of a version, newest first."""

    model: str
    version: str
    status: str
    status_reason: str
    runs: list[GateRunOut]
    judge_agreement: dict[str, Any] | None


class RegionCopyOut(TypedDict):
    """Where a version's weights are in one region."""

    state: str
    uri: str
    detail: str


class VersionOut(TypedDict):
    """A registered version (its chat template by hash only)."""

    model: str
    version: str
    weights_uri: str
    weights_hash: str
    tokenizer_hash: str
    chat_template_hash: str
    precision: str
    gpus_per_replica: int
    engine_config: dict[str, Any]  # the engine's own settings (JSON)
    eval_report_uri: str | None
    load_test_tokens_per_s: float | None
    load_test_tokens_in_flight: int | None
    load_test_prefix_hit_rate: float | None
    status: str
    status_reason: str
    gates: GatesSummary | None
    regions: dict[str, RegionCopyOut]
    created_at: str  # ISO 8601


class PoolSizeOut(TypedDict):
    """A pool of a model as the model listing shows it: where, and its bounds."""

    version: str
    region: str
    min_replicas: int
    max_replicas: int
    staging: bool
    record_traffic_share: float


class ModelOut(TypedDict):
    """A model with its versions and pools."""

    model: str
    description: str
    kind: str
    dimensions: int | None
    max_input_tokens: int | None
    live_version: str | None
    canary_version: str | None
    canary_percent: float
    versions: list[VersionOut]
    pools: list[PoolSizeOut]


def model_dict(model: Model) -> ModelOut:
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
        "kind": model.kind,
        "dimensions": model.dimensions,
        "max_input_tokens": model.max_input_tokens,
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
                "staging": p.staging,
                "record_traffic_share": p.record_traffic_share,
            }
            for p in pools
        ],
    }


def version_dict(version: ModelVersion) -> VersionOut:
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
        "load_test_prefix_hit_rate": version.load_test_prefix_hit_rate,
        "status": version.status,
        "status_reason": version.status_reason,
        "gates": gates_summary(version),
        "regions": {
            r.region: {"state": r.state, "uri": r.uri, "detail": r.detail}
            for r in version.regions.all()
        },
        "created_at": version.created_at.isoformat(),
    }


# -- the version gates ---------------------------------------------------------------


def gate_config(model: Model) -> GateConfig:
    """Return the model's gate settings over the defaults.

    Raises:
        InvalidRequest: the stored settings are unusable (they are checked when
            set, so this means the row was written around the services).
    """
    config, problems = parse_gate_config(model.gate_config)
    if problems:
        raise InvalidRequest(f"gate_config {problems[0]}", param="gate_config")
    return config


def set_gate_config(*, model_id: str, raw: Any) -> Model:
    """Replace a model's gate settings, refusing what ``parse_gate_config`` refuses."""
    config, problems = parse_gate_config(raw)
    if problems:
        field, _, why = problems[0].partition(": ")
        raise InvalidRequest(f"gate_config.{field} {why}", param=f"gate_config.{field}")
    if config.eval_set_uri:
        bad = uri_errors(config.eval_set_uri, settings.PLATFORM_STORAGE_ROOTS)
        if bad:
            raise InvalidRequest(
                f"gate_config.eval_set_uri {bad[0]}", param="gate_config.eval_set_uri"
            )
    with transaction.atomic():
        model = get_model(model_id, for_update=True)
        model.gate_config = raw or {}
        model.save(update_fields=["gate_config", "updated_at"])
    return model


def latest_attempt(version: ModelVersion) -> int:
    """Return the number of the version's last gate attempt (0 before any)."""
    last = (
        GateRun.objects.filter(version=version)
        .order_by("-attempt")
        .values_list("attempt", flat=True)
        .first()
    )
    return last or 0


def start_gates(version: ModelVersion, *, requested_by: str, now: datetime) -> int:
    """Queue a new attempt at the version's gates; return its number.

    Creates one ``pending`` row per gate and sends ``RUN_GATES_TASK`` once the
    transaction commits (if the broker refuses it, the attempt is marked failed,
    saying so). The version goes back to ``registered`` until the task starts.
    Raises Conflict while an attempt is running, for a live or retired version
    and for the model's canary (``rerun_refusal``). An attempt older than
    ``PLATFORM_GATE_TIME_LIMIT_S`` that never ended (its worker was killed) is
    failed as abandoned first, so it does not block the gates for ever.
    """
    with transaction.atomic():
        locked = ModelVersion.objects.select_for_update(no_key=True).get(pk=version.pk)
        _fail_abandoned(locked, now=now)
        running = gates_running(locked)
        refusal = rerun_refusal(locked.ref, locked.status, running=running)
        if refusal is None and locked.model.canary_version_id == locked.pk:
            refusal = f"{locked.ref} is the model's canary; end the rollout first"
        if refusal:
            raise Conflict(refusal, param="version", code="gates_refused")
        attempt = latest_attempt(locked) + 1
        GateRun.objects.bulk_create(
            GateRun(
                version=locked,
                attempt=attempt,
                kind=kind,
                requested_by=requested_by[:200],
                created_at=now,
            )
            for kind in GATE_ORDER
        )
        ModelVersion.objects.filter(pk=locked.pk).update(
            status=VersionStatus.REGISTERED,
            status_reason=f"gates queued (attempt {attempt})",
        )
        pk = locked.pk
        transaction.on_commit(lambda: _send_gates(pk, attempt))
    version.refresh_from_db()
    return attempt


def _send_gates(version_id: int, attempt: int) -> None:
    try:
        celery_app.send_task(RUN_GATES_TASK, args=[version_id, attempt])
    except Exception as exc:  # the broker is down: say so on the attempt
        logger.exception("the gates of version %d could not be queued", version_id)
        why = f"the gates could not be queued: {type(exc).__name__}"
        GateRun.objects.filter(
            version_id=version_id, attempt=attempt, state=GateState.PENDING
        ).update(state=GateState.FAILED, detail=why, finished_at=timezone.now())
        ModelVersion.objects.filter(
            pk=version_id, status=VersionStatus.REGISTERED
        ).update(status_reason=f"{why}; run them again")


def gates_running(version: ModelVersion) -> bool:
    """Return True while an attempt at the version's gates is pending or running."""
    return GateRun.objects.filter(
        version=version, state__in=[GateState.PENDING, GateState.RUNNING]
    ).exists()


def _fail_abandoned(version: ModelVersion, *, now: datetime) -> None:
    cutoff = now - timedelta(seconds=settings.PLATFORM_GATE_TIME_LIMIT_S)
    stale = GateRun.objects.filter(
        version=version,
        state__in=[GateState.PENDING, GateState.RUNNING],
        created_at__lt=cutoff,
    )
    if stale.update(
        state=GateState.FAILED,
        detail="abandoned: no worker finished it within the gates' time limit",
        finished_at=now,
    ):
        ModelVersion.objects.filter(pk=version.pk, status__in=GATING_STATUSES).update(
            status=VersionStatus.REGISTERED,
            status_reason="its last gate attempt was abandoned",
        )


def status_after_live(version: ModelVersion) -> str:
    """Return the status a version goes back to when the alias leaves it: what its
    gates said, not ``ready`` because it was live (an override may have sent a
    rejected or ungated version there)."""
    attempt = latest_attempt(version)
    if not attempt:
        return VersionStatus.READY  # registered before the gates, or seeded
    states = set(
        GateRun.objects.filter(version=version, attempt=attempt).values_list(
            "state", flat=True
        )
    )
    if GateState.FAILED in states:
        return VersionStatus.REJECTED
    if states <= {GateState.PASSED, GateState.SKIPPED}:
        return VersionStatus.READY  # passed, or accepted without them
    return VersionStatus.REGISTERED


def accept_version(
    *, model_id: str, version: str, by: str, reason: str
) -> ModelVersion:
    """Mark a version ready without its gates, recording who and why.

    For versions whose gates cannot run where they are registered (a local
    bootstrap with no judge, a fixture); the pending gates are skipped.
    """
    if not by.strip() or not reason.strip():
        raise InvalidRequest("accepting a version needs who and why", param="reason")
    with transaction.atomic():
        found = ModelVersion.objects.select_for_update(no_key=True).get(
            pk=get_version(model_id, version).pk
        )
        if found.status in {VersionStatus.LIVE, VersionStatus.RETIRED}:
            raise Conflict(
                f"{found.ref} is {found.status}", param="version", code="gates_refused"
            )
        if GateRun.objects.filter(version=found, state=GateState.RUNNING).exists():
            raise Conflict(
                f"the gates of {found.ref} are running; wait for them",
                param="version",
                code="gates_refused",
            )
        GateRun.objects.filter(
            version=found, state__in=[GateState.PENDING, GateState.RUNNING]
        ).update(
            state=GateState.SKIPPED,
            detail=f"accepted without gates by {by}",
            finished_at=timezone.now(),
        )
        found.status = VersionStatus.READY
        found.status_reason = f"accepted without gates by {by}: {reason}"[:2000]
        found.save(update_fields=["status", "status_reason", "updated_at"])
    return found


def gate_run_dict(run: GateRun) -> GateRunOut:
    """Return one gate of one attempt as the API shows it."""
    return {
        "gate": run.kind,
        "attempt": run.attempt,
        "state": run.state,
        "detail": run.detail,
        "progress": {"done": run.done, "total": run.total},
        "result": run.result,
        "requested_by": run.requested_by,
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
    }


def gates_summary(version: ModelVersion) -> GatesSummary | None:
    """Return the version's last gate attempt, gate by gate (None before any)."""
    attempt = latest_attempt(version)
    if not attempt:
        return None
    runs = GateRun.objects.filter(version=version, attempt=attempt)
    order: dict[str, int] = {kind.value: i for i, kind in enumerate(GATE_ORDER)}
    return {
        "attempt": attempt,
        "gates": [
            gate_run_dict(run)
            for run in sorted(runs, key=lambda r: order.get(r.kind, len(order)))
        ],
    }


def gate_history(model_id: str, version: str) -> GateHistory:
    """Return every gate attempt of ``model@version``, newest first."""
    found = get_version(model_id, version)
    runs = list(GateRun.objects.filter(version=found).order_by("-attempt", "id"))
    return {
        "model": found.model_id,
        "version": found.version,
        "status": found.status,
        "status_reason": found.status_reason,
        "runs": [gate_run_dict(run) for run in runs],
        "judge_agreement": judge_labels.model_agreement(found.model),
    }


def region_readiness(version: ModelVersion) -> dict[str, str]:
    """Return each region's copy state of the version's weights."""
    return dict(
        VersionRegion.objects.filter(version=version).values_list("region", "state")
    )

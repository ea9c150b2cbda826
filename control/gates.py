"""Run a version's gates: its weights in every region, the eval gate, the load test.

Public surface: ``run_gates``, ``GateFailed``, ``GATE_TEAM``.

``run_gates(version_id, attempt)`` runs as the Celery task ``control.run_gates``
(``control.tasks``) that ``models_registry.services.start_gates`` queues on registration and on
``POST /admin/models/{model}/versions/{version}/gates``. It walks the attempt's
rows in ``GATE_ORDER``, each ``running`` then ``passed`` or ``failed``, and leaves
the version ``ready``, or ``rejected`` with the first failure's reason (the later
gates ``skipped``). A redelivered task (a worker died) resumes: gates that passed
in this attempt are not run again.

1. **Weights**: the tree at ``weights_uri`` is copied to each region's root in
   ``PLATFORM_REGION_STORAGE`` and verified by hash
   (``engine_nodes.weights.copy_weights``); with no roots configured this region
   serves from the registered URI, verified in place. Each region's outcome is a
   ``VersionRegion`` row: a mismatch leaves that region ``failed`` (its agents
   start nothing of the version) while the others serve. The gate fails only if
   the gate region (``PLATFORM_GATE_REGION``) has no ready copy.
2. **Eval**: a staging pool of one replica in the gate region (created unless the
   version has a pool there): the version is not ready, so only requests pinned to
   it reach it. Its answers and the live version's, to the model's eval sets (the
   default, ``Model.gate_config.eval_set_uri`` or ``PLATFORM_DEFAULT_EVAL_SET``,
   and every ``EvalSet`` row: a team's own set must pass too), go through the
   region's gateway, pinned, at the batch tier, with a key of the ``platform-gates``
   team made for this attempt and revoked after it; so does the judge
   (``gate_config.judge_model``, default ``reason-70b``). The arithmetic is
   ``models_registry.domain.eval_gate``; the report (JSON and HTML) goes to
   ``eval_report_uri`` (or under ``PLATFORM_EVAL_REPORT_ROOT``).
3. **Load test**: the staging replica itself, outside the gateway, gets the trace
   ``PLATFORM_LOAD_TEST_TRACE`` replayed at stepped rates
   (``control.load_test``); the last passing step's output tokens/s, tokens in
   flight and prefix hit rate are saved on the version, where admission and the
   autoscaler read them.

**An embedding model's version** (``Model.kind`` ``embedding``) runs the same
three gates, but its eval and load test are ``control.embedding_gates``'s, both
against the staging replica directly: the eval embeds retrieval probes (the
default ``PLATFORM_DEFAULT_EMBEDDING_EVAL_SET`` or ``gate_config.eval_set_uri``,
and every ``EvalSet`` row) and holds the vectors to the model's ``dimensions``,
finiteness, unit length and ``min_retrieval_accuracy``; the chat judge and the
comparison with the live version are skipped, the reasons recorded on the gate
(``EMBEDDING_SKIPS``). The load test finds the input tokens/s one replica
embeds at the version's p95 latency target (``engine_config.latency_target_ms``,
500 ms unset) and saves them, with the input tokens in flight there, in the same
two fields (``load_test_tokens_per_s``, ``load_test_tokens_in_flight``).

When the gates pass, a staging pool they created stays as the version's pool in
the gate region (one replica, autoscaled from then on), so its canary starts warm;
when they fail, its replica drains and the pool is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec
import httpx
import openai
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from accounts import services as accounts
from accounts.models import Team, TeamLimit
from control.embedding_gates import (
    EmbeddingGateError,
    embedding_eval,
    embedding_load_test,
)
from control.eval_report import ReportLocationError, write_report
from control.eval_run import EvalReport, PrecisionSides, Target, run_eval
from control.load_test import (
    LoadTestError,
    LoadTestResult,
    LoadTestSettings,
    load_test,
)
from engine_nodes import weights
from engine_nodes.domain.liveness import ReplicaState
from engine_nodes.models import Replica
from models_registry import judge_labels
from models_registry import services as registry
from models_registry.domain.embedding_eval import parse_probe_set
from models_registry.domain.embedding_load_test import (
    EmbeddingAnswer,
    EmbeddingLoadSettings,
    EmbeddingStep,
    latency_target_ms_for,
)
from models_registry.domain.eval_gate import (
    EvalItem,
    EvalSetError,
    JudgeTrust,
    parse_eval_set,
)
from models_registry.domain.gates import (
    GATE_ORDER,
    GATING_STATUSES,
    TRAFFIC_STATUSES,
    GateConfig,
    GateKind,
    GateState,
    RegionState,
    status_for_gate,
)
from models_registry.domain.identity import VersionStatus, uri_errors
from models_registry.domain.judge_agreement import Agreement
from models_registry.domain.load_test import CapacityStep
from models_registry.models import (
    EvalSet,
    GateRun,
    Model,
    ModelKind,
    ModelVersion,
    Pool,
    VersionRegion,
)

logger = logging.getLogger(__name__)

GATE_TEAM = "platform-gates"
_FINAL = frozenset({GateState.PASSED, GateState.FAILED, GateState.SKIPPED})
_POLL_S = 1.0
_KEY_WAIT_S = 60.0


class GateFailed(Exception):
    """A gate's verdict against the version: ``reason`` says why, for people."""

    def __init__(self, reason: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.result = result or {}


@dataclass(slots=True)
class _Attempt:
    version: ModelVersion
    attempt: int
    config: GateConfig
    results: dict[str, Any] = field(default_factory=dict)


def run_gates(version_id: int, attempt: int) -> str:
    """Run attempt ``attempt`` of the version's gates; return its status after."""
    version = ModelVersion.objects.select_related("model").filter(pk=version_id).first()
    if version is None:
        return "gone"
    runs = {
        run.kind: run
        for run in GateRun.objects.filter(version=version, attempt=attempt)
    }
    if (
        len(runs) != len(GATE_ORDER)
        or all(run.state in _FINAL for run in runs.values())
        or registry.latest_attempt(version) != attempt
    ):
        return version.status  # accepted, finished or superseded meanwhile
    if any(run.state == GateState.RUNNING for run in runs.values()):
        # Another worker holds this attempt (a redelivered message, or a worker
        # that died mid-gate: ``start_gates`` frees it once it is stale).
        logger.warning(
            "the gates of %s #%d are running elsewhere", version.ref, attempt
        )
        return version.status
    context = _Attempt(version=version, attempt=attempt, config=GateConfig())
    try:
        context.config = registry.gate_config(version.model)
    except Exception as exc:
        return _reject(context, runs, GATE_ORDER[0], GateFailed(str(exc)))
    for kind in GATE_ORDER:
        run = runs[kind]
        if run.state == GateState.PASSED:
            continue
        if not _begin(run, version, kind):
            return _current_status(version)  # accepted or claimed meanwhile
        try:
            result = _GATES[kind](context, run)
        except GateFailed as failure:
            return _reject(context, runs, kind, failure)
        except Exception as exc:
            # The gate could not finish: fail closed, and keep the detail in the log.
            logger.exception("gate %s of %s failed to run", kind, version.ref)
            return _reject(
                context,
                runs,
                kind,
                GateFailed(f"the {kind} gate could not run: {type(exc).__name__}"),
            )
        if not _finish(run, GateState.PASSED, result.pop("detail", "passed"), result):
            return _current_status(version)
    with transaction.atomic():
        _set_status(version, VersionStatus.READY, f"gates passed (attempt {attempt})")
        _keep_staging_pool(version)
    logger.info("%s passed its gates (attempt %d)", version.ref, attempt)
    return VersionStatus.READY


def _current_status(version: ModelVersion) -> str:
    return str(
        ModelVersion.objects.filter(pk=version.pk).values_list("status", flat=True)[0]
    )


def _set_status(version: ModelVersion, status: str, reason: str) -> bool:
    """Move the version's status, only while it is still being gated.

    A version an admin accepted, or that went live by an override, keeps what the
    admin gave it: the gates never overwrite it.
    """
    return bool(
        ModelVersion.objects.filter(pk=version.pk, status__in=GATING_STATUSES).update(
            status=status, status_reason=reason[:2000]
        )
    )


def _begin(run: GateRun, version: ModelVersion, kind: GateKind) -> bool:
    """Claim the gate (pending to running); False if it was not pending any more."""
    now = timezone.now()
    claimed = GateRun.objects.filter(pk=run.pk, state=GateState.PENDING).update(
        state=GateState.RUNNING, started_at=now, detail="running"
    )
    if not claimed:
        return False
    run.state, run.started_at, run.detail = GateState.RUNNING, now, "running"
    _set_status(version, status_for_gate(kind), f"{kind} gate running")
    return True


def _finish(
    run: GateRun, state: GateState, detail: str, result: dict[str, Any]
) -> bool:
    """End a gate (pending or running); False if it had ended already (accepted)."""
    ended = GateRun.objects.filter(
        pk=run.pk, state__in=[GateState.PENDING, GateState.RUNNING]
    ).update(
        state=state, detail=detail[:2000], result=result, finished_at=timezone.now()
    )
    return bool(ended)


def _progress(run: GateRun, done: int, total: int, detail: str) -> None:
    GateRun.objects.filter(pk=run.pk).update(done=done, total=total, detail=detail)


_T = TypeVar("_T")
Report = Callable[[int, int, str], None]


def _reporting(run: GateRun, work: Callable[[Report], _T]) -> _T:
    """Run ``work`` (an event loop of its own: the eval, the load test) in a
    thread, and write the progress it reports to the gate's row from this one.

    The ORM is not for async code; ``work``'s ``report(done, total, detail)`` only
    notes the latest figures, which this thread stores every ``_POLL_S``.
    """
    latest: list[tuple[int, int, str]] = []
    outcome: dict[str, Any] = {}

    def report(done: int, total: int, detail: str) -> None:
        latest.append((done, total, detail))

    def target() -> None:
        try:
            outcome["value"] = work(report)
        except BaseException as exc:  # handed back to the calling thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"gate-{run.pk}", daemon=True)
    thread.start()
    stored = None
    while thread.is_alive() or latest:
        thread.join(timeout=_POLL_S)
        if latest and latest[-1] != stored:
            stored = latest[-1]
            latest.clear()
            _progress(run, *stored)
        elif not thread.is_alive():
            break
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _reject(
    context: _Attempt,
    runs: dict[str, GateRun],
    kind: GateKind,
    failure: GateFailed,
) -> str:
    version = context.version
    if not _finish(runs[kind], GateState.FAILED, failure.reason, failure.result):
        return _current_status(version)  # accepted meanwhile: its verdict stands
    later = GATE_ORDER[GATE_ORDER.index(kind) + 1 :]
    for other in later:
        _finish(runs[other], GateState.SKIPPED, f"skipped: the {kind} gate failed", {})
    with transaction.atomic():
        if _set_status(
            version, VersionStatus.REJECTED, f"{kind} gate: {failure.reason}"
        ):
            _remove_staging(version)
    logger.warning("%s rejected by its %s gate", version.ref, kind)
    return _current_status(version)


def _keep_staging_pool(version: ModelVersion) -> None:
    """Make the staging pool the version's own: autoscaled, within the bounds of
    the live version's pool in that region (if it has one), so its canary starts
    warm and grows with its traffic."""
    for pool in Pool.objects.filter(version=version, staging=True):
        live = Pool.objects.filter(
            version_id=version.model.live_version_id, region=pool.region
        ).first()
        pool.staging = False
        if live is not None:
            pool.max_replicas = max(pool.min_replicas, live.max_replicas)
        pool.save(update_fields=["staging", "max_replicas"])


def _remove_staging(version: ModelVersion) -> None:
    """Drain the staging pool's replicas and remove the pool."""
    for pool in Pool.objects.filter(version=version, staging=True):
        Replica.objects.filter(version=version, region=pool.region).exclude(
            state__in=[ReplicaState.GONE, ReplicaState.DRAINING]
        ).update(state=ReplicaState.DRAINING)
        pool.delete()


# -- 1. weights in every region --------------------------------------------------------


def _weights_gate(context: _Attempt, run: GateRun) -> dict[str, Any]:
    version = context.version
    roots = settings.PLATFORM_STORAGE_ROOTS
    targets: dict[str, str | None] = dict(settings.PLATFORM_REGION_STORAGE) or {
        settings.PLATFORM_GATE_REGION: None
    }
    outcome: dict[str, Any] = {}
    for done, (region, root) in enumerate(sorted(targets.items())):
        _progress(run, done, len(targets), f"copying the weights to {region}")
        # A region already serving the version keeps its ready copy while the
        # gates run again (its agents go on starting replicas from it); the new
        # verdict replaces it once known.
        row, _ = VersionRegion.objects.get_or_create(
            version=version,
            region=region,
            defaults={"uri": version.weights_uri, "state": RegionState.COPYING},
        )
        try:
            if root is None:
                weights.verify_weights_at(
                    version.weights_uri, version.weights_hash, storage_roots=roots
                )
                uri = version.weights_uri
            else:
                uri = weights.copy_weights(
                    version.weights_uri,
                    version.weights_hash,
                    root,
                    storage_roots=roots,
                )
        except weights.WeightsError as exc:
            row.state, row.detail = RegionState.FAILED, str(exc)[:2000]
        except Exception as exc:
            # The row must not stay "copying": its agents would wait on it.
            logger.exception("copying the weights of %s to %s", version.ref, region)
            row.state = RegionState.FAILED
            row.detail = f"the copy could not run: {type(exc).__name__}"
        else:
            row.state, row.uri, row.detail = RegionState.READY, uri, "verified"
        row.save(update_fields=["state", "uri", "detail", "updated_at"])
        outcome[region] = {"state": row.state, "uri": row.uri, "detail": row.detail}
    _progress(run, len(targets), len(targets), "copied")
    gate_region = settings.PLATFORM_GATE_REGION
    if outcome.get(gate_region, {}).get("state") != RegionState.READY:
        why = outcome.get(gate_region, {}).get("detail", "no storage root for it")
        raise GateFailed(
            f"the weights are not ready in {gate_region}, where the gates run: {why}",
            {"regions": outcome},
        )
    failed = sorted(r for r, o in outcome.items() if o["state"] != RegionState.READY)
    detail = "ready in " + ", ".join(sorted(set(outcome) - set(failed)))
    if failed:
        detail += f"; not ready in {', '.join(failed)}"
    return {"regions": outcome, "detail": detail}


# -- 2. the eval gate ------------------------------------------------------------------


def _read_eval_lines(uri: str) -> list[str]:
    problems = uri_errors(uri, settings.PLATFORM_STORAGE_ROOTS)
    if problems:
        raise GateFailed(f"eval set {uri} {problems[0]}")
    try:
        with fsspec.open(uri, "rt", encoding="utf-8") as handle:
            return list(handle.read().splitlines())
    except (OSError, ValueError) as exc:
        raise GateFailed(f"eval set {uri} cannot be read: {exc}") from None


def _read_eval_set(uri: str) -> list[EvalItem]:
    try:
        return parse_eval_set(_read_eval_lines(uri), source=uri)
    except EvalSetError as exc:
        raise GateFailed(f"eval set {exc}") from None


def _eval_set_uris(
    config: GateConfig, version: ModelVersion, default: str
) -> list[str]:
    """Return the model's eval sets: its own (or ``default``), then the teams'."""
    uris = [config.eval_set_uri or default]
    uris += [
        s.uri
        for s in EvalSet.objects.filter(model=version.model).order_by("id")
        if s.uri not in uris
    ]
    return uris


def _judge_ref(config: GateConfig) -> str | None:
    """Return the judge's model name, or None for no judge; fail if it cannot judge."""
    if not config.judge_model:
        return None
    judge = Model.objects.select_related("live_version").filter(pk=config.judge_model)
    found = judge.first()
    if found is None:
        raise GateFailed(f"the judge {config.judge_model} is not a registered model")
    live = found.live_version
    if live is None or live.status not in TRAFFIC_STATUSES:
        raise GateFailed(
            f"the judge {config.judge_model} has no live version that is ready"
        )
    return config.judge_model


def _judge_agreement(judge: str | None, config: GateConfig) -> Agreement | None:
    """Return the judge's agreement with human labels; fail closed below its floor."""
    ref = judge_labels.judge_version(judge) if judge else None
    if ref is None:
        return None
    agreement = judge_labels.agreement_for(
        ref, min_kappa=config.min_kappa, min_labels=config.min_labels
    )
    if not agreement.can_gate:
        raise GateFailed(
            f"{agreement.reason}, so the gate fails closed",
            {"judge_agreement": agreement.as_dict()},
        )
    return agreement


def _keep_for_labels(
    run: GateRun, uri: str, report: EvalReport, agreement: Agreement | None
) -> None:
    """Keep a sample of the judge's comparisons for people to label."""
    if agreement is None or report.live is None or not report.judged_pairs:
        return
    judge_labels.record_judge_items(
        gate_run=run,
        eval_set=uri,
        judge=agreement.judge,
        judge_prompt=report.judge_prompt,
        candidate=report.candidate,
        live=report.live,
        pairs=report.judged_pairs,
        sample_size=settings.PLATFORM_JUDGE_LABEL_SAMPLE,
    )


def _eval_gate(context: _Attempt, run: GateRun) -> dict[str, Any]:
    version, config = context.version, context.config
    if version.model.kind == ModelKind.EMBEDDING:
        return _embedding_eval_gate(context, run)
    uris = _eval_set_uris(config, version, settings.PLATFORM_DEFAULT_EVAL_SET)
    sets = [(uri, _read_eval_set(uri)) for uri in uris]
    live_version = version.model.live_version
    live = (
        live_version.ref
        if live_version is not None and live_version.pk != version.pk
        else None
    )
    # A first version has no live one to compare with: it is held to the floors,
    # and no judge is asked (one named need not exist yet: the judge's own first).
    judge = _judge_ref(config) if live is not None else None
    precision = (
        _precision_plan(version, live_version)
        if live is not None and live_version is not None
        else None
    )
    # People's labels of the judge's verdicts decide whether it may judge, once
    # there are enough of them (models_registry.judge_labels).
    agreement = _judge_agreement(judge, config)
    _staging_replica(context, run)
    reports: list[dict[str, Any]] = []
    models = [version.model_id, *([judge] if judge else [])]
    with _gate_key(version, context.attempt, models) as secret:
        _wait_for_key(secret)
        for number, (uri, items) in enumerate(sets, start=1):

            def evaluate(
                report: Report, items: list[EvalItem] = items, number: int = number
            ) -> EvalReport:
                def progress(phase: str, done: int, total: int) -> None:
                    where = f"eval set {number}/{len(sets)}: {phase}"
                    report(done, total, f"{where} {done}/{total}")

                return asyncio.run(
                    _run_eval_set(
                        items,
                        secret=secret,
                        candidate=version.ref,
                        live=live,
                        judge=judge,
                        config=config,
                        progress=progress,
                        precision=precision,
                        human_trust=judge_labels.trust_from_agreement(agreement)
                        if agreement is not None
                        else None,
                    )
                )

            finished = _reporting(run, evaluate)
            _keep_for_labels(run, uri, finished, agreement)
            reports.append({"eval_set": uri, **finished.as_dict()})
    passed = all(r["passed"] for r in reports)
    reasons = [f"{r['eval_set']}: {reason}" for r in reports for reason in r["reasons"]]
    tables = [
        {"eval_set": r["eval_set"], **r["precision"]}
        for r in reports
        if r.get("precision")
    ]
    summary = {
        "model": version.model_id,
        "candidate": version.ref,
        "live": live,
        "judge": judge,
        "judge_agreement": agreement.as_dict() if agreement is not None else None,
        "attempt": context.attempt,
        "passed": passed,
        "reasons": reasons,
        "sets": reports,
        "config": config.as_dict(),
        "precision": precision.as_dict() if precision is not None else None,
    }
    # Each attempt its own report under the report root; one named at
    # registration is the registrant's, written over by each attempt.
    ours = f"{settings.PLATFORM_EVAL_REPORT_ROOT.rstrip('/')}/{version.model_id}/"
    given = version.eval_report_uri
    if given.startswith(ours):
        given = ""  # an earlier attempt's, written by the gates
    try:
        json_uri, html_uri = write_report(
            given or f"{ours}{version.version}/attempt-{context.attempt}",
            summary,
            storage_roots=settings.PLATFORM_STORAGE_ROOTS,
        )
    except ReportLocationError as exc:
        raise GateFailed(f"the eval report cannot be written: {exc}") from None
    if not given:
        ModelVersion.objects.filter(pk=version.pk).update(eval_report_uri=html_uri)
    result: dict[str, Any] = {
        "report": {"json": json_uri, "html": html_uri},
        "passed": passed,
        "reasons": reasons,
    }
    if tables:
        result["precision"] = tables
    if not passed:
        raise GateFailed("; ".join(reasons) or "the eval failed", result)
    return {**result, "detail": f"passed {len(reports)} eval set(s); report {html_uri}"}


@dataclass(frozen=True, slots=True)
class _PrecisionPlan:
    """A candidate that changes precision: the precisions and who answers each."""

    candidate: str
    live: str
    others: dict[str, str]  # precision -> a ready version's ref, to ask
    missing: dict[str, str]  # precision -> why none of its versions is asked

    def as_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "live": self.live,
            "others": dict(self.others),
            "missing": dict(self.missing),
        }


def _precision_plan(version: ModelVersion, live: ModelVersion) -> _PrecisionPlan | None:
    """Return who answers for each precision registered for the model, when the
    candidate's precision differs from live's; None when it does not.

    Each other precision is answered by its newest version that takes traffic
    (ready or live): only those have replicas to ask. One registered without
    such a version is shown as not measured, saying why.
    """
    if version.precision == live.precision:
        return None
    others: dict[str, str] = {}
    missing: dict[str, str] = {}
    siblings = (
        ModelVersion.objects.filter(model_id=version.model_id)
        .exclude(precision__in=[version.precision, live.precision])
        .order_by("-created_at", "-pk")
    )
    for sibling in siblings:
        if sibling.precision in others:
            continue
        if sibling.status in TRAFFIC_STATUSES:
            others[sibling.precision] = sibling.ref
            missing.pop(sibling.precision, None)
        elif sibling.precision not in missing:
            missing[sibling.precision] = (
                f"registered ({sibling.ref}, {sibling.status}) but no version of "
                "it is ready to answer"
            )
    return _PrecisionPlan(version.precision, live.precision, others, missing)


async def _run_eval_set(
    items: list[EvalItem],
    *,
    secret: str,
    candidate: str,
    live: str | None,
    judge: str | None,
    config: GateConfig,
    progress: Callable[[str, int, int], None],
    precision: _PrecisionPlan | None = None,
    human_trust: JudgeTrust | None = None,
) -> EvalReport:
    headers = {"x-priority": "batch"}
    async with openai.AsyncOpenAI(
        base_url=f"{settings.PLATFORM_GATE_GATEWAY_URL.rstrip('/')}/v1",
        api_key=secret,
        max_retries=0,  # the runner backs off itself (batch is shed first)
        timeout=120.0,
    ) as client:

        def target(model: str) -> Target:
            return Target(client=client, model=model, headers=headers)

        report = await run_eval(
            items,
            candidate=target(candidate),
            live=target(live) if live else None,
            judge=target(judge) if judge else None,
            thresholds=config.thresholds,
            min_kappa=config.min_kappa,
            min_labels=config.min_labels,
            on_progress=progress,
            precision=(
                PrecisionSides(
                    candidate=precision.candidate,
                    live=precision.live,
                    others={p: target(ref) for p, ref in precision.others.items()},
                    missing=precision.missing,
                )
                if precision is not None
                else None
            ),
            human_trust=human_trust,
            label_sample=settings.PLATFORM_JUDGE_LABEL_SAMPLE,
        )
    return report


@contextlib.contextmanager
def _gate_key(version: ModelVersion, attempt: int, models: list[str]) -> Iterator[str]:
    """Yield a fresh key of the gates' own team, revoked afterwards.

    The team gets limits on ``models`` where it has none (an admin's own limits
    for it stay): ``PLATFORM_GATE_TOKENS_PER_MINUTE`` and
    ``PLATFORM_GATE_MAX_CONCURRENCY``, at the batch tier, so only idle capacity.
    """
    Team.objects.get_or_create(team=GATE_TEAM, defaults={"name": "Version gates"})
    limited = set(
        TeamLimit.objects.filter(team_id=GATE_TEAM).values_list("model_id", flat=True)
    )
    for model_id in sorted(set(models) - limited):
        accounts.set_team_limit(
            team_id=GATE_TEAM,
            model_id=model_id,
            tokens_per_minute=settings.PLATFORM_GATE_TOKENS_PER_MINUTE,
            max_concurrency=settings.PLATFORM_GATE_MAX_CONCURRENCY,
            guaranteed_share=0.0,
        )
    key, secret = accounts.issue_key(
        team_id=GATE_TEAM, name=f"gates of {version.ref} #{attempt}"
    )
    try:
        yield secret
    finally:
        accounts.revoke_key(team_id=GATE_TEAM, key_id=key.pk, now=timezone.now())


def _wait_for_key(secret: str) -> None:
    """Wait until the gateway's snapshot knows the new key (it refreshes often)."""
    url = f"{settings.PLATFORM_GATE_GATEWAY_URL.rstrip('/')}/v1/models"
    deadline = time.monotonic() + _KEY_WAIT_S
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(
                url, headers={"authorization": f"Bearer {secret}"}, timeout=5.0
            )
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}"
        else:
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        time.sleep(_POLL_S)
    raise GateFailed(
        f"the gateway at {settings.PLATFORM_GATE_GATEWAY_URL} did not accept the "
        f"gates' key within {_KEY_WAIT_S:.0f} s ({last})"
    )


def _staging_replica(context: _Attempt, run: GateRun) -> Replica:
    """Return a serving replica of the version in the gate region, starting one.

    A version with no pool there gets a staging pool of one replica; the node
    agents start it like any other.
    """
    version, region = context.version, settings.PLATFORM_GATE_REGION
    if not Pool.objects.filter(version=version, region=region).exists():
        Pool.objects.create(
            model=version.model,
            version=version,
            region=region,
            min_replicas=1,
            max_replicas=1,
            staging=True,
        )
    timeout = settings.PLATFORM_GATE_REPLICA_TIMEOUT_S
    deadline = time.monotonic() + timeout
    while True:
        replica = (
            Replica.objects.filter(
                version=version, region=region, state=ReplicaState.SERVING
            )
            .order_by("created_at")
            .first()
        )
        if replica is not None:
            return replica
        if time.monotonic() > deadline:
            raise GateFailed(
                f"no replica of {version.ref} served in {region} within "
                f"{timeout:.0f} s (are there free GPUs and a node agent?)"
            )
        _progress(run, 0, 0, f"waiting for a serving replica of {version.ref}")
        time.sleep(_POLL_S)


# -- 3. the load-test gate -------------------------------------------------------------


def _load_test_gate(context: _Attempt, run: GateRun) -> dict[str, Any]:
    version = context.version
    if version.model.kind == ModelKind.EMBEDDING:
        return _embedding_load_test_gate(context, run)
    replica = _staging_replica(context, run)
    settings_ = LoadTestSettings.from_overrides(context.config.load_test)

    def measure(report: Report) -> LoadTestResult:
        def on_step(index: int, total: int, step: CapacityStep) -> None:
            verdict = "holds" if step.holds else "fails"
            report(
                index,
                total,
                f"step {index}/{total}: {step.output_tokens_per_s:.0f} tokens/s "
                f"({verdict})",
            )

        return load_test(
            replica.url,
            model=version.model_id,
            api_key=settings.PLATFORM_ENGINE_API_KEY or None,
            trace_path=settings.PLATFORM_LOAD_TEST_TRACE,
            settings=settings_,
            on_step=on_step,
        )

    try:
        result = _reporting(run, measure)
    except LoadTestError as exc:
        raise GateFailed(f"the load test could not run: {exc}") from None
    answer = result.as_dict()
    if result.tokens_per_s is not None and not result.tokens_in_flight:
        raise GateFailed(
            "the load test measured no tokens in flight at its best step "
            f"({result.tokens_per_s:.0f} tokens/s): its steps are too short or too "
            "light to size a pool by",
            answer,
        )
    if result.tokens_per_s is None:
        raise GateFailed(
            "no step of the load test held p95 TTFT under "
            f"{settings_.criteria.ttft_p95_max_s:g} s and "
            f"{settings_.criteria.stream_min_tokens_per_s:g} tokens/s streams",
            answer,
        )
    ModelVersion.objects.filter(pk=version.pk).update(
        load_test_tokens_per_s=result.tokens_per_s,
        load_test_tokens_in_flight=int(result.tokens_in_flight or 0),
        load_test_prefix_hit_rate=result.prefix_hit_rate,
    )
    return {
        **answer,
        "detail": f"{result.tokens_per_s:.0f} output tokens/s at "
        f"{result.tokens_in_flight:.0f} tokens in flight",
    }


# -- an embedding model's eval and load test ------------------------------------------

# The chat checks an embedding version skips, and why: recorded on its eval gate.
EMBEDDING_SKIPS = {
    "judge": "an embedding model answers with vectors, not text: no chat judge",
    "live_comparison": "held to the retrieval floor (min_retrieval_accuracy), "
    "not compared answer by answer with the live version",
}


def _embedding_eval_gate(context: _Attempt, run: GateRun) -> dict[str, Any]:
    """Rank the probe sets' related texts above unrelated ones, and check the
    vectors' shape (``control.embedding_gates``)."""
    version, config = context.version, context.config
    uris = _eval_set_uris(config, version, settings.PLATFORM_DEFAULT_EMBEDDING_EVAL_SET)
    sets = []
    for uri in uris:
        try:
            sets.append((uri, parse_probe_set(_read_eval_lines(uri), source=uri)))
        except EvalSetError as exc:
            raise GateFailed(f"eval set {exc}") from None
    replica = _staging_replica(context, run)
    reports = []
    for number, (uri, probes) in enumerate(sets, start=1):

        def evaluate(
            report: Report, probes: list[Any] = probes, number: int = number
        ) -> dict[str, Any]:
            return embedding_eval(
                replica.url,
                model=version.model_id,
                api_key=settings.PLATFORM_ENGINE_API_KEY or None,
                probes=probes,
                dimensions=version.model.dimensions or 0,
                is_normalized=config.embedding_normalized,
                min_accuracy=config.min_retrieval_accuracy,
                progress=lambda done, total: report(
                    done, total, f"eval set {number}/{len(sets)}: embedded {done}"
                ),
            ).as_dict()

        try:
            reports.append({"eval_set": uri, **_reporting(run, evaluate)})
        except EmbeddingGateError as exc:
            raise GateFailed(f"the eval could not run: {exc}") from None
    reasons = [f"{r['eval_set']}: {why}" for r in reports for why in r["reasons"]]
    result = {
        "kind": "embedding",
        "passed": not reasons,
        "reasons": reasons,
        "sets": reports,
        "skipped": EMBEDDING_SKIPS,
    }
    if reasons:
        raise GateFailed("; ".join(reasons), result)
    accuracy = min(r["retrieval_accuracy"] for r in reports)
    return {
        **result,
        "detail": f"passed {len(reports)} probe set(s), retrieval accuracy "
        f"{accuracy:.2f}; skipped the judge and the live comparison (an embedding "
        "model)",
    }


def _embedding_load_test_gate(context: _Attempt, run: GateRun) -> dict[str, Any]:
    """Measure the input tokens/s one replica embeds at the version's latency
    target; save them (and the input tokens in flight there) on the version."""
    version = context.version
    try:
        target_ms = latency_target_ms_for(version.engine_config)
    except ValueError as exc:
        raise GateFailed(str(exc)) from None
    settings_ = EmbeddingLoadSettings.from_overrides(
        context.config.load_test, latency_target_ms=target_ms
    )
    replica = _staging_replica(context, run)

    def measure(report: Report) -> EmbeddingAnswer:
        def on_step(step: EmbeddingStep) -> None:
            verdict = "holds" if step.holds else "fails"
            report(
                step.concurrency,
                settings_.max_concurrency,
                f"concurrency {step.concurrency}: {step.input_tokens_per_s:.0f} "
                f"input tokens/s, p95 {1000 * (step.latency_p95_s or 0):.0f} ms "
                f"({verdict})",
            )

        return embedding_load_test(
            replica.url,
            model=version.model_id,
            api_key=settings.PLATFORM_ENGINE_API_KEY or None,
            settings=settings_,
            on_step=on_step,
        )

    try:
        answer = _reporting(run, measure)
    except EmbeddingGateError as exc:
        raise GateFailed(f"the load test could not run: {exc}") from None
    result = {**answer.as_dict(), "settings": settings_.as_dict()}
    if answer.input_tokens_per_s is None or not answer.tokens_in_flight:
        raise GateFailed(
            f"no step of the load test held p95 latency under {target_ms:g} ms "
            "with every request answered",
            result,
        )
    ModelVersion.objects.filter(pk=version.pk).update(
        load_test_tokens_per_s=answer.input_tokens_per_s,
        load_test_tokens_in_flight=answer.tokens_in_flight,
        load_test_prefix_hit_rate=None,
    )
    return {
        **result,
        "detail": f"{answer.input_tokens_per_s:.0f} input tokens/s at "
        f"{answer.tokens_in_flight} input tokens in flight, p95 under "
        f"{target_ms:g} ms",
    }


_GATES: dict[GateKind, Callable[[_Attempt, GateRun], dict[str, Any]]] = {
    GateKind.WEIGHTS: _weights_gate,
    GateKind.EVAL: _eval_gate,
    GateKind.LOAD_TEST: _load_test_gate,
}

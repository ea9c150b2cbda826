"""Batches: the Files API, creating, reading, cancelling and finishing a batch.

Public surface: ``create_file``, ``get_file``, ``file_content``, ``list_files``,
``create_batch``, ``get_batch``, ``list_batches``, ``cancel_batch``, ``finalize``,
``batch_object``, ``file_object``, ``batch_key_secret``, ``team_tokens_per_minute``.

A team sees only its own files and batches: every lookup is by team, and another
team's id is a 404, as an unknown one is. A batch is checked whole at creation
(``batches.domain.lines``: a duplicate ``custom_id``, an unknown model, a URI
outside the storage roots, a deadline in the past are a 400) and its lines are
stored as rows; malformed lines are failed at once and go to the error file.

The lines run through the gateway with a key minted for the batch
(``batch_key_secret``): its secret is derived from ``SECRET_KEY`` and the batch
id, so a runner that restarts can compute it again and nothing stores it; only
its SHA-256 is in ``api_keys`` (purpose ``batch``), revoked when the batch ends.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from accounts.domain.keys import display_prefix, hash_secret
from accounts.models import ApiKey, TeamEntitlement, TeamLimit
from batches import storage
from batches.domain.lines import (
    ENDPOINT,
    ENDPOINTS,
    InputRejected,
    error_line,
    output_line,
    parse_input,
    parse_window,
)
from batches.models import Batch, BatchFile, BatchLine
from config.errors import InvalidRequest, NotFound, PlatformError
from models_registry.domain.warm_nodes import Trend
from models_registry.models import Model, ModelKind, Pool

logger = logging.getLogger(__name__)

__all__ = [
    "CANCEL_FIELDS",
    "TooLarge",
    "batch_key_secret",
    "batch_object",
    "cancel_batch",
    "create_batch",
    "create_file",
    "demand_trend",
    "file_content",
    "file_object",
    "finalize",
    "get_batch",
    "get_file",
    "list_batches",
    "list_files",
    "team_tokens_per_minute",
]

EXPIRED_MESSAGE = (
    "This request could not be executed before the completion window expired."
)
CANCELLED_MESSAGE = "This request was not executed: the batch was cancelled."
_INSERT_CHUNK = 2000


class TooLarge(PlatformError):
    """A file over the size limit (413)."""

    status_code = 413


class ModelNotAllowed(PlatformError):
    """A model the team has no limits on (403), as the gateway answers it."""

    status_code = 403
    error_type = "permission_error"


# -- files ----------------------------------------------------------------------


def create_file(
    *, team_id: str, filename: str, purpose: str, chunks: Iterable[bytes]
) -> BatchFile:
    """Store an uploaded file for batches; only ``purpose="batch"`` is accepted.

    Raises:
        InvalidRequest: another purpose, or an empty file.
        TooLarge: over ``PLATFORM_BATCH_FILE_MAX_BYTES``.
    """
    if purpose != BatchFile.Purpose.BATCH:
        raise InvalidRequest(
            "purpose must be 'batch': this platform keeps files for batches only",
            param="purpose",
        )
    file_id = f"file-{secrets.token_hex(12)}"
    uri = storage.file_uri(file_id)
    limit = settings.PLATFORM_BATCH_FILE_MAX_BYTES
    try:
        size, digest = storage.write_stream(uri, chunks, max_bytes=limit)
    except OverflowError:
        raise TooLarge(
            f"the file is larger than the {limit} bytes allowed",
            param="file",
            code="file_too_large",
        ) from None
    if size == 0:
        raise InvalidRequest("the file is empty", param="file")
    return BatchFile.objects.create(
        id=file_id,
        team_id=team_id,
        purpose=purpose,
        filename=filename[:255] or "batch.jsonl",
        bytes=size,
        sha256=digest,
        uri=uri,
        created_at=timezone.now(),
    )


def get_file(*, team_id: str, file_id: str) -> BatchFile:
    try:
        return BatchFile.objects.get(pk=file_id, team_id=team_id)
    except BatchFile.DoesNotExist:
        raise NotFound(f"no file {file_id!r}", param="file_id") from None


def file_content(*, team_id: str, file_id: str) -> Iterator[bytes]:
    """Return the file's content in chunks, opened now.

    Not a generator: the team's claim on the file is checked, and the file
    opened, before a streaming answer has started (a generator would do both
    only once read, after a 200).

    Raises:
        NotFound: a file the team does not have, or whose content is gone.
    """
    found = get_file(team_id=team_id, file_id=file_id)
    try:
        return storage.read_chunks(found.uri)
    except storage.StorageRefused:
        raise NotFound(
            f"the content of file {file_id!r} is no longer stored", param="file_id"
        ) from None


def list_files(
    *,
    team_id: str,
    after: str | None,
    limit: int,
    newest_first: bool = True,
    purpose: str | None = None,
) -> tuple[list[BatchFile], bool]:
    """A page of the team's files after the cursor, and whether more follow."""
    rows = BatchFile.objects.filter(team_id=team_id)
    if purpose is not None:
        rows = rows.filter(purpose=purpose)
    order = ("-created_at", "-id") if newest_first else ("created_at", "id")
    if after:
        cursor = get_file(team_id=team_id, file_id=after)
        if newest_first:
            rows = rows.filter(
                Q(created_at__lt=cursor.created_at)
                | Q(created_at=cursor.created_at, id__lt=cursor.id)
            )
        else:
            rows = rows.filter(
                Q(created_at__gt=cursor.created_at)
                | Q(created_at=cursor.created_at, id__gt=cursor.id)
            )
    page = list(rows.order_by(*order)[: limit + 1])
    return page[:limit], len(page) > limit


def file_object(found: BatchFile) -> dict[str, Any]:
    """The file in OpenAI's shape."""
    return {
        "id": found.id,
        "object": "file",
        "bytes": found.bytes,
        "created_at": int(found.created_at.timestamp()),
        "filename": found.filename,
        "purpose": found.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


# -- creating a batch -----------------------------------------------------------


def batch_key_secret(batch_id: str) -> str:
    """The secret of a batch's own key, derived (never stored) from SECRET_KEY."""
    mac = hmac.new(
        settings.SECRET_KEY.encode(), f"batch-key:{batch_id}".encode(), hashlib.sha256
    )
    return f"sk-batch-{mac.hexdigest()}"


def create_batch(
    *,
    team_id: str,
    input_file_id: str | None = None,
    input_uri: str | None = None,
    output_uri: str | None = None,
    model: str | None = None,
    endpoint: str = ENDPOINT,
    completion_window: str | None = None,
    deadline: datetime | None = None,
    metadata: dict[str, str] | None = None,
    now: datetime | None = None,
) -> Batch:
    """Create a batch from an uploaded file (OpenAI's form) or from ``input_uri``
    (the seed's form, with ``model``, ``output_uri`` and ``deadline``).

    ``endpoint`` is ``/v1/chat/completions`` or ``/v1/embeddings``; every line's
    ``url`` must be it, and the batch's model must be of the kind it serves (a
    chat model for chat, an embedding model for embeddings).

    Raises:
        InvalidRequest: the rules of ``batches.domain.lines``, another endpoint,
            an unknown model or one of the other kind, a model the team may not
            call, a URI outside the roots, a deadline in the past or further
            than a week.
        NotFound: an ``input_file_id`` the team does not have.
        TooLarge: an ``input_uri`` over the file size limit.
    """
    now = now or timezone.now()
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(
            f"endpoint must be one of {', '.join(map(repr, ENDPOINTS))}",
            param="endpoint",
        )
    window_s = _window(completion_window, deadline, now)
    input_file = None
    if input_file_id is not None:
        if input_uri is not None:
            raise InvalidRequest(
                "give input_file_id or input_uri, not both", param="input_uri"
            )
        input_file = get_file(team_id=team_id, file_id=input_file_id)
        if input_file.purpose != BatchFile.Purpose.BATCH:
            raise InvalidRequest(
                "the input file must have purpose 'batch'", param="input_file_id"
            )
        source = input_file.uri
    else:
        source = _input_source(input_uri, output_uri)
    if output_uri is not None:
        _check_output(output_uri)
    if model is not None:
        _model(model, team_id, endpoint)
    try:
        parsed = parse_input(storage.read_lines(source), model=model, endpoint=endpoint)
    except InputRejected as exc:
        raise InvalidRequest(
            exc.message,
            param="input_file_id" if input_file else "input_uri",
            code=exc.code,
        ) from None
    except storage.StorageRefused as exc:
        raise InvalidRequest(str(exc), param="input_uri") from None
    model_row = _model(parsed.model, team_id, endpoint)
    batch_id = f"batch_{secrets.token_hex(12)}"
    failed = len(parsed.lines) - parsed.runnable
    with transaction.atomic():
        key = _mint_key(batch_id, team_id)
        batch = Batch.objects.create(
            id=batch_id,
            team_id=team_id,
            model=model_row,
            endpoint=endpoint,
            completion_window=(completion_window or f"{window_s}s").strip(),
            metadata=metadata or {},
            input_file=input_file,
            input_uri=input_uri or "",
            output_uri=output_uri or "",
            status=Batch.Status.IN_PROGRESS,
            total=len(parsed.lines),
            failed=failed,
            created_at=now,
            in_progress_at=now,
            deadline_at=deadline or now + timedelta(seconds=window_s),
            key=key,
            schedule_reason="waiting for a runner",
        )
        rows = (
            BatchLine(
                batch=batch,
                index=line.index,
                custom_id=line.custom_id or "",
                body=line.body,
                status=(
                    BatchLine.Status.PENDING
                    if line.error is None
                    else BatchLine.Status.FAILED
                ),
                error=(
                    None
                    if line.error is None
                    else {"code": line.error.code, "message": line.error.message}
                ),
                finished_at=None if line.error is None else now,
            )
            for line in parsed.lines
        )
        _bulk_create(rows)
    if parsed.runnable == 0:
        finalize(batch.id, Batch.Status.COMPLETED, now=now)
        batch.refresh_from_db()
    return batch


def _window(
    completion_window: str | None, deadline: datetime | None, now: datetime
) -> int:
    if deadline is not None:
        if completion_window is not None:
            raise InvalidRequest(
                "give completion_window or deadline, not both", param="deadline"
            )
        seconds = (deadline - now).total_seconds()
        if seconds <= 0:
            raise InvalidRequest("the deadline is in the past", param="deadline")
        if seconds > 7 * 86400:
            raise InvalidRequest(
                "the deadline must be at most 7 days away", param="deadline"
            )
        return int(seconds)
    try:
        return parse_window(completion_window or "24h")
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="completion_window") from None


def _input_source(input_uri: str | None, output_uri: str | None) -> str:
    if not input_uri:
        raise InvalidRequest(
            "give input_file_id (OpenAI's form) or input_uri (with output_uri)",
            param="input_file_id",
        )
    if not output_uri:
        raise InvalidRequest(
            "output_uri is required with input_uri", param="output_uri"
        )
    try:
        storage.check_uri(input_uri)
    except storage.StorageRefused as exc:
        raise InvalidRequest(f"input_uri {exc}", param="input_uri") from None
    try:
        size = storage.size_of(input_uri)
    except storage.StorageRefused as exc:
        raise InvalidRequest(str(exc), param="input_uri") from None
    limit = settings.PLATFORM_BATCH_FILE_MAX_BYTES
    if size > limit:
        raise TooLarge(
            f"the input is larger than the {limit} bytes allowed",
            param="input_uri",
            code="file_too_large",
        )
    return input_uri


def _check_output(output_uri: str) -> None:
    """The seed's output_uri: under a root, outside the platform's own batch files,
    and new (a batch never overwrites what is there: eval sets, weights, another
    job's output)."""
    try:
        storage.check_uri(output_uri)
        own = settings.PLATFORM_BATCH_STORAGE_URI
        if output_uri.startswith(own if own.endswith("/") else f"{own}/"):
            raise storage.StorageRefused(
                "must not lie under the platform's own batch files"
            )
        if storage.exists(output_uri):
            raise storage.StorageRefused("already exists; a batch writes a new object")
    except storage.StorageRefused as exc:
        raise InvalidRequest(f"output_uri {exc}", param="output_uri") from None


def _model(name: str, team_id: str, endpoint: str) -> Model:
    """The model a batch runs on (``model`` or ``model@version``), if it serves
    ``endpoint`` and the team may call it: a limits row, or the platform's default
    tokens per minute; and the batch tier (its entitlement, or the default tiers).

    A model of the other kind is refused here, as the gateway refuses it on each
    line (400, ``model_not_supported``): every line would fail the same way."""
    model_id = name.split("@", 1)[0]
    try:
        model = Model.objects.get(pk=model_id)
    except Model.DoesNotExist:
        raise InvalidRequest(
            f"the model {name!r} does not exist", param="model", code="model_not_found"
        ) from None
    if model.kind != ENDPOINTS[endpoint]:
        what = (
            "an embedding model: use it with /v1/embeddings"
            if model.kind == ModelKind.EMBEDDING
            else "a chat model: use it with /v1/chat/completions"
        )
        raise InvalidRequest(
            f"{model_id} is {what}", param="model", code="model_not_supported"
        )
    if not _tokens_per_minute(team_id, model_id):
        raise ModelNotAllowed(
            f"team {team_id!r} may not use model {model_id!r}: it has no limits on "
            "it; ask a platform admin to grant them "
            f"(PUT /admin/teams/{team_id}/limits)",
            param="model",
            code="model_not_allowed",
        )
    if not _may_use_batch_tier(team_id, model_id):
        # Every line is judged as the batch tier (routing.plan): all would fail.
        raise ModelNotAllowed(
            f"team {team_id!r} may not use the batch tier on model {model_id!r}; "
            "ask a platform admin to grant it "
            f"(PUT /admin/teams/{team_id}/entitlements)",
            param="model",
            code="tier_not_entitled",
        )
    return model


def _may_use_batch_tier(team_id: str, model_id: str) -> bool:
    row = TeamEntitlement.objects.filter(team_id=team_id, model_id=model_id).first()
    if row is not None:
        return "batch" in row.tiers
    return "batch" in settings.PLATFORM_DEFAULT_TIERS


def _tokens_per_minute(team_id: str, model_id: str) -> int:
    row = TeamLimit.objects.filter(team_id=team_id, model_id=model_id).first()
    if row is not None:
        return row.tokens_per_minute
    return int(settings.PLATFORM_DEFAULT_TOKENS_PER_MINUTE)


def team_tokens_per_minute(batch: Batch) -> int:
    """The team's tokens per minute on the batch's model (the standard tier's ceiling)."""
    return _tokens_per_minute(batch.team_id, batch.model_id)


def demand_trend(model_id: str, *, horizon_s: float) -> Trend | None:
    """Return the autoscaler's trend of the model's demand (its Holt level and
    slope, ``Pool.autoscaler_state``) as a share of the pool's capacity at its last
    tick (serving replicas x tokens in flight a replica), for the pool of the
    model forecast the busiest ``horizon_s`` ahead; None when no pool has one.

    Live demand is the pool's tokens in flight over every tier, the batch's own
    included: the back-off it drives is the more cautious for it.
    """
    trends = []
    for pool in Pool.objects.filter(model_id=model_id).only("autoscaler_state"):
        stored = pool.stored_state()
        try:
            trend = Trend.from_list((stored.get("state") or {}).get("trend"))
            signals = (stored.get("last") or {}).get("signals") or {}
            capacity = float(signals.get("serving", 0.0)) * float(
                signals.get("replica_tokens_in_flight", 0.0)
            )
        except (TypeError, ValueError, AttributeError):
            continue  # a record this version cannot read: no forecast from it
        if trend is not None and capacity > 0:
            trends.append(
                Trend(trend.at, trend.level / capacity, trend.slope / capacity)
            )
    return max(trends, key=lambda t: t.forecast(horizon_s), default=None)


def _mint_key(batch_id: str, team_id: str) -> ApiKey:
    secret = batch_key_secret(batch_id)
    return ApiKey.objects.create(
        team_id=team_id,
        key_hash=hash_secret(secret),
        prefix=display_prefix(secret),
        name=f"batch {batch_id}",
        purpose=ApiKey.Purpose.BATCH,
    )


def _bulk_create(rows: Iterable[BatchLine]) -> None:
    chunk: list[BatchLine] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= _INSERT_CHUNK:
            BatchLine.objects.bulk_create(chunk)
            chunk = []
    if chunk:
        BatchLine.objects.bulk_create(chunk)


# -- reading and cancelling -------------------------------------------------------


def get_batch(*, team_id: str, batch_id: str) -> Batch:
    try:
        return Batch.objects.get(pk=batch_id, team_id=team_id)
    except Batch.DoesNotExist:
        raise NotFound(f"no batch {batch_id!r}", param="batch_id") from None


def list_batches(
    *, team_id: str, after: str | None, limit: int
) -> tuple[list[Batch], bool]:
    """A page of the team's batches, newest first, after the cursor; and has_more."""
    rows = Batch.objects.filter(team_id=team_id)
    if after:
        cursor = get_batch(team_id=team_id, batch_id=after)
        rows = rows.filter(
            Q(created_at__lt=cursor.created_at)
            | Q(created_at=cursor.created_at, id__lt=cursor.id)
        )
    page = list(rows.order_by("-created_at", "-id")[: limit + 1])
    return page[:limit], len(page) > limit


# What a cancel writes (and all the audit trail watches of it, batches.api.views).
CANCEL_FIELDS = ("status", "cancelling_at")


def cancel_batch(*, team_id: str, batch_id: str, now: datetime | None = None) -> Batch:
    """Ask for a batch to stop: its runner sends no new line, lets the lines in
    flight finish and ends it ``cancelled`` with what was done.

    Raises:
        InvalidRequest: the batch has already ended (409 would hide that it did).
    """
    now = now or timezone.now()
    batch = get_batch(team_id=team_id, batch_id=batch_id)
    changed = Batch.objects.filter(pk=batch.pk, status=Batch.Status.IN_PROGRESS).update(
        status=Batch.Status.CANCELLING, cancelling_at=now
    )
    batch.refresh_from_db()
    if not changed and batch.status != Batch.Status.CANCELLING:
        raise InvalidRequest(
            f"the batch has already ended ({batch.status})",
            param="batch_id",
            code="batch_ended",
        )
    return batch


def batch_object(batch: Batch) -> dict[str, Any]:
    """The batch in OpenAI's shape, with the seed's fields and the scheduler's."""

    def at(moment: datetime | None) -> int | None:
        return int(moment.timestamp()) if moment is not None else None

    body: dict[str, Any] = {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": ({"object": "list", "data": batch.errors} if batch.errors else None),
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": at(batch.created_at),
        "in_progress_at": at(batch.in_progress_at),
        "expires_at": at(batch.deadline_at),
        "finalizing_at": at(batch.finalizing_at),
        "completed_at": at(batch.completed_at),
        "failed_at": at(batch.failed_at),
        "expired_at": at(batch.expired_at),
        "cancelling_at": at(batch.cancelling_at),
        "cancelled_at": at(batch.cancelled_at),
        "request_counts": {
            "total": batch.total,
            "completed": batch.completed,
            "failed": batch.failed,
        },
        "metadata": batch.metadata or None,
        # The seed's form.
        "batch_id": batch.id,
        "model": batch.model_id,
        "input_uri": batch.input_uri or None,
        "output_uri": batch.output_uri or None,
        "deadline": at(batch.deadline_at),
        # What the scheduler decided last, and why.
        "priority": batch.priority,
        "refused": batch.refused,
        "at_risk": batch.at_risk,
        "at_risk_since": at(batch.at_risk_since),
        "projected_finish_at": at(batch.projected_finish_at),
        "schedule": batch.schedule_reason,
    }
    return body


# -- finishing -------------------------------------------------------------------


def finalize(batch_id: str, ending: str, *, now: datetime | None = None) -> bool:
    """End a batch as ``ending`` (completed, expired or cancelled); idempotent.

    Lines not finished are marked expired or cancelled (they go to the error file
    with OpenAI's codes); the output file (answered 2xx) and the error file are
    written under deterministic ids, so finalising twice writes the same files;
    the seed's ``output_uri`` gets every line's result in input order; the batch's
    key is revoked. The ending is stored with the ``finalizing`` status, so a
    finaliser that died between its two transactions is finished the same way
    (``batches.runner.dispatch``). The caller must hold the batch's lease (or know
    no runner is alive). Returns False when the batch had already ended.
    """
    now = now or timezone.now()
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(pk=batch_id)
        if batch.status in Batch.ENDED:
            return False
        if batch.status != Batch.Status.FINALIZING:
            unfinished = BatchLine.objects.filter(
                batch=batch,
                status__in=(BatchLine.Status.PENDING, BatchLine.Status.RUNNING),
            )
            left = _LEFT.get(ending)
            if left is not None:
                status, code, message = left
                unfinished.update(
                    status=status,
                    runner="",
                    error={"code": code, "message": message},
                    finished_at=now,
                )
            elif unfinished.exists():
                raise RuntimeError(f"{batch_id} has unfinished lines: not completed")
            batch.status = Batch.Status.FINALIZING
            batch.finalizing_at = now
            batch.ending = ending
            batch.schedule_reason = f"finalizing ({ending})"
            batch.save(
                update_fields=["status", "finalizing_at", "ending", "schedule_reason"]
            )
    output, errors, problems = _write_files(batch)
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(pk=batch_id)
        if batch.status in Batch.ENDED:
            return False
        ending = batch.ending or ending
        batch.output_file = output
        batch.error_file = errors
        batch.errors = [*(batch.errors or []), *problems]
        batch.status = ending
        setattr(batch, f"{ending}_at", now)
        batch.schedule_reason = _ENDED_REASON.get(ending, ending)
        batch.lease_until = None
        batch.runner = ""
        batch.save()
        if batch.key_id is not None:
            ApiKey.objects.filter(pk=batch.key_id, revoked_at__isnull=True).update(
                revoked_at=now
            )
    return True


_LEFT: dict[str, tuple[str, str, str]] = {
    Batch.Status.EXPIRED: (BatchLine.Status.EXPIRED, "batch_expired", EXPIRED_MESSAGE),
    Batch.Status.CANCELLED: (
        BatchLine.Status.CANCELLED,
        "batch_cancelled",
        CANCELLED_MESSAGE,
    ),
}
_ENDED_REASON: dict[str, str] = {
    Batch.Status.COMPLETED: "completed",
    Batch.Status.EXPIRED: "expired at the deadline, with the output of what finished",
    Batch.Status.CANCELLED: "cancelled, with the output of what finished",
}


def _write_files(
    batch: Batch,
) -> tuple[BatchFile | None, BatchFile | None, list[dict[str, Any]]]:
    """Write the output and error files (and the seed's output_uri) from the rows."""
    hex_id = batch.id.removeprefix("batch_")
    ok: list[bytes] = []
    bad: list[bytes] = []
    every: list[bytes] = []
    lines = BatchLine.objects.filter(batch=batch).order_by("index")
    for line in lines.iterator(chunk_size=_INSERT_CHUNK):
        if line.status_code is not None:
            record = output_line(
                batch_id=batch.id,
                index=line.index,
                custom_id=line.custom_id or None,
                status_code=line.status_code,
                body=line.response,
            )
        else:
            error = line.error or {"code": "unknown", "message": "no answer"}
            record = error_line(
                batch_id=batch.id,
                index=line.index,
                custom_id=line.custom_id or None,
                code=str(error.get("code")),
                message=str(error.get("message")),
            )
        encoded = json.dumps(record, separators=(",", ":")).encode()
        (ok if line.status == BatchLine.Status.DONE else bad).append(encoded)
        every.append(encoded)
    output = _store(batch, f"file-{hex_id}-output", "batch_output.jsonl", ok)
    errors = _store(batch, f"file-{hex_id}-errors", "batch_errors.jsonl", bad)
    problems: list[dict[str, Any]] = []
    if batch.output_uri:
        try:
            storage.write_lines(batch.output_uri, every)
        except (storage.StorageRefused, OSError) as exc:
            # The results are in the output and error files all the same.
            logger.warning("batch %s: output_uri not written: %s", batch.id, exc)
            problems.append(
                {
                    "code": "output_uri_unwritable",
                    "message": f"the results could not be written to output_uri "
                    f"({type(exc).__name__}); they are in the output and error files",
                    "param": "output_uri",
                    "line": None,
                }
            )
    return output, errors, problems


def _store(
    batch: Batch, file_id: str, filename: str, lines: list[bytes]
) -> BatchFile | None:
    if not lines:
        return None
    uri = storage.file_uri(file_id)
    size, digest = storage.write_lines(uri, lines)
    found, _ = BatchFile.objects.update_or_create(
        id=file_id,
        defaults={
            "team_id": batch.team_id,
            "purpose": BatchFile.Purpose.BATCH_OUTPUT,
            "filename": filename,
            "bytes": size,
            "sha256": digest,
            "uri": uri,
            "created_at": timezone.now(),
        },
    )
    return found

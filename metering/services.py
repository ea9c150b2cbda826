"""Use-cases for usage: flushing the gateway's counts to rows, and reading hit rates.

Two ways in, one per deployment mode (seed step 12):

- With Redis, gateways add to per-minute hashes of running totals
  (``metering.counters.RedisUsageCounter``) and ``flush_redis_usage`` (the beat
  task ``metering.flush_usage``) writes each closed minute's totals to its row. The
  flush runs in three phases that are separately callable: ``read_closed_usage``,
  ``write_usage_rows`` (one transaction) and ``forget_flushed`` (Redis cleanup,
  after the commit).
- Embedded (no Redis), each gateway process drains its own ledger and calls
  ``flush_memory_usage``, which adds to the rows.

The rollout guards' figures (``metering.figures``) are flushed the same two ways,
with usage: ``flush_redis_figures`` (each listed bucket's full totals, overwritten)
and ``flush_memory_figures`` (added). ``version_figures`` and ``figure_buckets``
read them back for the guards and the console.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from functools import partial

import redis
from django.conf import settings
from django.db import IntegrityError, models, transaction
from django.db.models import F, Value
from django.db.models.functions import Greatest

from accounts.models import Team
from metering.counters import (
    USAGE_KEEP_FLUSHED_S,
    check_counts,
    parse_usage_hash_key,
    usage_index_key,
)
from metering.domain.figures import Role, VersionFigures
from metering.domain.usage import (
    COUNTER_FIELDS,
    UsageCounts,
    UsageKey,
)
from metering.figures import (
    FIGURES_KEEP_FLUSHED_S,
    FigureKey,
    figures_conversations_key,
    figures_index_key,
    parse_figures_hash_key,
)
from metering.models import Usage, VersionFigure
from models_registry.models import Model, ModelVersion

logger = logging.getLogger(__name__)

# Forget a flushed hash only if it still holds what the flush read: a gateway that
# added in between leaves it indexed, and the next flush writes the new totals.
# The hash itself is kept (shorter TTL), and so are the keys after it (a figures
# bucket's HyperLogLog), so that late counts still add to the full totals.
# KEYS: index, hash, then any keys kept with it. ARGV: keep_ms, then the
# field/value pairs read. Usage and the rollout figures both flush through it.
_FORGET_IF_UNCHANGED = """
local current = redis.call('HGETALL', KEYS[2])
if #current ~= #ARGV - 1 then return 0 end
local read = {}
for i = 2, #ARGV, 2 do read[ARGV[i]] = ARGV[i + 1] end
for i = 1, #current, 2 do
  if read[current[i]] ~= current[i + 1] then return 0 end
end
redis.call('SREM', KEYS[1], KEYS[2])
for k = 2, #KEYS do
  local ttl = redis.call('PTTL', KEYS[k])
  if ttl == -1 or ttl > tonumber(ARGV[1]) then
    redis.call('PEXPIRE', KEYS[k], ARGV[1])
  end
end
return 1
"""


@dataclass(frozen=True, slots=True)
class PendingUsage:
    """A closed minute's usage hash as the flush read it.

    ``fields`` are the hash's field/value pairs verbatim, for the compare in
    ``forget_flushed``.
    """

    hash_key: str
    key: UsageKey
    counts: UsageCounts
    fields: tuple[tuple[str, str], ...]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decode_counts(fields: Iterable[tuple[str, str]]) -> UsageCounts | None:
    values = dict(fields)
    try:
        counts = UsageCounts(**{f: int(values.get(f, 0)) for f in COUNTER_FIELDS})
        check_counts(counts)
    except ValueError:
        return None
    return counts


def read_closed_usage(
    *, client: redis.Redis, prefix: str, now: datetime, grace_s: float = 5.0
) -> list[PendingUsage]:
    """Return the indexed usage hashes whose minute closed ``grace_s`` before ``now``.

    The grace covers gateways whose clocks run a little behind and adds still in
    flight. Index members that are malformed, or whose hash holds counts no row may
    hold, are dropped from Redis with a warning; members whose hash expired leave
    the index.
    """
    index = usage_index_key(prefix)
    cutoff = now.timestamp() - 60 - grace_s
    closed: list[tuple[str, UsageKey]] = []
    garbage: list[str] = []
    for member in client.smembers(index):
        hash_key = _text(member)
        key = parse_usage_hash_key(prefix, hash_key)
        if key is None:
            garbage.append(hash_key)
        elif key.minute_epoch <= cutoff:
            closed.append((hash_key, key))
    closed.sort(key=lambda item: item[0])
    pipe = client.pipeline(transaction=False)
    for hash_key, _ in closed:
        pipe.hgetall(hash_key)
    pending: list[PendingUsage] = []
    expired: list[PendingUsage] = []
    for (hash_key, key), raw in zip(closed, pipe.execute(), strict=True):
        fields = tuple(sorted((_text(f), _text(v)) for f, v in raw.items()))
        counts = _decode_counts(fields)
        if not fields:
            expired.append(PendingUsage(hash_key, key, UsageCounts(), fields))
        elif counts is None:
            garbage.append(hash_key)
        else:
            pending.append(PendingUsage(hash_key, key, counts, fields))
    if garbage:
        logger.warning("Dropping %d malformed usage hashes: %s", len(garbage), garbage)
    if garbage or expired:
        forget_flushed(client=client, prefix=prefix, flushed=expired, dropped=garbage)
    return pending


def _versions_by_name(
    keys: Collection[UsageKey],
) -> tuple[set[str], dict[tuple[str, str], int]]:
    """Return the known teams and the ids of the known (model, version) pairs."""
    teams = set(
        Team.objects.filter(team__in={k.team for k in keys}).values_list(
            "team", flat=True
        )
    )
    rows = ModelVersion.objects.filter(
        model_id__in={k.model for k in keys}, version__in={k.version for k in keys}
    ).values_list("pk", "model_id", "version")
    return teams, {(model, version): pk for pk, model, version in rows}


def _write_rows(
    *,
    entries: Mapping[UsageKey, UsageCounts],
    merge: Callable[[str, int], models.Expression | F],
    region: str | None,
) -> list[UsageKey]:
    """Upsert one row per known key (and ``region``: None is this process's,
    ``PLATFORM_REGION``) with ``merge(counter, value)``; return the keys."""
    region = settings.PLATFORM_REGION if region is None else region
    teams, versions = _versions_by_name(entries.keys())
    written: list[UsageKey] = []
    with transaction.atomic():
        # A fixed order, so two flushes lock the same rows in the same order and
        # cannot deadlock.
        order = sorted(
            entries, key=lambda k: (k.minute_epoch, k.team, k.model, k.version)
        )
        for key in order:
            counts = entries[key]
            try:
                check_counts(counts)
            except ValueError:
                logger.warning(
                    "Skipping impossible usage counts for %s: %s", key, counts
                )
                continue
            version_id = versions.get((key.model, key.version))
            if key.team not in teams or version_id is None:
                logger.warning(
                    "Skipping usage of unknown team or version: %s %s@%s at %s",
                    key.team,
                    key.model,
                    key.version,
                    key.minute_at,
                )
                continue
            lookup = {
                "team_id": key.team,
                "model_id": key.model,
                "version_id": version_id,
                "region": region,
                "minute": key.minute_at,
            }
            updates = {f: merge(f, getattr(counts, f)) for f in COUNTER_FIELDS}
            if not Usage.objects.filter(**lookup).update(**updates):
                try:
                    # A savepoint: a concurrent insert of the same row must not
                    # break the whole flush; it becomes an update instead.
                    with transaction.atomic():
                        Usage.objects.create(**lookup, **asdict(counts))
                except IntegrityError:
                    Usage.objects.filter(**lookup).update(**updates)
            written.append(key)
    return written


def _at_least(field: str, value: int) -> models.Expression:
    return Greatest(
        F(field), Value(value), output_field=models.PositiveBigIntegerField()
    )


def _plus(field: str, value: int) -> F | models.Expression:
    return F(field) + value if value else F(field)


def write_usage_rows(
    *, entries: Mapping[UsageKey, UsageCounts], region: str | None = None
) -> list[UsageKey]:
    """Write each minute's full totals to its row, in one transaction; return the keys.

    SET semantics, so writing the same totals twice (a second flush, or a flush
    after a crash between the commit and the Redis cleanup) never double counts.
    A total is never lowered: ``GREATEST(row, totals)``. Redis totals only grow, so
    for one Redis this equals a plain SET; it matters when two flushes overlap and
    the one that read the older totals commits last.

    Keys naming a team or version that no longer exists are skipped with a warning
    and left out of the result.

    One writer per row: each region has one Redis, so a row is the region's too
    (``region``; None: ``PLATFORM_REGION``, the region this flush runs for). Two
    regions serving the same team, model, version and minute (a failover) write
    two rows, which every reader sums; in one row they would overwrite each
    other's totals (the larger wins: issue 32's region drill lost the smaller).
    The Redis flush and ``flush_memory_usage`` must not both feed the same rows.
    """
    return _write_rows(entries=entries, merge=_at_least, region=region)


def forget_flushed(
    *,
    client: redis.Redis,
    prefix: str,
    flushed: Iterable[PendingUsage],
    dropped: Collection[str] = (),
    keep_s: float = USAGE_KEEP_FLUSHED_S,
) -> int:
    """Take flushed hashes out of the index; delete the ``dropped`` ones; one round trip.

    Call only after the rows are committed. A flushed hash leaves the index only if
    it still holds what was read (else the next flush writes its new totals), and
    is kept ``keep_s`` more, so counts arriving late for its minute add to the full
    totals and re-index it. Return how many hashes left the index.
    """
    index = usage_index_key(prefix)
    forget = client.register_script(_FORGET_IF_UNCHANGED)
    keep_ms = max(1, round(keep_s * 1000))
    pipe = client.pipeline(transaction=False)
    items = list(flushed)
    for item in items:
        args: list[str | int] = [keep_ms]
        for field, value in item.fields:
            args += [field, value]
        forget(keys=[index, item.hash_key], args=args, client=pipe)
    for hash_key in dropped:
        pipe.delete(hash_key)
        pipe.srem(index, hash_key)
    results = pipe.execute()
    forgotten = sum(1 for result in results[: len(items)] if result == 1)
    return forgotten + len(set(dropped))


def flush_redis_usage(
    *,
    client: redis.Redis,
    prefix: str,
    now: datetime,
    grace_s: float = 5.0,
    region: str | None = None,
) -> int:
    """Write the usage of every closed minute found in Redis to rows; return how many.

    Idempotent: the rows get the minutes' full totals (``write_usage_rows``), and
    Redis forgets them only after the commit (``forget_flushed``, run on commit),
    so a crash at any point loses nothing and a rerun double counts nothing. Hashes
    naming an unknown team or version are dropped with a warning.
    """
    pending = read_closed_usage(client=client, prefix=prefix, now=now, grace_s=grace_s)
    if not pending:
        return 0
    written = set(
        write_usage_rows(entries={p.key: p.counts for p in pending}, region=region)
    )
    transaction.on_commit(
        partial(
            forget_flushed,
            client=client,
            prefix=prefix,
            flushed=[p for p in pending if p.key in written],
            dropped=[p.hash_key for p in pending if p.key not in written],
        )
    )
    return len(written)


def flush_memory_usage(
    *, entries: Mapping[UsageKey, UsageCounts], region: str | None = None
) -> int:
    """Add a gateway's drained ledger to the rows, in one transaction; return how many.

    ADD semantics (``F()`` increments): each gateway process drains its own ledger,
    so every entry is written once. Keys naming an unknown team or version are
    skipped with a warning. Known limit of the embedded mode: a gateway that dies
    loses the counts of its last flush interval.
    """
    return len(_write_rows(entries=entries, merge=_plus, region=region))


# -- the rollout guards' figures ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _PendingFigures:
    hash_key: str
    key: FigureKey
    figures: VersionFigures
    fields: tuple[tuple[str, str], ...]


def _figure_columns(figures: VersionFigures) -> dict[str, object]:
    as_json = figures.to_json()
    return {
        name: as_json[name]
        for name in (
            "requests",
            "answered",
            "refusals",
            "output_tokens",
            "conversations",
            "errors",
            "ttft",
            "output",
            "prompt_tokens",
            "cached_tokens",
            "tpot",
            "judged",
        )
    }


def _figures_of(row: VersionFigure) -> VersionFigures:
    return VersionFigures(
        requests=row.requests,
        answered=row.answered,
        refusals=row.refusals,
        output_tokens=row.output_tokens,
        conversations=row.conversations,
        errors={str(k): int(v) for k, v in (row.errors or {}).items()},
        ttft={int(k): int(v) for k, v in (row.ttft or {}).items()},
        output={int(k): int(v) for k, v in (row.output or {}).items()},
        prompt_tokens=row.prompt_tokens,
        cached_tokens=row.cached_tokens,
        tpot={int(k): int(v) for k, v in (row.tpot or {}).items()},
        judged={str(k): int(v) for k, v in (row.judged or {}).items()},
    )


def _read_figures(
    *, client: redis.Redis, prefix: str
) -> tuple[list[_PendingFigures], list[str], list[str]]:
    """Return the listed buckets' totals, the malformed members, the expired ones."""
    members = sorted(_text(m) for m in client.smembers(figures_index_key(prefix)))
    listed: list[tuple[str, FigureKey]] = []
    garbage: list[str] = []
    for hash_key in members:
        key = parse_figures_hash_key(prefix, hash_key)
        if key is None:
            garbage.append(hash_key)
        else:
            listed.append((hash_key, key))
    pipe = client.pipeline(transaction=False)
    for hash_key, _ in listed:
        pipe.hgetall(hash_key)
        pipe.pfcount(figures_conversations_key(hash_key))
    replies = pipe.execute()
    pending: list[_PendingFigures] = []
    expired: list[str] = []
    for index, (hash_key, key) in enumerate(listed):
        raw, conversations = replies[2 * index], replies[2 * index + 1]
        fields = tuple(sorted((_text(f), _text(v)) for f, v in raw.items()))
        if not fields:
            expired.append(hash_key)
            continue
        try:
            figures = VersionFigures.from_fields(dict(fields))
        except ValueError:
            garbage.append(hash_key)
            continue
        # The hash counts no conversations itself: the HyperLogLog beside it does,
        # over every gateway process (an estimate, exact for small counts).
        figures = replace(figures, conversations=int(conversations))
        pending.append(_PendingFigures(hash_key, key, figures, fields))
    return pending, garbage, expired


def _known_models(keys: Iterable[FigureKey]) -> set[str]:
    return set(
        Model.objects.filter(model__in={k.model for k in keys}).values_list(
            "model", flat=True
        )
    )


def flush_redis_figures(
    *,
    client: redis.Redis,
    prefix: str,
    region: str,
    now: datetime,
    keep_buckets: int = 2,
    grace_s: float = 5.0,
) -> int:
    """Write every listed figures bucket's full totals to its row; return how many.

    Open buckets included, so the guards see the current minute. Each row gets the
    bucket's totals (overwritten: a second flush writes the same rows), with the
    distinct conversations of its HyperLogLog. After the commit, buckets that ended
    more than ``keep_buckets`` buckets (plus ``grace_s``) before ``now`` leave the
    index if unchanged since the read; their hashes stay an hour, so late figures
    still reach their rows. Buckets of an unknown model, and malformed members,
    are dropped with a warning.

    Known limit: two flushes overlapping may write a bucket's older totals last;
    the next flush puts the newer ones back (the bucket is still listed).
    """
    pending, garbage, expired = _read_figures(client=client, prefix=prefix)
    known = _known_models(p.key for p in pending)
    unknown = [p.hash_key for p in pending if p.key.model not in known]
    if unknown:
        logger.warning("Dropping figures of unknown models: %s", unknown)
    if garbage:
        logger.warning(
            "Dropping %d malformed figures hashes: %s", len(garbage), garbage
        )
    written = [p for p in pending if p.key.model in known]
    rows = [
        VersionFigure(
            model_id=p.key.model,
            version=p.key.version,
            role=p.key.role,
            region=region,
            bucket_start=p.key.bucket_start,
            bucket_s=p.key.bucket_s,
            **_figure_columns(p.figures),
        )
        for p in sorted(written, key=lambda p: p.hash_key)
    ]
    if rows:
        with transaction.atomic():
            VersionFigure.objects.bulk_create(
                rows,
                update_conflicts=True,
                unique_fields=["model", "version", "role", "region", "bucket_start"],
                update_fields=[
                    "bucket_s",
                    "requests",
                    "answered",
                    "refusals",
                    "output_tokens",
                    "conversations",
                    "errors",
                    "ttft",
                    "output",
                    "prompt_tokens",
                    "cached_tokens",
                    "tpot",
                    "judged",
                ],
            )
    horizon = now.timestamp() - grace_s
    closed = [
        p
        for p in written
        if p.key.bucket_end_epoch + keep_buckets * p.key.bucket_s <= horizon
    ]
    transaction.on_commit(
        partial(
            _forget_figures,
            client=client,
            prefix=prefix,
            flushed=closed,
            dropped=[*garbage, *unknown],
            expired=expired,
        )
    )
    return len(rows)


def _forget_figures(
    *,
    client: redis.Redis,
    prefix: str,
    flushed: Iterable[_PendingFigures],
    dropped: Collection[str],
    expired: Collection[str],
    keep_s: float = FIGURES_KEEP_FLUSHED_S,
) -> None:
    """Unlist flushed old buckets (if unchanged), delete dropped ones; one round trip."""
    index = figures_index_key(prefix)
    forget = client.register_script(_FORGET_IF_UNCHANGED)
    keep_ms = max(1, round(keep_s * 1000))
    pipe = client.pipeline(transaction=False)
    for item in flushed:
        args: list[str | int] = [keep_ms]
        for field, value in item.fields:
            args += [field, value]
        conversations = figures_conversations_key(item.hash_key)
        forget(keys=[index, item.hash_key, conversations], args=args, client=pipe)
    for hash_key in dropped:
        pipe.delete(hash_key, figures_conversations_key(hash_key))
        pipe.srem(index, hash_key)
    for hash_key in expired:
        pipe.srem(index, hash_key)
    pipe.execute()


def flush_memory_figures(
    *, entries: Mapping[FigureKey, VersionFigures], region: str
) -> int:
    """Add a gateway's drained figures to the rows, in one transaction; return how many.

    ADD semantics: each gateway process drains its own sums (conversations only
    those not reported before), so every entry is written once. Figures of an
    unknown model are skipped with a warning.
    """
    known = _known_models(entries)
    written = 0
    with transaction.atomic():
        order = sorted(
            entries, key=lambda k: (k.bucket_epoch, k.model, k.version, k.role)
        )
        for key in order:
            if key.model not in known:
                logger.warning(
                    "Skipping figures of an unknown model: %s@%s",
                    key.model,
                    key.version,
                )
                continue
            lookup = {
                "model_id": key.model,
                "version": key.version,
                "role": key.role,
                "region": region,
                "bucket_start": key.bucket_start,
            }
            row = VersionFigure.objects.select_for_update().filter(**lookup).first()
            if row is None:
                try:
                    # A savepoint: another process inserting the same row must not
                    # break the whole flush; it becomes an update instead.
                    with transaction.atomic():
                        VersionFigure.objects.create(
                            **lookup,
                            bucket_s=key.bucket_s,
                            **_figure_columns(entries[key]),
                        )
                    written += 1
                    continue
                except IntegrityError:
                    row = VersionFigure.objects.select_for_update().get(**lookup)
            total = _figures_of(row) + entries[key]
            for name, value in _figure_columns(total).items():
                setattr(row, name, value)
            row.save(update_fields=list(_figure_columns(total)))
            written += 1
    return written


def _window(
    *,
    model_id: str,
    version: str,
    role: str,
    since: datetime,
    until: datetime | None,
    bucket_s: int | None,
) -> models.QuerySet[VersionFigure]:
    length = bucket_s or settings.PLATFORM_FIGURES_BUCKET_S
    start = datetime.fromtimestamp(
        (since.timestamp() // length) * length, tz=since.tzinfo
    )
    rows = VersionFigure.objects.filter(
        model_id=model_id, version=version, role=role, bucket_start__gte=start
    )
    if until is not None:
        rows = rows.filter(bucket_start__lt=until)
    return rows


def version_figures(
    *,
    model_id: str,
    version: str,
    role: str,
    since: datetime,
    until: datetime | None = None,
    bucket_s: int | None = None,
) -> VersionFigures:
    """Return a version's figures in one role, summed over regions and buckets.

    Buckets starting at or after ``since`` floored to its bucket (so the bucket
    holding ``since`` counts whole) and before ``until``. ``bucket_s`` defaults to
    ``PLATFORM_FIGURES_BUCKET_S``.
    """
    total = VersionFigures()
    for row in _window(
        model_id=model_id,
        version=version,
        role=role,
        since=since,
        until=until,
        bucket_s=bucket_s,
    ).iterator():
        total = total + _figures_of(row)
    return total


def figure_buckets(
    *,
    model_id: str,
    version: str,
    role: str,
    since: datetime,
    until: datetime | None = None,
    bucket_s: int | None = None,
) -> list[tuple[datetime, VersionFigures]]:
    """Return a version's figures in one role per bucket (summed over regions),
    oldest first; the window is ``version_figures``'s. For a chart."""
    buckets: dict[datetime, VersionFigures] = {}
    for row in _window(
        model_id=model_id,
        version=version,
        role=role,
        since=since,
        until=until,
        bucket_s=bucket_s,
    ).iterator():
        current = buckets.get(row.bucket_start)
        figures = _figures_of(row)
        buckets[row.bucket_start] = figures if current is None else current + figures
    return sorted(buckets.items())


def pool_live_figures(
    *,
    model_id: str,
    since: datetime,
    region: str | None = None,
    bucket_s: int | None = None,
) -> dict[tuple[str, str], VersionFigures]:
    """Return each pool's live figures (role ``pool``) since ``since``, summed
    over buckets, keyed by (version, region); one query.

    The window floors ``since`` to its bucket, as ``version_figures`` does. The
    gateways record these for every request a pool serves, rollout or not.
    """
    length = bucket_s or settings.PLATFORM_FIGURES_BUCKET_S
    start = datetime.fromtimestamp(
        (since.timestamp() // length) * length, tz=since.tzinfo
    )
    rows = VersionFigure.objects.filter(
        model_id=model_id, role=Role.POOL.value, bucket_start__gte=start
    )
    if region is not None:
        rows = rows.filter(region=region)
    totals: dict[tuple[str, str], VersionFigures] = {}
    for row in rows.iterator():
        key = (row.version, row.region)
        figures = _figures_of(row)
        current = totals.get(key)
        totals[key] = figures if current is None else current + figures
    return totals

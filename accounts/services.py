"""Use-cases for teams, keys, admin tokens and limits."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q

from accounts.domain.entitlements import budget_errors, normal_tiers, tier_errors
from accounts.domain.keys import KeyKind, display_prefix, hash_secret, new_secret
from accounts.domain.limits import LimitRecord, limit_errors, share_overflow
from accounts.models import (
    AdminToken,
    ApiKey,
    Team,
    TeamBudget,
    TeamEntitlement,
    TeamLimit,
)
from config.errors import Conflict, InvalidRequest, NotFound
from config.names import SLUG_RULE, is_valid_slug

# last_used_at is written at most this often per secret: a write per request
# would turn every authenticated call into a row update.
LAST_USED_RESOLUTION = timedelta(seconds=60)


def get_team(team_id: str) -> Team:
    """Return the team or raise NotFound."""
    try:
        return Team.objects.get(pk=team_id)
    except Team.DoesNotExist:
        raise NotFound(f"no team named {team_id!r}", param="team") from None


def create_team(*, team_id: str, name: str = "") -> Team:
    """Create a team; its slug must be new and well formed."""
    if not is_valid_slug(team_id):
        raise InvalidRequest(f"team must be {SLUG_RULE}", param="team")
    try:
        with transaction.atomic():
            return Team.objects.create(team=team_id, name=name or team_id)
    except IntegrityError:
        raise Conflict(f"team {team_id!r} already exists", param="team") from None


def issue_key(*, team_id: str, name: str = "") -> tuple[ApiKey, str]:
    """Create an API key for a team; return the record and the secret (shown once)."""
    team = get_team(team_id)
    secret = new_secret(KeyKind.TEAM)
    key = ApiKey.objects.create(
        team=team,
        key_hash=hash_secret(secret),
        prefix=display_prefix(secret),
        name=name,
    )
    return key, secret


def revoke_key(*, team_id: str, key_id: int, now: datetime) -> ApiKey:
    """Revoke one of a team's keys; revoking twice keeps the first revocation time.

    Only keys a person holds: a batch job's key is the batch's to end, and is not
    one of the team's keys here (NotFound), as the key list leaves it out.
    """
    get_team(team_id)
    keys = ApiKey.objects.filter(
        pk=key_id, team_id=team_id, purpose=ApiKey.Purpose.TEAM
    )
    keys.filter(revoked_at__isnull=True).update(revoked_at=now)
    try:
        return keys.get()
    except ApiKey.DoesNotExist:
        raise NotFound(
            f"team {team_id!r} has no key {key_id}", param="key_id"
        ) from None


def create_admin_token(
    *, name: str = "", scope: str = AdminToken.Scope.ADMIN
) -> tuple[AdminToken, str]:
    """Create a control-plane token of ``scope`` (``admin`` or ``reports``); return
    the record and the secret (shown once)."""
    if scope not in AdminToken.Scope.values:
        raise ValueError(f"unknown admin token scope {scope!r}")
    secret = new_secret(KeyKind.ADMIN)
    token = AdminToken.objects.create(
        key_hash=hash_secret(secret),
        prefix=display_prefix(secret),
        name=name,
        scope=scope,
    )
    return token, secret


def authenticate_admin_secret(secret: str, *, now: datetime) -> AdminToken | None:
    """Return the active admin token for ``secret`` and note its use, or None."""
    token = AdminToken.objects.active().filter(key_hash=hash_secret(secret)).first()
    if token is not None:
        _touch(AdminToken, token.pk, now)
    return token


def find_active_team_key(secret: str) -> ApiKey | None:
    """Return the active key a person holds for ``secret``, or None.

    Batch keys (``ApiKey.Purpose.BATCH``) are never returned: the platform mints
    them for one batch job, and they open only the gateway's chat completions,
    never the control plane (``accounts.auth``) nor anything else that asks here.
    """
    return (
        ApiKey.objects.active()
        .filter(key_hash=hash_secret(secret), purpose=ApiKey.Purpose.TEAM)
        .first()
    )


def touch_api_keys(*, key_ids: Collection[int], now: datetime) -> int:
    """Set ``last_used_at`` of the given team keys to ``now``; return rows written.

    One UPDATE for a gateway's batch (``routing.key_uses``). A row already stamped
    at or after ``now`` (another gateway's later batch) is left alone, so the time
    never moves back.
    """
    if not key_ids:
        return 0
    return (
        ApiKey.objects.filter(pk__in=list(key_ids))
        .filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=now))
        .update(last_used_at=now)
    )


def _touch(model: type[AdminToken] | type[ApiKey], pk: int, now: datetime) -> None:
    # Compare-and-set: only rows not touched within the resolution are written.
    model.objects.filter(pk=pk).filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_RESOLUTION)
    ).update(last_used_at=now)


def set_team_limit(
    *,
    team_id: str,
    model_id: str,
    tokens_per_minute: int,
    max_concurrency: int,
    guaranteed_share: float,
) -> tuple[TeamLimit, bool]:
    """Create or replace a team's limits on a model; return (limit, created).

    Raises Conflict when the guaranteed shares of all teams on the model would add
    up to more than the whole pool.
    """
    record = LimitRecord(
        team=team_id,
        model=model_id,
        tokens_per_minute=tokens_per_minute,
        max_concurrency=max_concurrency,
        guaranteed_share=guaranteed_share,
    )
    errors = limit_errors(record)
    if errors:
        param, message = errors[0]
        raise InvalidRequest(f"{param} {message}", param=param)
    team = get_team(team_id)
    with transaction.atomic():
        # Lock the model row so two concurrent limit changes cannot both pass the
        # share check and together promise more than the pool. The row is reached
        # through TeamLimit's foreign key: accounts sits below the registry and
        # imports none of its modules (tests/test_layering.py).
        registry_models = TeamLimit._meta.get_field("model").related_model
        locked = (
            registry_models._default_manager.select_for_update(no_key=True)
            .filter(pk=model_id)
            .first()
        )
        if locked is None:
            raise NotFound(f"no model named {model_id!r}", param="model")
        others = TeamLimit.objects.filter(model_id=model_id).exclude(team=team)
        overflow = share_overflow(
            [*others.values_list("guaranteed_share", flat=True), guaranteed_share]
        )
        if overflow:
            # A 409, not a 400: the body is valid; the other teams' shares are
            # what leave no room for it.
            raise Conflict(
                f"guaranteed shares on {model_id} would total {1 + overflow:.3f}; "
                "the shares of all teams on a model must not exceed 1",
                param="guaranteed_share",
                code="guaranteed_shares_exceed_pool",
            )
        limit, created = TeamLimit.objects.update_or_create(
            team=team,
            model_id=model_id,
            defaults={
                "tokens_per_minute": tokens_per_minute,
                "max_concurrency": max_concurrency,
                "guaranteed_share": guaranteed_share,
            },
        )
    return limit, created


def _check_model(model_id: str) -> None:
    """Raise NotFound unless the model exists (reached through TeamLimit's foreign
    key: accounts imports none of the registry's modules)."""
    registry_models = TeamLimit._meta.get_field("model").related_model
    if not registry_models._default_manager.filter(pk=model_id).exists():
        raise NotFound(f"no model named {model_id!r}", param="model")


def set_team_entitlement(
    *, team_id: str, model_id: str, tiers: Sequence[str]
) -> tuple[TeamEntitlement, bool]:
    """Create or replace the tiers a team may use on a model; return (row, created).

    The gateway reads it from its next snapshot (within a couple of seconds).
    """
    errors = tier_errors(tiers)
    if errors:
        raise InvalidRequest(f"tiers: {errors[0]}", param="tiers")
    team = get_team(team_id)
    _check_model(model_id)
    return TeamEntitlement.objects.update_or_create(
        team=team, model_id=model_id, defaults={"tiers": list(normal_tiers(tiers))}
    )


def set_team_budget(
    *,
    team_id: str,
    model_id: str | None,
    monthly_usd: float,
    soft_fraction: float | None = None,
    hard_fraction: float | None = None,
) -> tuple[TeamBudget, bool]:
    """Create or replace a team's monthly USD budget (``model_id`` None: on all its
    models); return (budget, created).

    Fractions left out take the operator's defaults
    (``PLATFORM_BUDGET_SOFT_FRACTION``, ``PLATFORM_BUDGET_HARD_FRACTION``).
    """
    soft = (
        settings.PLATFORM_BUDGET_SOFT_FRACTION
        if soft_fraction is None
        else soft_fraction
    )
    hard = (
        settings.PLATFORM_BUDGET_HARD_FRACTION
        if hard_fraction is None
        else hard_fraction
    )
    errors = budget_errors(
        monthly_usd=monthly_usd, soft_fraction=soft, hard_fraction=hard
    )
    if errors:
        param, message = errors[0]
        raise InvalidRequest(f"{param} {message}", param=param)
    team = get_team(team_id)
    if model_id is not None:
        _check_model(model_id)
    with transaction.atomic():
        # Two rows for one team and model are refused by the constraints; a
        # concurrent PUT that loses the race retries as an update.
        return TeamBudget.objects.update_or_create(
            team=team,
            model_id=model_id,
            defaults={
                "monthly_usd": Decimal(str(round(monthly_usd, 6))),
                "soft_fraction": soft,
                "hard_fraction": hard,
            },
        )

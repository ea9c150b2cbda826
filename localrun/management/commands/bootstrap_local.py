"""Make a local platform usable: demo team, key, admin token, console users, models.

Idempotent: the secrets are kept in a credentials file (mode 600, under .local/,
never committed) and reused while they still open the platform; anything missing
or revoked is created anew. The file also keeps the process secrets `make up`
hands to the processes (``PROCESS_SECRETS``: the engine key, the simulated
replicas' admin token, the metrics token); one the operator configured wins over
the saved one. The platform's rows come from ``localrun.seeding``, like
those of the tests, the drills and the benchmarks; the console users (an admin, and a
finance user who sees only Reports) are this command's own.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction
from django.utils import timezone

from localrun.seeding import (
    AdminTokenSeed,
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    seed_platform,
)
from metering.roles import FINANCE_GROUP

DEMO_TEAM = "demo"
# A new version's gates on this machine: the load test in steps of half a minute
# (a GPU's default is minutes per step, from 500 output tokens/s up).
LOCAL_GATE_CONFIG: dict[str, Any] = {
    "load_test": {
        "start_tokens_per_s": 1500,
        "step_tokens_per_s": 500,
        "max_tokens_per_s": 4000,
        "warmup_s": 5,
        "duration_s": 20,
        "drain_s": 30,
    }
}
DEMO_MODELS = {
    # model: (example file, min replicas, max replicas, team limit tokens/min)
    "chat-7b": ("chat-7b-v1.json", 2, 12, 600_000),
    "reason-70b": ("reason-70b-v1.json", 1, 3, 60_000),
}
CONSOLE_USER = "admin"
FINANCE_USER = "finance"
KEY_NAME = "make up"
# credentials.json field -> the setting whose configured value wins over it.
PROCESS_SECRETS = {
    "engine_api_key": "PLATFORM_ENGINE_API_KEY",
    "sim_admin_token": "PLATFORM_SIM_ADMIN_TOKEN",
    "metrics_token": "PLATFORM_METRICS_TOKEN",
}


class Command(BaseCommand):
    help = "Create (or reuse) the demo team, its key, an admin token and the console users."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--credentials",
            type=Path,
            default=settings.LOCAL_DIR / "credentials.json",
            help="Where the local secrets are kept between runs.",
        )
        parser.add_argument(
            "--json", action="store_true", help="Print the secrets as JSON."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path: Path = options["credentials"]
        saved = _read(path)
        with transaction.atomic():
            seeded = seed_platform(seed=_demo_seed(saved), now=timezone.now())
            assert seeded.admin_token is not None
            creds = {
                "admin_token": seeded.admin_token,
                "team": DEMO_TEAM,
                "team_key": seeded.keys[DEMO_TEAM],
                "console_user": CONSOLE_USER,
                "console_password": _console_password(saved.get("console_password")),
                "finance_user": FINANCE_USER,
                "finance_password": _finance_password(saved.get("finance_password")),
            }
            for field, setting in PROCESS_SECRETS.items():
                creds[field] = _process_secret(
                    configured=getattr(settings, setting), saved=saved.get(field)
                )
        _write(path, creds)
        if options["json"]:
            self.stdout.write(json.dumps(creds))
            return
        for name, value in creds.items():
            self.stdout.write(f"{name}={value}")


def _demo_seed(saved: dict[str, str]) -> PlatformSeed:
    """Return the demo platform: one team on both example models, in this region."""
    examples = settings.BASE_DIR / "platform" / "examples"
    models = []
    limits = []
    for model_id, (file_name, min_replicas, max_replicas, tpm) in DEMO_MODELS.items():
        body = json.loads((examples / file_name).read_text())
        models.append(
            ModelSeed(
                model_id=model_id,
                versions=(VersionSeed("v1", body, min_replicas, max_replicas),),
                gate_config=LOCAL_GATE_CONFIG,
            )
        )
        limits.append(
            LimitSeed(
                team_id=DEMO_TEAM,
                model_id=model_id,
                tokens_per_minute=tpm,
                max_concurrency=100,
                guaranteed_share=0.25,
            )
        )
    return PlatformSeed(
        region=settings.PLATFORM_REGION,
        teams=(TeamSeed(DEMO_TEAM, name="Demo team", saved_key=saved.get("team_key")),),
        models=tuple(models),
        limits=tuple(limits),
        admin_token=AdminTokenSeed(KEY_NAME, saved_secret=saved.get("admin_token")),
        key_name=KEY_NAME,
    )


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, creds: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(creds, handle, indent=2)
    path.chmod(0o600)


def _process_secret(*, configured: str, saved: str | None) -> str:
    """Return the configured secret, else the saved one, else a new one."""
    if configured:
        return configured
    if isinstance(saved, str) and saved:
        return saved
    return secrets.token_urlsafe(32)


def _console_password(saved: str | None) -> str:
    """Return the password of the console's superuser (made if missing)."""
    return _user_password(
        CONSOLE_USER,
        saved,
        make=lambda password: get_user_model().objects.create_superuser(
            CONSOLE_USER, "", password
        ),
    )


def _finance_password(saved: str | None) -> str:
    """Return the password of the console's finance user: staff, in the finance group
    only (``metering.roles``), so it sees Reports and the usage table."""

    def make(password: str) -> Any:
        user = get_user_model().objects.create_user(
            FINANCE_USER, "", password, is_staff=True
        )
        user.groups.add(Group.objects.get(name=FINANCE_GROUP))
        return user

    return _user_password(FINANCE_USER, saved, make=make)


def _user_password(
    username: str, saved: str | None, *, make: Callable[[str], Any]
) -> str:
    """Return ``saved`` while it opens ``username``, else a new password (setting it,
    or making the user with ``make``)."""
    user = get_user_model().objects.filter(username=username).first()
    if user is not None and saved and user.check_password(saved):
        return saved
    password = secrets.token_urlsafe(18)
    if user is None:
        make(password)
    else:
        user.set_password(password)
        user.save(update_fields=["password"])
    return password

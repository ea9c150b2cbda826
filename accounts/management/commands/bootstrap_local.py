"""Make a local platform usable: demo team, key, admin token, console user, models.

Idempotent: the secrets are kept in a credentials file (mode 600, under .local/,
never committed) and reused while they still open the platform; anything missing
or revoked is created anew.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction
from django.utils import timezone

from accounts import services as accounts
from accounts.models import Team, TeamLimit
from config.api import validated
from models_registry import services as registry
from models_registry.api.serializers import VersionRegisterSerializer
from models_registry.models import Model, ModelVersion, Pool

DEMO_TEAM = "demo"
DEMO_MODELS = {
    # model: (example file, min replicas, max replicas, team limit tokens/min)
    "chat-7b": ("chat-7b-v1.json", 2, 12, 600_000),
    "reason-70b": ("reason-70b-v1.json", 1, 3, 60_000),
}
CONSOLE_USER = "admin"


class Command(BaseCommand):
    help = (
        "Create (or reuse) the demo team, its key, an admin token and a console user."
    )

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
            creds = {
                "admin_token": _admin_token(saved.get("admin_token")),
                "team": DEMO_TEAM,
                "team_key": _team_key(saved.get("team_key")),
                "console_user": CONSOLE_USER,
                "console_password": _console_password(saved.get("console_password")),
            }
            _models()
        _write(path, creds)
        if options["json"]:
            self.stdout.write(json.dumps(creds))
            return
        for name, value in creds.items():
            self.stdout.write(f"{name}={value}")


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


def _admin_token(saved: str | None) -> str:
    if saved and accounts.authenticate_admin_secret(saved, now=timezone.now()):
        return saved
    return accounts.create_admin_token(name="make up")[1]


def _team_key(saved: str | None) -> str:
    if not Team.objects.filter(pk=DEMO_TEAM).exists():
        accounts.create_team(team_id=DEMO_TEAM, name="Demo team")
    if saved:
        key = accounts.find_active_team_key(saved)
        if key is not None and key.team_id == DEMO_TEAM:
            return saved
    return accounts.issue_key(team_id=DEMO_TEAM, name="make up")[1]


def _console_password(saved: str | None) -> str:
    user_model = get_user_model()
    user = user_model.objects.filter(username=CONSOLE_USER).first()
    if user is not None and saved and user.check_password(saved):
        return saved
    password = secrets.token_urlsafe(18)
    if user is None:
        user_model.objects.create_superuser(CONSOLE_USER, "", password)
    else:
        user.set_password(password)
        user.save(update_fields=["password"])
    return password


def _models() -> None:
    examples = settings.BASE_DIR / "platform" / "examples"
    region = settings.PLATFORM_REGION
    for model_id, (file_name, min_replicas, max_replicas, tpm) in DEMO_MODELS.items():
        if not Model.objects.filter(pk=model_id).exists():
            registry.create_model(model_id=model_id)
        version = (
            ModelVersion.objects.filter(model_id=model_id)
            .order_by("created_at")
            .first()
        )
        if version is None:
            body = validated(
                VersionRegisterSerializer,
                json.loads((examples / file_name).read_text()),
            )
            version = registry.register_version(model_id=model_id, **body)
        if Model.objects.get(pk=model_id).live_version_id is None:
            registry.set_alias(model_id=model_id, version=version.version)
        Pool.objects.get_or_create(
            version=version,
            region=region,
            defaults={
                "model_id": model_id,
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
            },
        )
        if not TeamLimit.objects.filter(team_id=DEMO_TEAM, model_id=model_id).exists():
            accounts.set_team_limit(
                team_id=DEMO_TEAM,
                model_id=model_id,
                tokens_per_minute=tpm,
                max_concurrency=100,
                guaranteed_share=0.25,
            )

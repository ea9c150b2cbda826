"""Register a model version from a JSON file with the REST endpoint's body."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from rest_framework.exceptions import ValidationError

from config.api import validated
from config.errors import PlatformError, first_validation_error
from models_registry import services
from models_registry.api.serializers import VersionRegisterSerializer


class Command(BaseCommand):
    help = "Register a version: same body as POST /admin/models/{model}/versions."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", help="The model name, e.g. chat-7b.")
        parser.add_argument("--file", required=True, type=Path, help="version.json")

    def handle(self, *args: Any, **options: Any) -> None:
        path: Path = options["file"]
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise CommandError(f"{path} is not valid JSON: {exc}") from None
        try:
            body = validated(VersionRegisterSerializer, data)
            version = services.register_version(model_id=options["model"], **body)
        except ValidationError as exc:
            param, message = first_validation_error(exc.detail)
            raise CommandError(f"{param}: {message}" if param else message) from None
        except PlatformError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(version.ref)

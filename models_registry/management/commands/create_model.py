"""Register a model name."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from config.errors import PlatformError
from models_registry import services


class Command(BaseCommand):
    help = "Register a model name (versions are registered under it)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", help="The model name, e.g. chat-7b.")
        parser.add_argument("--description", default="")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            model = services.create_model(
                model_id=options["model"], description=options["description"]
            )
        except PlatformError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(model.model)

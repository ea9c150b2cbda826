"""Issue an API key to a team and print it as the only line on stdout."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts import services
from config.errors import PlatformError


class Command(BaseCommand):
    help = "Issue an API key for a team and print it (shown once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("team", help="The team's slug.")
        parser.add_argument("--name", default="", help="What the key is for.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            key, secret = services.issue_key(
                team_id=options["team"], name=options["name"]
            )
        except PlatformError as exc:
            raise CommandError(exc.message) from None
        self.stderr.write(f"key {key.prefix}… issued to {key.team_id}; not shown again")
        self.stdout.write(secret)

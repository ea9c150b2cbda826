"""Create a team."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts import services
from config.errors import PlatformError


class Command(BaseCommand):
    help = "Create a team (a product team calling the API)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("team", help="The team's slug, e.g. search.")
        parser.add_argument("--name", default="", help="A display name.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            team = services.create_team(team_id=options["team"], name=options["name"])
        except PlatformError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(team.team)

"""Create a control-plane admin token and print it as the only line on stdout."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from accounts import services
from accounts.models import AdminToken


class Command(BaseCommand):
    help = "Create a token for /admin/ and print it (shown once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", default="", help="What the token is for.")
        parser.add_argument(
            "--scope",
            choices=AdminToken.Scope.values,
            default=AdminToken.Scope.ADMIN,
            help="admin: the whole control plane; reports: /admin/reports only "
            "(for finance).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        token, secret = services.create_admin_token(
            name=options["name"], scope=options["scope"]
        )
        self.stderr.write(
            f"{token.scope} token {token.prefix}… created; it is not shown again"
        )
        self.stdout.write(secret)

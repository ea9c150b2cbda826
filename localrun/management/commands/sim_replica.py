"""``manage.py sim_replica``: the simulated replica, with the same flags as
``python -m simengine``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from simengine import cli


class Command(BaseCommand):
    help = "Run a simulated vLLM replica (flags as `python -m simengine --help`)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "sim_args", nargs="*", help="flags for the simulated replica"
        )

    def run_from_argv(self, argv: list[str]) -> None:
        # Pass every flag through untouched: they are the replica's, not Django's.
        cli.main(argv[2:])

    def handle(self, *args: Any, **options: Any) -> None:
        cli.main(options["sim_args"])

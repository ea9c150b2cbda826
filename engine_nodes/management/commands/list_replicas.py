"""List replicas as the control plane sees them."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from engine_nodes.models import Replica


class Command(BaseCommand):
    help = "List replicas (model, state, URL), optionally only those in one state."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--state", default=None, help="e.g. serving")
        parser.add_argument("--model", default=None)
        parser.add_argument(
            "--count", action="store_true", help="Print only the count."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        replicas = Replica.objects.order_by("model_id", "replica_id")
        if options["state"]:
            replicas = replicas.filter(state=options["state"])
        if options["model"]:
            replicas = replicas.filter(model_id=options["model"])
        if options["count"]:
            self.stdout.write(str(replicas.count()))
            return
        for replica in replicas:
            self.stdout.write(
                f"{replica.model_id:<12} {replica.state:<9} {replica.url}"
            )

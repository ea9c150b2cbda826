"""Write the audit trail as JSON lines, oldest first (``manage.py audit_export``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import services


def _instant(text: str) -> datetime:
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise CommandError(f"not an ISO 8601 time: {text!r}") from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


class Command(BaseCommand):
    help = (
        "Write the audit trail as JSON lines (one entry a line, oldest first) to "
        "standard output or --output; the filters narrow it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--actor", help="an actor's name, exactly")
        parser.add_argument("--object-type", help="app.model, e.g. accounts.apikey")
        parser.add_argument("--object-id")
        parser.add_argument("--since", help="ISO 8601, inclusive (UTC if no offset)")
        parser.add_argument("--until", help="ISO 8601, exclusive")
        parser.add_argument("--output", help="a file to write instead of stdout")

    def handle(self, *args: Any, **options: Any) -> None:
        query = services.EntryFilter(
            actor=options["actor"],
            object_type=options["object_type"],
            object_id=options["object_id"],
            since=_instant(options["since"]) if options["since"] else None,
            until=_instant(options["until"]) if options["until"] else None,
        )
        entries = services.filter_entries(query).iterator(chunk_size=1000)
        if options["output"]:
            with open(options["output"], "w", encoding="utf-8") as out:
                out.writelines(services.json_lines(entries))
            return
        for line in services.json_lines(entries):
            self.stdout.write(line, ending="")

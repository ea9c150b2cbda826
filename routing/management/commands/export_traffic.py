"""``manage.py export_traffic``: write a window of recorded traffic as a replay trace.

    manage.py export_traffic --model chat-7b --since 2026-12-06T10:00 \\
        --until 2026-12-06T11:00 --out chat-7b.jsonl

Reads the region's Redis (``REDIS_URL``), where gateways keep the requests of
pools that record traffic (``Pool.record_traffic_share``; ``routing.traffic``),
and writes one JSON line per answered request, in arrival order: the fields the
fleet simulator and the load-test gate read (``drills.domain.workload``,
``models_registry.domain.load_test``) and the record's own, with the team and
the routing key hashed (``routing.domain.traffic.trace_lines``). ``--since``
defaults to an hour before ``--until``, which defaults to now. ``--no-text``
leaves out the stand-in ``prompt`` (then only the fleet simulator can replay
the file).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from routing.domain.traffic import trace_lines
from routing.traffic import read_traffic, traffic_salt


def _instant(text: str) -> float:
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise CommandError(f"not an ISO 8601 time: {text!r}") from None
    return (at if at.tzinfo is not None else at.replace(tzinfo=UTC)).timestamp()


class Command(BaseCommand):
    help = (
        "Write a model's recorded traffic in [--since, --until) as a JSONL trace "
        "the fleet simulator and the load-test gate replay (no text; team and "
        "routing key hashed)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model", required=True)
        parser.add_argument("--since", help="ISO 8601, inclusive (UTC if no offset)")
        parser.add_argument("--until", help="ISO 8601, exclusive; default now")
        parser.add_argument("--out", help="the file to write; default stdout")
        parser.add_argument(
            "--no-text",
            action="store_true",
            help="leave out the stand-in prompt text of each line",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.REDIS_URL:
            raise CommandError("traffic is recorded in Redis: set REDIS_URL")
        until = _instant(options["until"]) if options["until"] else time.time()
        since = _instant(options["since"]) if options["since"] else until - 3600.0
        if since >= until:
            raise CommandError("--since must be before --until")
        import redis

        with redis.Redis.from_url(settings.REDIS_URL) as client:
            records = list(
                read_traffic(
                    client,
                    prefix=settings.REDIS_KEY_PREFIX,
                    model=options["model"],
                    since=since,
                    until=until,
                )
            )
        lines, skipped = trace_lines(
            records, salt=traffic_salt(), stand_in_text=not options["no_text"]
        )
        text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
        if options["out"]:
            with open(options["out"], "w", encoding="utf-8") as handle:
                handle.write(text)
        else:
            sys.stdout.write(text)
        conversations = len({line["conversation"] for line in lines})
        self.stderr.write(
            f"{len(lines)} requests in {conversations} conversations written; "
            f"{skipped} without an answer left out"
        )

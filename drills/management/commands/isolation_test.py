"""``manage.py isolation_test``: the seed's isolation test, live at reduced scale."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.isolation import judge, summarise
from drills.isolation import IsolationPlan, run_isolation


class Command(BaseCommand):
    help = (
        "One team sends 10x its token limit while two others work normally; prints "
        "each team's p95 TTFT before and during the flood and who saw 429s."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--phase-s", type=float, default=20.0)
        parser.add_argument("--quiet-streams", type=int, default=4)
        parser.add_argument("--flood-factor", type=float, default=10.0)
        parser.add_argument("--noisy-tokens-per-minute", type=int, default=3_000)
        parser.add_argument("--tolerance", type=float, default=0.10)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        plan = IsolationPlan(
            phase_s=options["phase_s"],
            quiet_streams=options["quiet_streams"],
            flood_factor=options["flood_factor"],
            noisy_tokens_per_minute=options["noisy_tokens_per_minute"],
        )
        rows = summarise(run_isolation(plan))
        verdict = judge(rows, noisy_team="iso-noisy", tolerance=options["tolerance"])
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "rows": [asdict(row) for row in rows],
                        "passed": verdict.passed,
                        "reasons": list(verdict.reasons),
                    },
                    indent=2,
                )
            )
        else:
            self.stdout.write(
                f"{'team':<12} {'phase':<9} {'requests':>8} {'ok':>6} {'429':>6} "
                f"{'other':>6} {'p50 TTFT ms':>12} {'p95 TTFT ms':>12}"
            )
            for row in rows:
                self.stdout.write(
                    f"{row.team:<12} {row.phase:<9} {row.requests:>8} {row.ok:>6} "
                    f"{row.rate_limited:>6} {row.other_errors:>6} "
                    f"{_ms(row.p50_ttft_ms):>12} {_ms(row.p95_ttft_ms):>12}"
                )
            self.stdout.write("PASS" if verdict.passed else "FAIL")
            for reason in verdict.reasons:
                self.stdout.write(f"  - {reason}")
        if not verdict.passed:
            raise CommandError("the quiet teams were not isolated from the flood")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"

"""``manage.py billing_drill``: do the bills equal what the clients were told?

Against a running platform of two regions (``make up REGIONS=2``; its admin token
and gateways are read from ``$PLATFORM_LOCAL_DIR``), two new teams send streams to
both regions' gateways, some cut by the client, some refused; then the usage rows
(the admin report's JSON), the CSV report and each team's
``/v1/organization/usage/completions`` are compared with the tokens told, per
region and in total, and each region's USD with the cost model
(``drills.billing_live``, ``drills.domain.billing_drill``). Prints a table, writes
a plot and ``--json``, and fails on any difference.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.billing_drill import SOURCES, BillingReport, Figures
from drills.management.reports import add_result_arguments, write_result


class Command(BaseCommand):
    help = (
        "Against a running two-region platform: two new teams send streams to both "
        "regions (some cut by the client, some refused); the usage rows, the CSV "
        "report and /v1/organization/usage must equal the tokens the clients were "
        "told, per region and in total, and USD the cost model. Fails on a "
        "difference."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--streams", type=int, default=200)
        parser.add_argument("--concurrency", type=int, default=24)
        parser.add_argument(
            "--local-dir",
            type=Path,
            default=Path(os.environ.get("PLATFORM_LOCAL_DIR", ".local")),
            help="where make up wrote credentials.json and haproxy.cfg "
            "(default $PLATFORM_LOCAL_DIR or .local)",
        )
        parser.add_argument(
            "--settle",
            type=float,
            default=120.0,
            help="seconds to wait past the window's last minute for the usage "
            "flush (default 120)",
        )
        parser.add_argument("--seed", type=int, default=0)
        add_result_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        from drills.billing_live import platform_from_local, run_live
        from drills.experiment_plots import default_plot_path, plot_billing

        wall0 = time.monotonic()
        # One line per HTTP request would bury the table.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            platform = platform_from_local(options["local_dir"])
        except (OSError, KeyError, ValueError) as exc:
            raise CommandError(
                f"no running platform in {options['local_dir']}: {exc}"
            ) from None
        quiet = options["json"] == "-"
        report, window = run_live(
            platform,
            streams=options["streams"],
            concurrency=options["concurrency"],
            seed=options["seed"],
            settle_s=options["settle"],
            log=(lambda _: None) if quiet else self.stdout.write,
        )
        plot = options["plot"] or default_plot_path("billing_drill")
        plot_billing(report, plot, title="Billed vs told, per region")
        data = {
            **report.as_dict(),
            "window": window,
            "wall_s": round(time.monotonic() - wall0, 1),
            "plot": str(plot),
        }
        write_result(
            self.stdout,
            data,
            options["json"],
            lambda: print_report(self.stdout.write, report, window, plot),
        )
        if not report.passed:
            raise CommandError("the bill differs from what clients were told")


_COLUMNS = (
    ("requests", "req"),
    ("prompt_tokens", "prompt"),
    ("cached_tokens", "cached"),
    ("output_tokens", "output"),
    ("rate_limited", "429"),
    ("shed", "503"),
)


def _told(low: Figures, high: Figures, name: str) -> str:
    a, b = getattr(low, name), getattr(high, name)
    return str(a) if a == b else f"{a}..{b}"


def print_report(
    write: Any, report: BillingReport, window: dict[str, Any], plot: Path
) -> None:
    """Write the table through ``write`` (one line a call)."""
    streams = report.streams
    write(
        f"Billing drill: {streams.get('sent', 0)} streams ({streams.get('complete', 0)}"
        f" complete, {streams.get('cut', 0)} cut by the client, "
        f"{streams.get('refused', 0)} refused: {streams.get('refused_429', 0)} 429, "
        f"{streams.get('refused_503', 0)} 503), teams {', '.join(window['teams'])}, "
        f"window {window['from']} to {window['to']}"
    )
    write("")
    head = f"{'region':<8} {'source':<6} " + " ".join(
        f"{label:>14}" for _, label in _COLUMNS
    )
    write(head + "  diff")
    for line in report.lines:
        cells = " ".join(
            f"{_told(line.told.low, line.told.high, name):>14}" for name, _ in _COLUMNS
        )
        write(f"{line.region:<8} {'told':<6} {cells}")
        for source in SOURCES:
            if source not in line.sources:
                continue
            figures = line.sources[source]
            diff = line.differences[source]
            cells = " ".join(f"{getattr(figures, name):>14}" for name, _ in _COLUMNS)
            off = [
                f"{label} {getattr(diff, name):+d}"
                for name, label in _COLUMNS
                if getattr(diff, name)
            ]
            write(f"{'':<8} {source:<6} {cells}  {', '.join(off) or '0'}")
    write("")
    for line in report.lines:
        if line.told.cut and "rows" in line.sources:
            write(
                f"{line.region}: {line.told.cut} streams cut by their clients, billed "
                f"{line.beyond_read('rows')} output tokens past what the clients read "
                f"(at most "
                f"{line.told.high.output_tokens - line.told.low.output_tokens})"
            )
    write("")
    write(
        f"{'region':<8} {'USD billed':>12} {'cost model':>12} {'diff':>10} "
        f"{'GPU USD':>10} {'teams+idle':>10}"
    )
    for c in report.costs:
        write(
            f"{c.region:<8} {c.billed_usd:>12.6f} {c.model_usd:>12.6f} "
            f"{c.difference:>+10.6f} {c.gpu_usd:>10.6f} {c.teams_and_idle_usd:>10.6f}"
        )
    for apart in report.sources_apart:
        write(f"sources apart: {apart}")
    write("")
    write(f"passed: {'yes' if report.passed else 'NO'}")
    write(f"plot: {plot}")

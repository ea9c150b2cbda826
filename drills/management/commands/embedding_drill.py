"""``manage.py embedding_drill``: a RAG ingestion burst on an embedding pool beside
the chat pools, in virtual time, sized by the platform's autoscaler
(``drills.domain.embedding_drill``). Prints a table, writes a plot and
``--json``, and fails when a target is missed.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.embedding_drill import (
    EmbeddingReport,
    EmbeddingScenario,
    at_profile,
    run_embedding_drill,
)
from drills.management.reports import add_result_arguments, write_result
from simengine.domain.embedding_perf import EMBEDDING_PROFILES

_DEFAULT = EmbeddingScenario()


class Command(BaseCommand):
    help = (
        "Search queries all along, then a RAG ingestion burst (requests of 32 "
        "chunks) on an embedding pool beside the chat pools: the autoscaler sizes "
        "it on input tokens/s. Check: the rate it measures, a scale-up within two "
        "ticks, the cold start's backlog drained, a size within the hysteresis "
        "band, latency back under target, back to the floor, fewer GPU-hours than "
        "a pool held at the burst's size."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--duration", type=float, default=_DEFAULT.duration_s, help="virtual s"
        )
        parser.add_argument("--burst-at", type=float, default=_DEFAULT.burst_at_s)
        parser.add_argument("--burst", type=float, default=_DEFAULT.burst_s)
        parser.add_argument(
            "--ingest-rps",
            type=float,
            default=_DEFAULT.ingest_rps,
            help="ingestion requests/s during the burst (32 chunks each)",
        )
        parser.add_argument("--query-rps", type=float, default=_DEFAULT.query_rps)
        parser.add_argument(
            "--embedding-profile",
            choices=sorted(EMBEDDING_PROFILES),
            help="replicas of this simulated embedding profile (batch time, and "
            "its full-batch input tokens/s as the load test's figure; "
            "a100-minilm: the A100 estimate) instead of the drill's own figures",
        )
        parser.add_argument(
            "--every",
            type=int,
            default=2,
            help="print one bin (30 s) in this many",
        )
        add_result_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        from drills.experiment_plots import default_plot_path, plot_embedding

        wall0 = time.monotonic()
        scenario = replace(
            _DEFAULT,
            seed=options["seed"],
            duration_s=options["duration"],
            burst_at_s=options["burst_at"],
            burst_s=options["burst"],
            ingest_rps=options["ingest_rps"],
            query_rps=options["query_rps"],
        )
        if options["embedding_profile"] is not None:
            scenario = at_profile(
                scenario, EMBEDDING_PROFILES[options["embedding_profile"]]
            )
        report = run_embedding_drill(scenario)
        plot = options["plot"] or default_plot_path("embedding_drill")
        plot_embedding(report, plot, title="A RAG ingestion burst on an embedding pool")
        data = {
            **report.as_dict(),
            "wall_s": round(time.monotonic() - wall0, 2),
            "plot": str(plot),
        }
        write_result(
            self.stdout,
            data,
            options["json"],
            lambda: self._print(report, plot, every=max(1, options["every"])),
        )
        if not report.passed:
            raise CommandError("embedding pool targets missed (see the checks)")

    def _print(self, report: EmbeddingReport, plot: object, *, every: int) -> None:
        write = self.stdout.write
        s = report.scenario
        write(
            f"burst {s.burst_tokens_per_s:,.0f} input tokens/s from {s.burst_at_s:g} s "
            f"for {s.burst_s:g} s over queries of {s.query_tokens_per_s:,.0f}; "
            f"{s.replica_tokens_per_s:,.0f} a replica; GPUs {s.region_gpus} "
            f"({s.chat_gpus} held by chat pools)"
        )
        write(
            f"{'t (s)':>7} {'offered/s':>10} {'measured/s':>11} {'served/s':>10} "
            f"{'desired':>7} {'serving':>7} {'p95 (s)':>9}"
        )
        for b in report.bins[::every]:
            measured = (
                "-"
                if b.measured_tokens_per_s is None
                else f"{b.measured_tokens_per_s:,.0f}"
            )
            p95 = "-" if b.p95_latency_s is None else f"{b.p95_latency_s:.3f}"
            write(
                f"{b.start_s:>7.0f} {b.offered_tokens_per_s:>10,.0f} {measured:>11} "
                f"{b.served_tokens_per_s:>10,.0f} {b.desired:>7} {b.serving:>7} "
                f"{p95:>9}"
            )
        write("decisions:")
        for d in report.decisions:
            rate = d.signals.get("admitted_tokens_per_s", 0.0)
            write(
                f"  {d.at:>7.0f} s {d.current:>2} -> {d.desired:>2} "
                f"{d.reason.value:<18} admitted {rate:,.0f}/s queued "
                f"{d.signals['queued_tokens']:,.0f} tokens"
            )
        write(f"{'check':<40} ok   detail")
        for check in report.checks:
            mark = "yes" if check.passed else "NO "
            write(f"{check.name:<40} {mark}  {check.detail}")
        write(f"plot: {plot}")

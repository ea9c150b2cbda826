"""Headless plots of the fleet experiments: the routing A/B, the isolation test, the
overload drill, the capacity test, the autoscaling drill, the region limits drill,
the billing drill and the embedding drill.

Public surface: ``default_plot_path``, ``plot_routing_ab``, ``plot_cache_sweep``,
``plot_isolation``,
``plot_overload``, ``plot_capacity``, ``plot_autoscaling``, ``plot_region_limits``,
``plot_billing``, ``plot_embedding``, ``plot_twin``.

matplotlib with the Agg backend (no display); each function writes one PNG and
returns its path, creating the folder if needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from drills.domain.autoscaling_drill import SHAPES, DrillOutcome, load_factor
from drills.domain.billing_drill import BillingReport
from drills.domain.cache_sweep import SweepPoint
from drills.domain.capacity_test import CapacityAnswer
from drills.domain.embedding_drill import EmbeddingReport
from drills.domain.isolation_sim import NOISY_TEAM, IsolationOutcome
from drills.domain.overload import TIERS, OverloadOutcome
from drills.domain.region_limits import RegionLimitsReport
from drills.domain.routing_ab import PolicyOutcome
from drills.domain.timeline import percentile_in_bins

__all__ = [
    "default_plot_path",
    "plot_autoscaling",
    "plot_billing",
    "plot_cache_sweep",
    "plot_capacity",
    "plot_embedding",
    "plot_isolation",
    "plot_overload",
    "plot_region_limits",
    "plot_routing_ab",
    "plot_twin",
]

_TIER_COLOURS = {"interactive": "#2ca02c", "standard": "#1f77b4", "batch": "#ff7f0e"}
_BASELINE, _NOISY = "#1f77b4", "#d62728"


def default_plot_path(name: str) -> Path:
    """Return ``.local/drills/<name>.png`` under the repository root."""
    root = Path(__file__).resolve().parent.parent
    return root / ".local" / "drills" / f"{name}.png"


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_isolation(outcome: IsolationOutcome, path: Path, *, title: str) -> Path:
    """p95 TTFT and 429s per team in both runs, and the quiet teams' p95 over time."""
    fig = plt.figure(figsize=(13, 8), layout="constrained")
    grid = fig.add_gridspec(2, 2)
    rows = outcome.rows
    names = [row.team for row in rows]
    xs = range(len(rows))
    width = 0.38

    ax = fig.add_subplot(grid[0, 0])
    base = [(row.p95_ttft_ms_baseline or 0.0) for row in rows]
    loud = [(row.p95_ttft_ms_noisy or 0.0) for row in rows]
    ax.bar([x - width / 2 for x in xs], base, width, label="baseline", color=_BASELINE)
    ax.bar([x + width / 2 for x in xs], loud, width, label="with noise", color=_NOISY)
    tolerance = outcome.scenario.tolerance
    ax.scatter(
        list(xs),
        [b * (1 + tolerance) for b in base],
        marker="_",
        s=400,
        color="black",
        label=f"baseline + {tolerance:.0%} (limit)",
    )
    ax.set_xticks(list(xs), names)
    ax.set_ylim(0, max([*base, *loud, 1.0]) * (1 + tolerance) * 1.3)
    ax.set_ylabel("p95 time to first token (ms)")
    ax.set_title("p95 TTFT per team")
    ax.legend(loc="upper center", ncol=3, fontsize=8)

    ax = fig.add_subplot(grid[0, 1])
    base_429 = [row.rate_limited_baseline for row in rows]
    loud_429 = [row.rate_limited_noisy for row in rows]
    ax.bar(
        [x - width / 2 for x in xs], base_429, width, label="baseline", color=_BASELINE
    )
    ax.bar(
        [x + width / 2 for x in xs], loud_429, width, label="with noise", color=_NOISY
    )
    for x, value in enumerate(loud_429):
        ax.annotate(f"{value:,}", (x + width / 2, value), ha="center", va="bottom")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("requests answered 429")
    ax.set_title("429s per team (only the noisy team may see any)")
    ax.legend(loc="upper left")

    ax = fig.add_subplot(grid[1, :])
    bin_s = 10.0
    for label, result, colour in (
        ("baseline", outcome.baseline, _BASELINE),
        ("with noise", outcome.noisy, _NOISY),
    ):
        points = [
            (r.arrived_at, r.ttft_s * 1000)
            for r in result.requests
            if r.team != NOISY_TEAM and r.outcome == "ok" and r.ttft_s is not None
        ]
        values = percentile_in_bins(
            points, result.started_at, result.ended_at, bin_s, 0.95
        )
        minutes = [
            (result.started_at + (i + 0.5) * bin_s) / 60 for i in range(len(values))
        ]
        ax.plot(
            minutes,
            [v if v is not None else float("nan") for v in values],
            label=label,
            color=colour,
            linewidth=1.0,
        )
    flood_start_s = outcome.scenario.flood_start_s
    if flood_start_s > outcome.noisy.started_at:
        ax.axvline(
            flood_start_s / 60,
            color="black",
            linestyle="--",
            linewidth=0.8,
            label="flood starts",
        )
    ax.set_xlabel("simulated time (minutes)")
    ax.set_ylabel("p95 TTFT of the quiet teams (ms)")
    ax.set_title(f"Quiet teams' p95 TTFT per {bin_s:g} s")
    ax.legend(loc="upper right")
    fig.suptitle(title)
    return _save(fig, path)


def plot_overload(outcome: OverloadOutcome, path: Path, *, title: str) -> Path:
    """Arrival rate, queue depth, 429s and sheds, and p95 TTFT per tier over time."""
    bins = outcome.bins
    scenario = outcome.scenario
    minutes = [(start + scenario.bin_s / 2) / 60 for start in bins.starts_s]
    fig, axes = plt.subplots(4, 1, figsize=(12, 12), sharex=True, layout="constrained")
    ax = axes[0]
    ax.step(
        minutes,
        [f * scenario.capacity_rps for f in bins.factors],
        where="mid",
        color="black",
        label="offered",
    )
    ax.axhline(
        scenario.capacity_rps,
        color="grey",
        linestyle="--",
        linewidth=0.8,
        label=f"planned capacity ({scenario.capacity_rps:,.0f} req/s)",
    )
    ax.stackplot(
        minutes,
        *[[n / scenario.bin_s for n in bins.served[tier]] for tier in TIERS],
        labels=[f"{tier} served" for tier in TIERS],
        colors=[_TIER_COLOURS[tier] for tier in TIERS],
        alpha=0.5,
    )
    ax.set_ylabel("requests/s")
    ax.set_title("Offered load and requests served in full, per tier (stacked)")
    ax.legend(loc="upper left", fontsize=8)
    for tier in TIERS:
        colour = _TIER_COLOURS[tier]
        axes[1].plot(minutes, bins.queued_max[tier], label=tier, color=colour)
        axes[2].plot(minutes, bins.shed[tier], label=f"{tier} shed (503)", color=colour)
        if tier != "batch":  # batch waits or is shed, never 429 (admission rule 5)
            axes[2].plot(
                minutes,
                bins.rate_limited[tier],
                label=f"{tier} 429",
                color=colour,
                linestyle=":",
            )
        values = bins.ttft_p95_s[tier]
        axes[3].plot(
            minutes,
            [v if v is not None else float("nan") for v in values],
            label=tier,
            color=colour,
        )
    axes[1].set_ylabel("requests queued (max per bin)")
    axes[1].set_title("Admission queue depth per tier")
    axes[2].set_ylabel(f"requests per {scenario.bin_s:g} s")
    axes[2].set_title("Refused per tier: 503 shed (solid) and 429 (dotted)")
    axes[3].set_ylabel("p95 TTFT (s)")
    axes[3].set_yscale("log")
    axes[3].axhline(1.0, color="grey", linestyle="--", linewidth=0.8, label="1 s")
    axes[3].set_title(f"p95 time to first token per tier, per {scenario.bin_s:g} s")
    axes[3].set_xlabel("simulated time (minutes)")
    axes[0].set_ylim(bottom=0)
    for ax in axes[1:]:
        ax.legend(loc="upper left", fontsize=8, ncol=2)
    for ax in axes:
        for index in range(1, len(scenario.factors)):
            ax.axvline(
                scenario.step_start_s(index) / 60,
                color="grey",
                linewidth=0.5,
                linestyle=":",
            )
    fig.suptitle(title)
    return _save(fig, path)


def plot_capacity(answer: CapacityAnswer, path: Path, *, title: str) -> Path:
    """Output tokens/s, p95 TTFT and stream rate against the offered load."""
    steps = answer.steps
    criteria = answer.criteria
    offered = [s.offered_tokens_per_s for s in steps]
    colours = ["#2ca02c" if s.holds else "#d62728" for s in steps]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5), layout="constrained")

    ax = axes[0]
    ax.plot(offered, [s.output_tokens_per_s for s in steps], color="black")
    ax.scatter(offered, [s.output_tokens_per_s for s in steps], c=colours, zorder=3)
    ax.plot(offered, offered, color="grey", linestyle=":", label="served = offered")
    if answer.tokens_per_s is not None:
        ax.axhline(
            answer.tokens_per_s,
            color="#2ca02c",
            linestyle="--",
            label=f"capacity {answer.tokens_per_s:,.0f} tokens/s",
        )
    ax.set_xlabel("offered output tokens/s")
    ax.set_ylabel("served output tokens/s")
    ax.set_title("Throughput (green: step holds, red: fails)")
    ax.legend(loc="upper left")

    ax = axes[1]
    ax.plot(
        offered,
        [s.ttft_p95_s if s.ttft_p95_s is not None else float("nan") for s in steps],
        marker="o",
        label="p95 TTFT",
    )
    ax.axhline(
        criteria.ttft_p95_max_s,
        color="#d62728",
        linestyle="--",
        label=f"bound {criteria.ttft_p95_max_s:g} s",
    )
    ax.set_yscale("log")
    ax.set_xlabel("offered output tokens/s")
    ax.set_ylabel("p95 time to first token (s)")
    ax.set_title("p95 TTFT")
    ax.legend(loc="upper left")

    ax = axes[2]
    for label, attribute in (
        ("median stream", "stream_tokens_per_s_p50"),
        ("5th percentile stream", "stream_tokens_per_s_p5"),
    ):
        values = [getattr(s, attribute) for s in steps]
        ax.plot(
            offered,
            [v if v is not None else float("nan") for v in values],
            marker="o",
            label=label,
        )
    ax.axhline(
        criteria.stream_min_tokens_per_s,
        color="#d62728",
        linestyle="--",
        label=f"minimum {criteria.stream_min_tokens_per_s:g} tokens/s",
    )
    ax.set_xlabel("offered output tokens/s")
    ax.set_ylabel("stream rate, 1 / TPOT (tokens/s)")
    ax.set_title("Per-stream token rate")
    ax.legend(loc="upper right")
    fig.suptitle(title)
    return _save(fig, path)


_POLICY_COLOURS = {
    "round_robin": "#d62728",
    "least_tokens": "#ff7f0e",
    "prefix_affinity": "#2ca02c",
    "cache_aware": "#9467bd",
}


def plot_routing_ab(
    outcomes: Sequence[PolicyOutcome], path: Path, *, title: str
) -> Path:
    """Draw the A/B: four bar charts and the imbalance over time; return ``path``.

    Rows of more than one engine (``--compare-engines``) are named policy and
    engine; the second engine's bars are hatched."""
    fig = plt.figure(figsize=(13, 8), layout="constrained")
    grid = fig.add_gridspec(2, 4)
    engines = list(dict.fromkeys(o.engine for o in outcomes))
    mixed = len(engines) > 1
    names = [f"{o.policy} {o.engine}" if mixed else o.policy for o in outcomes]
    colours = [_POLICY_COLOURS.get(o.policy, "#1f77b4") for o in outcomes]
    hatches = [("//" if engines.index(o.engine) else "") for o in outcomes]
    bars = [
        ("Prefix hit rate", "share of history served from cache", "prefix_hit_rate", 1),
        ("p95 time to first token", "seconds", "ttft_p95_s", 1),
        (
            "Uncached prefill",
            "prompt tokens/s computed",
            "uncached_prefill_tokens_per_s",
            1,
        ),
        ("Imbalance (mean)", "max / mean tokens in flight", "imbalance_mean", 1),
    ]
    for column, (label, unit, attribute, _) in enumerate(bars):
        ax = fig.add_subplot(grid[0, column])
        values = [getattr(o, attribute) or 0.0 for o in outcomes]
        ax.bar(range(len(names)), values, color=colours, hatch=hatches)
        ax.set_xticks(
            range(len(names)),
            [n.replace("_", "\n").replace(" ", "\n") for n in names],
            fontsize=7 if mixed else None,
        )
        ax.set_title(label)
        ax.set_ylabel(unit)
        for x, value in enumerate(values):
            ax.annotate(
                f"{value:,.2f}" if value < 100 else f"{value:,.0f}",
                (x, value),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax = fig.add_subplot(grid[1, :])
    for outcome, name, colour, hatch in zip(
        outcomes, names, colours, hatches, strict=True
    ):
        samples = [
            (s.at, s.imbalance)
            for s in outcome.result.samples
            if s.imbalance is not None
        ]
        if samples:
            ax.plot(
                [t / 60 for t, _ in samples],
                [v for _, v in samples],
                label=name,
                color=colour,
                linewidth=0.8,
                linestyle="--" if hatch else "-",
            )
    ax.axhline(1.25, color="grey", linestyle="--", linewidth=0.8, label="bound 1.25")
    ax.set_xlabel("simulated time (minutes)")
    ax.set_ylabel("highest / mean tokens in flight")
    ax.set_title("Imbalance over time, sampled every second")
    ax.legend(loc="upper right")
    fig.suptitle(title)
    return _save(fig, path)


def plot_cache_sweep(
    points: Sequence[SweepPoint], path: Path, *, title: str, hit_target: float = 0.8
) -> Path:
    """Draw the sweep: hit rate, p95 TTFT and uncached prefill against replicas (a
    line per host-offload size, the plan's hit rate dashed, carried points filled)
    and against host-offload size (a line per fleet); return ``path``."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), layout="constrained")
    offloads = sorted({p.host_offload_gib for p in points})
    fleets = sorted({p.replicas for p in points})
    cmap = plt.get_cmap("viridis")
    panels = [
        ("Prefix hit rate", "share of history served from cache", "prefix_hit_rate"),
        ("p95 time to first token", "seconds (log)", "ttft_p95_s"),
        (
            "Uncached prefill",
            "prompt tokens/s computed",
            "uncached_prefill_tokens_per_s",
        ),
    ]

    def draw(
        ax: Any,
        group: list[SweepPoint],
        x_of: Callable[[SweepPoint], float],
        attribute: str,
        colour: Any,
        label: str,
    ) -> None:
        xs = [x_of(p) for p in group]
        ys = [getattr(p, attribute) or 0.0 for p in group]
        ax.plot(xs, ys, color=colour, label=label, linewidth=1.2)
        ax.scatter(
            xs,
            ys,
            color=[colour if p.carried else "white" for p in group],
            edgecolors=colour,
            zorder=3,
        )
        if attribute == "prefix_hit_rate":
            ax.plot(
                xs,
                [
                    p.plan.hit_rate
                    if p.plan is not None and p.plan.step_ms is not None
                    else float("nan")
                    for p in group
                ],
                color=colour,
                linestyle="--",
                linewidth=0.8,
            )

    for column, (label, unit, attribute) in enumerate(panels):
        rows: tuple[
            tuple[
                Sequence[float],
                Callable[[SweepPoint], float],
                str,
                Callable[[float], str],
            ],
            ...,
        ] = (
            (offloads, lambda p: p.replicas, "replicas", lambda k: f"{k:g} GiB"),
            (
                fleets,
                lambda p: p.host_offload_gib,
                "host offload (GiB per replica)",
                lambda k: f"{k:g} replicas",
            ),
        )
        for row, (keys, x_of, x_label, name_of) in enumerate(rows):
            ax = axes[row][column]
            for index, key in enumerate(keys):
                group = [
                    p
                    for p in points
                    if (p.host_offload_gib if row == 0 else p.replicas) == key
                ]
                group.sort(key=x_of)
                colour = cmap(index / max(len(keys) - 1, 1))
                draw(ax, group, x_of, attribute, colour, name_of(key))
            ax.set_xlabel(x_label)
            ax.set_ylabel(unit)
            ax.set_title(label)
            if attribute == "prefix_hit_rate":
                ax.axhline(hit_target, color="grey", linestyle=":", linewidth=0.8)
                ax.set_ylim(0, 1)
            if attribute == "ttft_p95_s":
                ax.set_yscale("log")
                ax.axhline(1.0, color="grey", linestyle=":", linewidth=0.8)
            ax.legend(fontsize=7)
    fig.suptitle(
        f"{title}\nfilled: carried (p95 TTFT < 1 s, streams at 30 tokens/s); "
        "dashed: the capacity plan's expected hit rate"
    )
    return _save(fig, path)


_FLEET_COLOURS = {
    "plan": "#9467bd",
    "fixed": "#7f7f7f",
    "cold": "#d62728",
    "warm": "#2ca02c",
}


def plot_autoscaling(outcome: DrillOutcome, path: Path, *, title: str) -> Path:
    """Per case (a column per load shape, a line per fleet): replicas serving and
    starting with the offered load, utilisation, and p95 TTFT per minute."""
    scenario = outcome.scenario
    shapes = [s for s in SHAPES if any(c.case.shape == s for c in outcome.cases)]
    fig, axes = plt.subplots(
        3,
        len(shapes),
        figsize=(6 * len(shapes), 11),
        squeeze=False,
        layout="constrained",
    )
    target = scenario.pool.target_utilisation
    for column, shape in enumerate(shapes):
        replicas, utilisation, ttft = axes[0][column], axes[1][column], axes[2][column]
        cases = [c for c in outcome.cases if c.case.shape == shape]
        for case in cases:
            series = case.figures.series
            colour = _FLEET_COLOURS[case.case.fleet]
            minutes = [at / 60 for at in series.at_s]
            replicas.step(
                minutes,
                series.serving,
                where="post",
                color=colour,
                label=f"{case.case.fleet} serving",
            )
            if any(series.starting):
                replicas.step(
                    minutes,
                    series.starting,
                    where="post",
                    color=colour,
                    linestyle=":",
                    label=f"{case.case.fleet} starting",
                )
            utilisation.plot(
                minutes,
                [float("nan") if u is None else u for u in series.utilisation],
                color=colour,
                linewidth=0.8,
                label=case.case.fleet,
            )
            ttft.plot(
                [(at + 30.0) / 60 for at in series.minute_s],
                [float("nan") if v is None else v for v in series.ttft_p95_s],
                color=colour,
                marker=".",
                label=case.case.fleet,
            )
        if cases:
            at_s = cases[0].figures.series.at_s
            offered = replicas.twinx()
            offered.plot(
                [at / 60 for at in at_s],
                [load_factor(scenario, shape, at) * scenario.peak_rps for at in at_s],
                color="black",
                linestyle="--",
                linewidth=0.7,
            )
            offered.set_ylim(bottom=0)
            offered.set_ylabel("offered requests/s (dashed)")
        if shape != "day":
            for ax in (replicas, utilisation, ttft):
                ax.axvline(
                    scenario.change_s / 60, color="black", linewidth=0.5, linestyle=":"
                )
        replicas.set_ylim(bottom=0)
        replicas.set_ylabel("replicas")
        replicas.set_title(f"{shape}: replicas serving (solid) and starting (dotted)")
        replicas.legend(loc="upper left", fontsize=7, ncol=2)
        utilisation.axhline(
            target, color="grey", linestyle="--", linewidth=0.8, label=f"{target:.0%}"
        )
        utilisation.set_ylim(bottom=0)
        utilisation.set_ylabel("(in flight + queued) / serving capacity")
        utilisation.set_title(f"{shape}: utilisation at each autoscaler tick")
        utilisation.legend(loc="upper left", fontsize=7)
        ttft.axhline(
            scenario.ttft_target_s,
            color="grey",
            linestyle="--",
            linewidth=0.8,
            label=f"target {scenario.ttft_target_s:g} s",
        )
        ttft.set_yscale("log")
        ttft.set_ylabel("p95 TTFT, interactive + standard (s)")
        ttft.set_title(f"{shape}: p95 TTFT per minute")
        ttft.set_xlabel("simulated time (minutes)")
        ttft.legend(loc="upper left", fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)


def plot_region_limits(report: RegionLimitsReport, path: Path, *, title: str) -> Path:
    """Shares over time (top); admitted per minute over the limit (bottom)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    times = [s[0] for s in report.shares]
    top.plot(times, [s[1] for s in report.shares], label="both: east's share")
    top.plot(times, [s[2] for s in report.shares], label="both: west's share")
    top.plot(times, [s[3] for s in report.shares], label="one: east's share")
    top.set_ylabel("share of the limit")
    top.set_ylim(0, 1.05)
    top.legend(loc="lower left", fontsize=8)
    top.set_title(title)
    bottom.plot(*zip(*report.both_minutes, strict=True), label="both (2 regions)")
    bottom.plot(*zip(*report.one_minutes, strict=True), label="one (east only)")
    bottom.axhline(1.10, color="#d62728", linestyle="--", linewidth=1, label="110%")
    bottom.axhline(0.95, color="#2ca02c", linestyle="--", linewidth=1, label="95%")
    bottom.set_ylabel("admitted / limit, last minute")
    bottom.set_xlabel("s")
    bottom.legend(loc="upper right", fontsize=8)
    return _save(fig, path)


def plot_billing(report: BillingReport, path: Path, *, title: str) -> Path:
    """Per region and in total: output tokens told (the cut streams' bounds as an
    error bar) beside each source's (left); USD billed beside the cost model's
    (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [line.region for line in report.lines]
    sources = list(report.lines[0].sources) if report.lines else []
    width = 0.8 / (len(sources) + 1)
    for i, line in enumerate(report.lines):
        low, high = line.told.low.output_tokens, line.told.high.output_tokens
        left.bar(
            i,
            low,
            width,
            color="#7f7f7f",
            yerr=[[0], [high - low]],
            capsize=3,
            label="told (cut: up to max_tokens)" if i == 0 else None,
        )
        for j, name in enumerate(sources):
            left.bar(
                i + (j + 1) * width,
                line.sources[name].output_tokens,
                width,
                color=f"C{j}",
                label=name if i == 0 else None,
            )
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    left.set_ylabel("output tokens")
    left.legend(fontsize=8)
    left.set_title(title)
    regions = [c.region for c in report.costs]
    xs = range(len(regions))
    right.bar(
        [x - 0.2 for x in xs],
        [c.billed_usd for c in report.costs],
        0.4,
        label="billed (report)",
    )
    right.bar(
        [x + 0.2 for x in xs],
        [c.model_usd for c in report.costs],
        0.4,
        label="cost model",
    )
    right.set_xticks(list(xs), regions)
    right.set_ylabel("USD, the drill's teams")
    right.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_embedding(report: EmbeddingReport, path: Path, *, title: str) -> Path:
    """Input tokens/s offered, measured by the autoscaler and served (top);
    replicas desired and serving (middle); p95 latency per bin (bottom, log)."""
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    bins = report.bins
    starts = [b.start_s for b in bins]
    top.plot(starts, [b.offered_tokens_per_s for b in bins], label="offered")
    measured = [(b.start_s, b.measured_tokens_per_s) for b in bins]
    top.plot(
        [t for t, m in measured if m is not None],
        [m for _, m in measured if m is not None],
        linestyle="--",
        label="measured by the autoscaler",
    )
    top.plot(starts, [b.served_tokens_per_s for b in bins], label="served")
    top.set_ylabel("input tokens/s")
    top.legend(loc="upper right", fontsize=8)
    top.set_title(title)
    middle.step(starts, [b.desired for b in bins], where="post", label="desired")
    middle.step(starts, [b.serving for b in bins], where="post", label="serving")
    middle.axhline(
        report.scenario.needed_at_burst,
        color="#7f7f7f",
        linestyle=":",
        linewidth=1,
        label="the burst's size at 70%",
    )
    middle.set_ylabel("replicas")
    middle.legend(loc="upper right", fontsize=8)
    latencies = [(b.start_s, b.p95_latency_s) for b in bins]
    bottom.plot(
        [t for t, p in latencies if p is not None],
        [p for _, p in latencies if p is not None],
        color="#d62728",
    )
    bottom.axhline(
        report.scenario.latency_target_s, color="#2ca02c", linestyle="--", linewidth=1
    )
    bottom.set_yscale("log")
    bottom.set_ylabel("p95 latency (s)")
    bottom.set_xlabel("s")
    return _save(fig, path)


def plot_twin(seeds: Sequence[dict[str, Any]], path: Path) -> Path:
    """The traffic twin against the live window (``twin_check``): TTFT CDFs and the
    replicas serving over time of the first seed, and every seed's relative error
    on the gated figures."""
    fig, (cdf, sizes, errors) = plt.subplots(
        1, 3, figsize=(16, 5), layout="constrained"
    )
    first = seeds[0]["series"] if seeds else {}
    for key, label, colour in (
        ("live_ttft_s", "live", _BASELINE),
        ("twin_ttft_s", "twin", _NOISY),
    ):
        values = sorted(first.get(key, []))
        if values:
            cdf.plot(
                [v * 1000 for v in values],
                [(i + 1) / len(values) for i in range(len(values))],
                label=label,
                color=colour,
            )
    cdf.axhline(0.95, color="#7f7f7f", linestyle=":", linewidth=1)
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("share of requests")
    cdf.set_title(f"seed {seeds[0]['seed']}: TTFT" if seeds else "TTFT")
    cdf.legend(loc="lower right", fontsize=8)
    for key, label, colour in (
        ("live_replicas", "live", _BASELINE),
        ("twin_replicas", "twin", _NOISY),
    ):
        points = first.get(key, [])
        if points:
            sizes.step(
                [p[0] for p in points],
                [p[1] for p in points],
                where="post",
                label=f"{label} serving",
                color=colour,
            )
    sizes.set_xlabel("s into the window")
    sizes.set_ylabel("replicas")
    sizes.set_title("replicas the autoscaler chose")
    sizes.legend(loc="upper left", fontsize=8)
    width = 0.38
    xs = range(len(seeds))
    for offset, name, label in (
        (-width / 2, "ttft_p95_s", "p95 TTFT"),
        (width / 2, "hit_rate", "hit rate"),
    ):
        values = []
        for seed in seeds:
            rows = {row.name: row for row in seed["comparison"].rows}
            error = rows[name].relative_error
            values.append(0.0 if error is None else error * 100)
        errors.bar([x + offset for x in xs], values, width, label=label)
    tolerance = seeds[0]["comparison"].tolerance * 100 if seeds else 15.0
    for bound in (tolerance, -tolerance):
        errors.axhline(bound, color="#7f7f7f", linestyle="--", linewidth=1)
    errors.set_xticks(list(xs), [str(seed["seed"]) for seed in seeds])
    errors.set_xlabel("seed")
    errors.set_ylabel("predicted vs measured (%)")
    errors.set_title("relative error")
    errors.legend(loc="upper right", fontsize=8)
    return _save(fig, path)

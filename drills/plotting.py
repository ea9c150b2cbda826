"""Headless plots of the fleet experiments (matplotlib, Agg backend).

Public surface: ``plot_routing_ab``, ``default_plot_path``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from drills.domain.routing_ab import PolicyOutcome

__all__ = ["default_plot_path", "plot_routing_ab"]

_COLOURS = {
    "round_robin": "#d62728",
    "least_tokens": "#ff7f0e",
    "prefix_affinity": "#2ca02c",
}


def default_plot_path(name: str) -> Path:
    """Return ``.local/drills/<name>.png`` under the repository root."""
    root = Path(__file__).resolve().parent.parent
    return root / ".local" / "drills" / f"{name}.png"


def plot_routing_ab(
    outcomes: Sequence[PolicyOutcome], path: Path, *, title: str
) -> Path:
    """Draw the A/B: four bar charts and the imbalance over time; return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = plt.figure(figsize=(13, 8), layout="constrained")
    grid = fig.add_gridspec(2, 4)
    names = [o.policy for o in outcomes]
    colours = [_COLOURS.get(name, "#1f77b4") for name in names]
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
        ax.bar(range(len(names)), values, color=colours)
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names])
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
    for outcome, colour in zip(outcomes, colours, strict=True):
        samples = [
            (s.at, s.imbalance)
            for s in outcome.result.samples
            if s.imbalance is not None
        ]
        if samples:
            ax.plot(
                [t / 60 for t, _ in samples],
                [v for _, v in samples],
                label=outcome.policy,
                color=colour,
                linewidth=0.8,
            )
    ax.axhline(1.25, color="grey", linestyle="--", linewidth=0.8, label="bound 1.25")
    ax.set_xlabel("simulated time (minutes)")
    ax.set_ylabel("highest / mean tokens in flight")
    ax.set_title("Imbalance over time, sampled every second")
    ax.legend(loc="upper right")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

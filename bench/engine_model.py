"""Benchmark the pure replica model: calibration against the spec, and its own speed.

Runs the virtual-time closed loop (``simengine.domain.workload``) with 650-token
prompts and 250-token outputs, no prefix hits: 1, 16, 32, 64, 83 and 128 streams on
``a100-8b`` and 83 streams on every other profile. For each point it reports the
simulated throughput and latencies next to the research spec's prediction (§2.4) and
the model's speed: simulated tokens per wall-clock second, median of ``--runs`` runs.
Run from the repository root:

    .venv/bin/python bench/engine_model.py --out bench/results/engine_model.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simengine.domain.perf import PROFILES  # noqa: E402
from simengine.domain.workload import LoadResult, run_closed_loop  # noqa: E402

PROMPT_TOKENS = 650
OUTPUT_TOKENS = 250
A100_STREAMS = (1, 16, 32, 64, 83, 128)
# Research spec §2.4, "Mixed load" table: output tok/s predicted by its own script.
SPEC_TOKENS_PER_S = {
    ("a100-8b", 1): 93,
    ("a100-8b", 16): 1082,
    ("a100-8b", 32): 1679,
    ("a100-8b", 64): 2278,
    ("a100-8b", 83): 2485,
    ("a100-8b", 128): 2748,
    ("h100-8b", 83): 5017,
    ("h100-70b-tp4", 83): 2515,
}


def measure(
    profile_name: str, streams: int, *, duration_s: float, warmup_s: float, runs: int
) -> dict[str, object]:
    """Run one load point ``runs`` times (same seed); return its row."""
    walls_s: list[float] = []
    result: LoadResult | None = None
    for _ in range(runs):
        started = time.perf_counter()
        result = run_closed_loop(
            PROFILES[profile_name],
            streams=streams,
            prompt_tokens=PROMPT_TOKENS,
            output_tokens=OUTPUT_TOKENS,
            duration_s=duration_s,
            warmup_s=warmup_s,
        )
        walls_s.append(time.perf_counter() - started)
    assert result is not None
    wall_s = statistics.median(walls_s)
    simulated = result.simulated_output_tokens + result.simulated_prompt_tokens
    return {
        "profile": profile_name,
        "streams": streams,
        "output_tokens_per_s": round(result.output_tokens_per_s, 1),
        "spec_output_tokens_per_s": SPEC_TOKENS_PER_S.get((profile_name, streams)),
        "mean_tpot_ms": round(result.mean_tpot_ms, 2),
        "mean_ttft_ms": round(result.mean_ttft_ms, 1),
        "p95_ttft_ms": round(result.p95_ttft_ms, 1),
        "requests_completed": result.requests_completed,
        "steps": result.steps,
        "num_preemptions": result.num_preemptions,
        "virtual_s": round(warmup_s + result.duration_s, 2),
        "wall_s_median": round(wall_s, 3),
        "wall_s_runs": [round(w, 3) for w in walls_s],
        "simulated_output_tokens": result.simulated_output_tokens,
        "simulated_tokens": simulated,
        "output_tokens_per_wall_s": round(result.simulated_output_tokens / wall_s),
        "tokens_per_wall_s": round(simulated / wall_s),
    }


def format_table(rows: list[dict[str, object]]) -> str:
    """Return the rows as a fixed-width text table."""
    header = (
        f"{'profile':<18}{'streams':>8}{'out tok/s':>11}{'spec':>7}{'TPOT ms':>9}"
        f"{'TTFT ms':>9}{'p95 TTFT':>10}{'wall s':>8}{'sim out tok/wall s':>20}"
        f"{'sim tok/wall s':>16}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        spec = row["spec_output_tokens_per_s"]
        lines.append(
            f"{row['profile']:<18}{row['streams']:>8}{row['output_tokens_per_s']:>11,.0f}"
            f"{spec if spec is not None else '-':>7}{row['mean_tpot_ms']:>9.2f}"
            f"{row['mean_ttft_ms']:>9.1f}{row['p95_ttft_ms']:>10.1f}"
            f"{row['wall_s_median']:>8.2f}{row['output_tokens_per_wall_s']:>20,}"
            f"{row['tokens_per_wall_s']:>16,}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run every load point, print the table and write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/engine_model.json")
    )
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)

    points = [("a100-8b", s) for s in A100_STREAMS]
    points += [(name, 83) for name in PROFILES if name != "a100-8b"]
    rows = []
    for profile_name, streams in points:
        rows.append(
            measure(
                profile_name,
                streams,
                duration_s=args.duration_s,
                warmup_s=args.warmup_s,
                runs=args.runs,
            )
        )
        sys.stdout.write(f"measured {profile_name} x {streams} streams\n")
        sys.stdout.flush()
    sys.stdout.write("\n" + format_table(rows))

    report = {
        "benchmark": "engine_model",
        "workload": {
            "kind": "closed loop, zero think time, unique prompts (no prefix hits)",
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "runs": args.runs,
            "jitter_cv": 0.04,
            "seed": 0,
        },
        "target": "a100-8b at 83 streams: 2,500 +- 10% output tok/s, TPOT 33 +- 4 ms",
        "speed_note": (
            "tokens_per_wall_s = (generated + prefill tokens computed over the whole "
            "run, warmup included) / median wall seconds of one run"
        ),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(f"\nwrote {args.out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

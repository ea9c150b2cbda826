"""How fast the fleet simulator runs: one simulated hour at the seed's peak.

Runs ``drills.domain.fleet.FleetSim`` for ``--hours`` of virtual time on
``--replicas`` replicas at ``--rate`` requests/s (the seed's 100: about 1,000
concurrent streams), once per policy in ``--policies``, and reports the CPU seconds
each run took (process time, so another process on the machine does not inflate
it), requests and events simulated, and the run's headline figures. The target
(issue 6): one simulated hour at the seed's peak in under 60 s of one core.

    .venv/bin/python bench/fleet.py --out bench/results/fleet.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from drills.domain.fleet import FleetSim  # noqa: E402
from drills.domain.fleet_config import FleetConfig  # noqa: E402
from drills.domain.workload import ChatWorkload  # noqa: E402

TARGET_CPU_S = 60.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/fleet.json")
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--replicas", type=int, default=12)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--policies", default="prefix_affinity,round_robin")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    runs = []
    for policy in args.policies.split(","):
        sim = FleetSim(
            FleetConfig(replicas=args.replicas, policy=policy, seed=args.seed),
            ChatWorkload(arrival_rate=args.rate),
        )
        wall = time.perf_counter()
        cpu = time.process_time()
        result = sim.run(args.hours * 3600.0, drain_s=0.0)
        cpu_s = time.process_time() - cpu
        wall_s = time.perf_counter() - wall
        summary = result.summary()
        streams = [sum(s.tokens_in_flight) for s in result.samples]
        run = {
            "policy": policy,
            "simulated_s": args.hours * 3600.0,
            "cpu_s": round(cpu_s, 2),
            "wall_s": round(wall_s, 2),
            "cpu_s_per_simulated_hour": round(cpu_s / args.hours, 2),
            "requests": summary["requests"],
            "concurrent_requests_mean": round(
                sum(r.num_running + r.num_waiting for r in sim.serving), 1
            ),
            "tokens_in_flight_mean": round(sum(streams) / len(streams))
            if streams
            else 0,
            "summary": summary,
        }
        runs.append(run)
        print(
            f"{policy:<16} {args.hours:g} h simulated in {cpu_s:6.1f} s CPU "
            f"({wall_s:.1f} s wall), {summary['requests']:,} requests, "
            f"p95 TTFT {summary['ttft_p95_s']:.2f} s, "
            f"hit rate {summary['prefix_hit_rate'] or 0:.1%}",
            flush=True,
        )
    worst = max(run["cpu_s_per_simulated_hour"] for run in runs)
    report = {
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "scenario": {
            "replicas": args.replicas,
            "arrival_rate": args.rate,
            "hours": args.hours,
            "seed": args.seed,
        },
        "runs": runs,
        "checks": {
            "cpu_s_per_simulated_hour_worst": worst,
            "under_60_s_per_simulated_hour": worst < TARGET_CPU_S,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

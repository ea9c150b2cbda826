"""Embedding throughput through the gateway, beside the simulated replica direct.

One simulated replica run as vLLM's pooling runner (``python -m simengine
--runner pooling``, model ``embed-1``) and one gateway in front of it (one uvicorn
worker, ``localrun.processes``), set up by ``bench/gateway.py``'s ``Platform``: a
fresh database (migrated, then dropped), Redis under a unique prefix, team
``bench`` with a key and huge limits, the embedding model ``embed-1`` whose one
replica row points at the simulated replica, and a thread that publishes its
beats. The gateway runs every request as a team's: auth, admission, limits,
routing, metering.

For each ``--concurrency`` level, C closed-loop clients (one keep-alive
connection each) send ``POST /v1/embeddings`` requests of ``--texts`` short
texts (32: a page of search snippets) to the replica and to the gateway, in pairs
whose order alternates (``--repeats`` pairs per level), ``--requests`` timed
requests a run after C untimed ones. Each run gives input tokens/s (the
answers' ``usage.prompt_tokens`` over the run's wall time), requests/s, latency
p50/p95 and errors; through the gateway also the gateway's CPU seconds per 1,000
requests (``/proc``). The summary is the median over repeats, and the gateway's
overhead is given as ratios of those medians: latency p50 and p95 (gateway /
direct) and throughput (direct / gateway; 1.0 is no cost).

    .venv/bin/python bench/embeddings.py --out bench/results/embeddings.json \\
        [--concurrency 1,4,16] [--repeats 3] [--requests 48] [--texts 32]

The replica's speed is its model (``simengine.embeddings``: 9 ms a batch plus
0.32 ms a token, vLLM's CPU build with MiniLM on this box), so what changes
between the two targets is the gateway alone. Every process started runs in its
own session and is stopped with its group on exit, Ctrl-C and SIGTERM included,
and the database is dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from bench.gateway import Platform, http  # noqa: E402
from bench.vllm_fidelity import group_cpu_s, machine_busy_s  # noqa: E402
from localrun.processes import Process, sim_replica, start_gateway, wait_until  # noqa: E402

LOG_DIR = ROOT / ".local" / "bench-embeddings"
TARGETS = ("direct", "gateway")
MODEL = "embed-1"
WORDS = (
    *("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"),
    *("india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa"),
    *("quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray"),
)

REGISTER = """
import json, os
from django.utils import timezone
from localrun.seeding import (
    LimitSeed, ModelSeed, PlatformSeed, TeamSeed, VersionSeed, digest, seed_platform,
    version_body, VERSION_BODY,
)
from engine_nodes.models import Replica

urls = json.loads(os.environ["BENCH_REPLICA_URLS"])
now = timezone.now()
body = version_body(
    weights_uri="s3://models/embed-1/",
    weights_hash=digest("bench embed"),
    engine_config={
        **VERSION_BODY["engine_config"], "runner": "pooling",
        "enable_prefix_caching": False,
    },
)
seeded = seed_platform(
    seed=PlatformSeed(
        region="bench",
        teams=(TeamSeed("bench"),),
        models=(
            ModelSeed("embed-1", kind="embedding", dimensions=384,
                      max_input_tokens=512, versions=(
                VersionSeed("v1", body, min_replicas=len(urls),
                            max_replicas=len(urls)),
            )),
        ),
        limits=(
            LimitSeed("bench", "embed-1", tokens_per_minute=10**12,
                      max_concurrency=1_000_000),
        ),
    ),
    now=now,
)
version = seeded.versions["embed-1"][0]
for index, url in enumerate(urls):
    Replica.objects.create(
        replica_id=f"bench-r{index}", model_id="embed-1", version=version,
        region="bench", node="bench-node", url=url, state="serving",
        last_heartbeat=now,
    )
print("BENCH " + json.dumps({"key": seeded.keys["bench"], "version": version.version}))
"""


class EmbeddingPlatform(Platform):
    """``Platform`` serving ``embed-1``, without the region's snapshot file (which
    ``bench/gateway.py``'s gateways, of the same region, would otherwise share)."""

    model = MODEL
    register = REGISTER

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PLATFORM_SNAPSHOT_PATH"] = ""
        return env


def texts_for(request: int, count: int) -> list[str]:
    """``count`` short texts (4 to 9 words), different for every request."""
    return [
        " ".join(
            WORDS[(request * 7 + i * 3 + w) % len(WORDS)] for w in range(4 + (i % 6))
        )
        for i in range(count)
    ]


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0..1) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


async def drive(
    url: str, key: str, *, concurrency: int, requests: int, texts: int, first: int
) -> dict[str, Any]:
    """Send ``requests`` timed embeddings requests from ``concurrency`` closed
    loops (after one untimed request each); return what came back.

    The window runs from the first timed request to the last answer.
    """
    latencies: list[float] = []
    tokens = 0
    errors: dict[str, int] = {}
    next_index = [first]
    left = [requests]
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)

    async def one(session: aiohttp.ClientSession, *, timed: bool) -> None:
        nonlocal tokens
        index = next_index[0]
        next_index[0] += 1
        body = {"model": MODEL, "input": texts_for(index, texts)}
        started = time.monotonic()
        try:
            async with session.post(
                f"{url}/v1/embeddings", data=json.dumps(body), headers=headers
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return
        took = time.monotonic() - started
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
            return
        answer = json.loads(raw)
        if len(answer.get("data", ())) != texts:
            errors["short_answer"] = errors.get("short_answer", 0) + 1
            return
        if timed:
            latencies.append(took)
            tokens += int(answer["usage"]["prompt_tokens"])

    async def loop(session: aiohttp.ClientSession) -> None:
        while left[0] > 0:
            left[0] -= 1
            await one(session, timed=True)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # One untimed request a loop first: every connection open and warm.
        await asyncio.gather(*(one(session, timed=False) for _ in range(concurrency)))
        start = time.monotonic()
        await asyncio.gather(*(loop(session) for _ in range(concurrency)))
        wall_s = time.monotonic() - start
    return {
        "requests_ok": len(latencies),
        "errors": errors,
        "input_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "input_tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "requests_per_s": round(len(latencies) / wall_s, 2) if wall_s > 0 else None,
        "p50_ms": _ms(percentile(latencies, 0.50)),
        "p95_ms": _ms(percentile(latencies, 0.95)),
        "mean_ms": _ms(statistics.fmean(latencies) if latencies else None),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def run_one(
    args: argparse.Namespace,
    target: str,
    url: str,
    key: str,
    level: int,
    gateway_pgid: int,
    first: int,
) -> dict[str, Any]:
    cpu_before = group_cpu_s([gateway_pgid])
    busy_before, wall_before = machine_busy_s(), time.monotonic()
    result = asyncio.run(
        drive(
            url,
            key,
            concurrency=level,
            requests=args.requests,
            texts=args.texts,
            first=first,
        )
    )
    gateway_cpu_s = group_cpu_s([gateway_pgid]) - cpu_before
    elapsed = time.monotonic() - wall_before
    result.update(
        target=target,
        concurrency=level,
        # Everything that ran on the box over the run, in cores (the replica,
        # the client and the gateway included): how contended it was.
        busy_cores=round((machine_busy_s() - busy_before) / elapsed, 2),
    )
    if target == "gateway" and result["requests_ok"]:
        result["gateway_cpu_s_per_1k_requests"] = round(
            gateway_cpu_s * 1000 / (result["requests_ok"] + level), 2
        )
    return result


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def summarize(runs: list[dict[str, Any]], levels: list[int]) -> dict[str, Any]:
    """Medians over repeats per (level, target), and the gateway's overhead."""
    keys = ("input_tokens_per_s", "requests_per_s", "p50_ms", "p95_ms")
    summary: dict[str, Any] = {}
    for level in levels:
        row: dict[str, Any] = {}
        for target in TARGETS:
            mine = [
                r for r in runs if r["concurrency"] == level and r["target"] == target
            ]
            row[target] = {key: _median([r[key] for r in mine]) for key in keys}
            row[target]["errors"] = sum(sum(r["errors"].values()) for r in mine)
            row[target]["repeats"] = len(mine)
        cpu = [
            r.get("gateway_cpu_s_per_1k_requests")
            for r in runs
            if r["concurrency"] == level and r["target"] == "gateway"
        ]
        row["gateway"]["cpu_s_per_1k_requests"] = _median(cpu)
        direct, gateway = row["direct"], row["gateway"]
        row["overhead"] = {
            "p50_ratio": _ratio(gateway["p50_ms"], direct["p50_ms"]),
            "p95_ratio": _ratio(gateway["p95_ms"], direct["p95_ms"]),
            "throughput_ratio": _ratio(
                direct["input_tokens_per_s"], gateway["input_tokens_per_s"]
            ),
            "p50_added_ms": (
                round(gateway["p50_ms"] - direct["p50_ms"], 2)
                if gateway["p50_ms"] is not None and direct["p50_ms"] is not None
                else None
            ),
        }
        summary[str(level)] = row
    return summary


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 3) if top is not None and bottom else None


def table(summary: dict[str, Any]) -> str:
    head = (
        f"{'C':>3} | {'direct tok/s':>12} {'p50':>7} {'p95':>7} | "
        f"{'gateway tok/s':>13} {'p50':>7} {'p95':>7} {'CPU-s/1k':>8} | "
        f"{'p50 x':>6} {'p95 x':>6} {'tput x':>6}"
    )
    lines = [head, "-" * len(head)]
    for level, row in summary.items():
        d, g, o = row["direct"], row["gateway"], row["overhead"]
        lines.append(
            f"{level:>3} | {d['input_tokens_per_s']!s:>12} {d['p50_ms']!s:>7} "
            f"{d['p95_ms']!s:>7} | {g['input_tokens_per_s']!s:>13} {g['p50_ms']!s:>7} "
            f"{g['p95_ms']!s:>7} {g['cpu_s_per_1k_requests']!s:>8} | "
            f"{o['p50_ratio']!s:>6} {o['p95_ratio']!s:>6} {o['throughput_ratio']!s:>6}"
        )
    lines.append(
        "latency in ms; x: gateway over direct (latency), direct over gateway "
        "(throughput): medians over repeats"
    )
    return "\n".join(lines)


def wait_for_route(url: str, key: str, timeout_s: float) -> None:
    """Wait until an embeddings request through the gateway reaches the replica."""
    body = {"model": MODEL, "input": ["ping"]}
    last: list[tuple[int, bytes]] = []

    def routed() -> bool:
        answer = http(f"{url}/v1/embeddings", body, key, timeout=30)
        last[:] = [answer]
        return answer[0] == 200

    try:
        wait_until(routed, timeout_s=timeout_s, interval_s=0.25, message="a route")
    except AssertionError as exc:
        raise AssertionError(
            f"the gateway never routed to the replica: {last!r}"
        ) from exc


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench/results/embeddings.json"
    )
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48, help="timed, per run")
    parser.add_argument("--texts", type=int, default=32, help="inputs per request")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x]
    if not levels or min(*levels, args.repeats, args.requests, args.texts) < 1:
        parser.error(
            "--concurrency, --repeats, --requests and --texts take positive numbers"
        )
    signal.signal(signal.SIGTERM, _interrupt)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    output: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine_cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "settings": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
        },
    }
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    platform = EmbeddingPlatform(args.redis_url)
    gateway: Process | None = None
    try:
        with sim_replica(LOG_DIR, "--runner", "pooling", model=MODEL) as replica:
            output["replica"] = {"argv": replica.popen.args}
            platform.create([replica.url])
            platform.start_beats()
            gateway = start_gateway(platform.env(), LOG_DIR)
            output["gateway"] = {"url": gateway.url, "argv": gateway.popen.args}
            wait_for_route(gateway.url, platform.key, timeout_s=60)
            urls = {"direct": replica.url, "gateway": gateway.url}
            pgid = os.getpgid(gateway.popen.pid)
            first = 0
            # Interleaved: a level's pairs alternate their order from one repeat
            # to the next, and so do neighbouring levels.
            for repeat in range(args.repeats):
                for index, level in enumerate(levels):
                    order = TARGETS if (repeat + index) % 2 == 0 else TARGETS[::-1]
                    for target in order:
                        run = run_one(
                            args, target, urls[target], platform.key, level, pgid, first
                        )
                        first += args.requests + level
                        run["repeat"] = repeat
                        runs.append(run)
                        print(
                            f"[{time.monotonic() - started:5.0f}s] C={level} {target} "
                            f"(repeat {repeat + 1}/{args.repeats}): "
                            f"{run['input_tokens_per_s']} tok/s, p50 {run['p50_ms']} ms, "
                            f"p95 {run['p95_ms']} ms, errors {run['errors']}",
                            flush=True,
                        )
    except KeyboardInterrupt:
        print("interrupted: cleaning up", file=sys.stderr, flush=True)
        output["interrupted"] = True
    finally:
        if gateway is not None:
            gateway.stop()
        output["beat_failures"] = platform.beat_failures
        platform.close()
    output["runs"] = runs
    summary = summarize(runs, levels)
    output["summary"] = summary
    output["elapsed_s"] = round(time.monotonic() - started, 1)
    output["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=2) + "\n")
    print()
    print(table(summary))
    print(f"\nwrote {args.out}")
    errors = sum(sum(r["errors"].values()) for r in runs)
    return 1 if output.get("interrupted") or errors else 0


if __name__ == "__main__":
    sys.exit(main())

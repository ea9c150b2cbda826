"""The billing drill against a running platform (``manage.py billing_drill``).

Public surface: ``Platform``, ``platform_from_local``, ``run_live``.

It talks HTTP only, like a client and an admin would: it creates two teams of its
own with limits (the admin API; the platform denies a model to a team without
them), one generous and one with a concurrency of two, so some of its streams are
refused with a 429. Every seventh stream asks for the batch tier
(``x-priority: batch``): a platform started with a low ``PLATFORM_BATCH_CEILING``
sheds those with a 503. It sends streams with the ``openai`` SDK to each region's
gateway directly, half each, some closed by the client after a few chunks, and
keeps what each client was told. Then it waits for the window's last minute to
close and the regions' usage flushes, and reads the bill three ways: the usage
rows through ``GET /admin/reports/usage`` (JSON), the same as CSV, and each team's
``/v1/organization/usage/completions`` per region (``regions=``). The comparison
is ``drills.domain.billing_drill``'s.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from drills.domain.billing_drill import (
    BillingReport,
    Figures,
    Told,
    compare,
    cost_checks,
    expected_of,
)

__all__ = ["Platform", "platform_from_local", "run_live"]

MODEL = "chat-7b"
PROMPT = [{"role": "user", "content": "Tell me how a bill is checked."}]
# Every fifth stream from here is cut by its client after CUT_AFTER chunks.
CUT_EVERY = 5
CUT_AFTER = 3
# Every seventh stream asks for the batch tier: with a low PLATFORM_BATCH_CEILING
# admission sheds it (503 ``pool_overloaded``, the ``shed`` column); otherwise it
# is served like the rest. Seven and the two teams and regions put some in each.
BATCH_EVERY = 7
BATCH = {"x-priority": "batch"}


@dataclass(frozen=True, slots=True)
class Platform:
    """Where the drill sends and reads: each region's gateway and the tokens."""

    regions: dict[str, str]  # region name -> its gateway's base URL
    admin_token: str

    @property
    def admin_url(self) -> str:
        return next(iter(self.regions.values()))


_SERVER = re.compile(r"^\s*server\s+(\S+)\s+(\S+)\s+check\s*$")


def platform_from_local(local_dir: Path) -> Platform:
    """Read what ``make up REGIONS=2`` left in ``local_dir``: the admin token
    (``credentials.json``) and each region's gateway (``haproxy.cfg``'s primary
    server of each region's backend, in the frontends' order).

    Raises:
        FileNotFoundError: no such platform was started there.
    """
    credentials = json.loads((local_dir / "credentials.json").read_text())
    regions: dict[str, str] = {}
    for line in (local_dir / "haproxy.cfg").read_text().splitlines():
        found = _SERVER.match(line)
        if found and found.group(1) not in regions:
            regions[found.group(1)] = f"http://{found.group(2)}"
    return Platform(regions=regions, admin_token=credentials["admin_token"])


def _admin(platform: Platform) -> httpx.Client:
    return httpx.Client(
        base_url=platform.admin_url,
        headers={"Authorization": f"Bearer {platform.admin_token}"},
        timeout=30,
    )


def create_team(
    platform: Platform, team: str, *, tokens_per_minute: int, max_concurrency: int
) -> str:
    """Create ``team`` with limits on the model; return a new key of it."""
    with _admin(platform) as admin:
        admin.post("/admin/teams", json={"team": team}).raise_for_status()
        admin.put(
            f"/admin/teams/{team}/limits",
            json={
                "model": MODEL,
                "tokens_per_minute": tokens_per_minute,
                "max_concurrency": max_concurrency,
            },
        ).raise_for_status()
        key = admin.post(f"/admin/teams/{team}/keys", json={"name": "billing drill"})
        key.raise_for_status()
        return str(key.json()["key"])


# -- the streams -----------------------------------------------------------------


async def _one(
    client: Any,
    *,
    team: str,
    region: str,
    max_tokens: int,
    cut: bool,
    batch: bool = False,
) -> Told:
    """Send one stream; return what its client was told (or read, when cut)."""
    import openai

    seen = 0
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=PROMPT,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=BATCH if batch else None,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                seen += 1
            if cut and seen >= CUT_AFTER:
                await stream.close()
                return Told(
                    team, region, "cut", tokens_seen=seen, max_tokens=max_tokens
                )
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details else 0
                return Told(
                    team,
                    region,
                    "complete",
                    prompt_tokens=chunk.usage.prompt_tokens,
                    cached_tokens=cached,
                    completion_tokens=chunk.usage.completion_tokens,
                    max_tokens=max_tokens,
                )
    except openai.APIStatusError as exc:
        if exc.status_code in (429, 503):
            return Told(team, region, "refused", status=exc.status_code)
        raise
    # Ended without a final usage event (the stream broke, or was answered
    # shorter than CUT_AFTER): what was read is all the client knows.
    return Told(team, region, "cut", tokens_seen=seen, max_tokens=max_tokens, status=0)


async def _send(
    platform: Platform,
    keys: Mapping[str, str],
    *,
    streams: int,
    concurrency: int,
    seed: int,
) -> list[Told]:
    import random

    import openai

    rng = random.Random(seed)
    regions = list(platform.regions)
    teams = list(keys)
    clients = {
        (team, region): openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=keys[team], max_retries=0, timeout=60
        )
        for team in teams
        for region, url in platform.regions.items()
    }
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Told:
        region = regions[i % len(regions)]
        team = teams[(i // len(regions)) % len(teams)]
        async with gate:
            return await _one(
                clients[(team, region)],
                team=team,
                region=region,
                max_tokens=rng.randint(8, 48),
                cut=i % CUT_EVERY == CUT_EVERY - 1,
                batch=i % BATCH_EVERY == BATCH_EVERY - 1,
            )

    try:
        return list(await asyncio.gather(*(one(i) for i in range(streams))))
    finally:
        for client in clients.values():
            await client.close()


def _warm(
    platform: Platform, keys: Mapping[str, str], *, timeout_s: float
) -> list[Told]:
    """One short stream per team and region until each is served (a new team's
    limits reach a gateway at its next snapshot refresh); return the told
    figures of those served, which are billed like any other."""
    told: list[Told] = []
    deadline = time.monotonic() + timeout_s
    for team, key in keys.items():
        for region, url in platform.regions.items():
            while True:
                answer = _probe(url, key)
                if answer is not None:
                    told.append(Told(team, region, "complete", *answer))
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{team} never served in {region}")
                time.sleep(0.5)
    return told


def _probe(url: str, key: str) -> tuple[int, int, int] | None:
    """One non-streaming chat; its (prompt, cached, completion) tokens, or None
    when refused before the key or the limits arrived (401, 403: never
    billed)."""
    response = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "messages": PROMPT, "max_tokens": 4},
        timeout=30,
    )
    if response.status_code in (401, 403):
        return None
    response.raise_for_status()
    usage = response.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage["prompt_tokens"], cached, usage["completion_tokens"]


# -- the bill, three ways ----------------------------------------------------------


def _report_params(start: datetime, end: datetime, **extra: str) -> dict[str, str]:
    return {
        "from": start.isoformat(),
        "to": end.isoformat(),
        "group_by": "day",
        **extra,
    }


def _row_figures(row: Mapping[str, Any]) -> Figures:
    return Figures(
        requests=int(row["requests"]),
        prompt_tokens=int(row["prompt_tokens"]),
        cached_tokens=int(row["cached_tokens"]),
        output_tokens=int(row["output_tokens"]),
        rate_limited=int(row["rate_limited"]),
        shed=int(row["shed"]),
    )


def _sum_rows(
    rows: Sequence[Mapping[str, Any]], teams: Sequence[str]
) -> dict[tuple[str, str], Figures]:
    found: dict[tuple[str, str], Figures] = defaultdict(Figures)
    for row in rows:
        if row.get("line", "team") == "team" and row["team"] in teams:
            key = (str(row["team"]), str(row["region"]))
            found[key] = found[key] + _row_figures(row)
    return dict(found)


def read_report(
    platform: Platform, start: datetime, end: datetime
) -> tuple[dict[str, Any], str]:
    """The usage report of the window as JSON and as CSV (every team: the cost
    split needs them all)."""
    with _admin(platform) as admin:
        data = admin.get("/admin/reports/usage", params=_report_params(start, end))
        data.raise_for_status()
        text = admin.get(
            "/admin/reports/usage", params=_report_params(start, end, format="csv")
        )
        text.raise_for_status()
    return data.json(), text.text


def csv_figures(text: str, teams: Sequence[str]) -> dict[tuple[str, str], Figures]:
    return _sum_rows(list(csv.DictReader(io.StringIO(text))), teams)


def org_figures(
    platform: Platform,
    keys: Mapping[str, str],
    start: datetime,
    end: datetime,
) -> dict[tuple[str, str], Figures]:
    """Each team's own view, ``/v1/organization/usage/completions``, asked once per
    region (``regions=``), in minute buckets over the window."""
    found: dict[tuple[str, str], Figures] = {}
    for team, key in keys.items():
        for region in platform.regions:
            response = httpx.get(
                f"{platform.admin_url}/v1/organization/usage/completions",
                headers={"Authorization": f"Bearer {key}"},
                params={
                    "start_time": str(int(start.timestamp())),
                    "end_time": str(int(end.timestamp())),
                    "bucket_width": "1m",
                    "limit": "1440",
                    "regions": region,
                },
                timeout=30,
            )
            response.raise_for_status()
            total = Figures()
            for bucket in response.json()["data"]:
                for r in bucket["results"]:
                    total = total + Figures(
                        requests=r["num_model_requests"],
                        prompt_tokens=r["input_tokens"],
                        cached_tokens=r["input_cached_tokens"],
                        output_tokens=r["output_tokens"],
                        rate_limited=r.get("rate_limited_requests", 0),
                        shed=r.get("shed_requests", 0),
                    )
            found[(team, region)] = total
    return found


def _minute_after(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0) + timedelta(minutes=1)


def run_live(
    platform: Platform,
    *,
    streams: int = 200,
    concurrency: int = 24,
    seed: int = 0,
    settle_s: float = 120.0,
    log: Callable[[str], None] = print,
    flush: Callable[[], None] | None = None,
) -> tuple[BillingReport, dict[str, Any]]:
    """Run the drill against ``platform``; return the report and the window's
    figures (teams, times, the report's totals).

    ``flush`` runs before each read of the bill: a platform without its workers
    (a test's) flushes the regions' usage there; ``make up``'s beat does it.
    """
    if len(platform.regions) < 2:
        raise ValueError(f"two regions wanted, found {sorted(platform.regions)}")
    run = secrets.token_hex(3)
    teams = {
        f"bill-{run}-wide": (2_000_000, 64),
        # A concurrency of 2 across both regions: its bursts get 429s.
        f"bill-{run}-tight": (2_000_000, 2),
    }
    start = datetime.now(UTC).replace(second=0, microsecond=0)
    keys = {
        team: create_team(platform, team, tokens_per_minute=tpm, max_concurrency=conc)
        for team, (tpm, conc) in teams.items()
    }
    log(f"teams {', '.join(keys)}; regions {', '.join(platform.regions)}")
    told = _warm(platform, keys, timeout_s=60)
    t0 = time.monotonic()
    told += asyncio.run(
        _send(platform, keys, streams=streams, concurrency=concurrency, seed=seed)
    )
    send_s = time.monotonic() - t0
    end = _minute_after(datetime.now(UTC))
    log(f"{len(told)} streams in {send_s:.1f} s; waiting for {end:%H:%M} and the flush")
    team_names = list(keys)
    expected = expected_of(told)
    deadline = (
        time.monotonic()
        + settle_s
        + max(0.0, (end - datetime.now(UTC)).total_seconds())
    )
    # The flush writes each region's totals of the minute every few seconds:
    # read until the rows hold what the clients were told, or stop changing
    # past the deadline.
    # Two reads in a row alike, so that a flush half-way through is not taken.
    before: dict[tuple[str, str], Figures] | None = None
    while True:
        wait = (end - datetime.now(UTC)).total_seconds()
        if wait > 0:
            time.sleep(min(wait, 5.0))
            continue
        if flush is not None:
            flush()
        data, text = read_report(platform, start, end)
        rows = _sum_rows(data["data"], team_names)
        holds = all(e.holds(rows.get(key, Figures())) for key, e in expected.items())
        if (holds and rows == before) or time.monotonic() > deadline:
            break
        before = rows
        time.sleep(3.0)
    sources = {
        "rows": rows,
        "csv": csv_figures(text, team_names),
        "org": org_figures(platform, keys, start, end),
    }
    report = compare(
        told,
        sources,
        regions=list(platform.regions),
        teams=team_names,
        costs=cost_checks(data, team_names),
    )
    window = {
        "teams": team_names,
        "regions": platform.regions,
        "from": start.isoformat(),
        "to": end.isoformat(),
        "send_s": round(send_s, 1),
        "concurrency": concurrency,
        "gpu_hour_usd": data["gpu_hour_usd"],
        "gpu_hour_usd_by_region": data["gpu_hour_usd_by_region"],
        "report_totals": data["totals"],
        "versions": data["versions"],
        "pools": data["pools"],
    }
    return report, window

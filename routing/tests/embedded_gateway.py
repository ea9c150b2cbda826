"""The gateway's ASGI app in the test's own process, on a snapshot built by hand.

Public surface: ``EmbeddedGateway``, ``Answer``, ``TEAM_KEY``, ``BATCH_KEY``,
``MODEL``, ``UNGRANTED_MODEL``.

For tests that must look inside the gateway (its limiter's buckets and slots, its
usage counter, its log) or send many bodies fast (the /v1 fuzz). The snapshot holds
one team (key ``TEAM_KEY``; ``BATCH_KEY`` is the team's batch job key) allowed on
one model (``MODEL``, version v1; ``UNGRANTED_MODEL`` is live too, but the team
has no limits on it) and, when a URL is given, one serving replica
there: a real simulated replica the test started. Limits and usage are kept in
memory, as a gateway without Redis keeps them. What users see is also tested
against real gateway processes (``test_gateway_e2e.py``, ``test_v1_fuzz.py``).

Requests are ASGI calls on one event loop owned by the harness, so the upstream
session and background tasks outlive a single request as they do in a server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from config.asgi_io import Message
from metering.counters import MemoryUsageCounter
from metering.domain.usage import UsageCounts, UsageKey
from routing.admission import LiveAdmission, LivePoolView
from routing.chat import BackgroundTasks, ChatService
from routing.domain.admission_control import AdmissionControl
from routing.domain.hosts import HostPolicy
from routing.domain.snapshot import (
    BudgetRecord,
    ConfigSnapshot,
    EntitlementRecord,
    KeyRecord,
    LimitRecord,
    ModelRecord,
    ReplicaRecord,
    VersionRecord,
)
from routing.gateway import Gateway
from routing.limiter_store import MemoryBucketStore, MemoryConcurrency
from routing.live import LiveLoad
from routing.plan import GatewaySettings
from routing.prompt_tokens import VersionCounters
from routing.snapshots import SnapshotHolder
from routing.traces import TRACING_OFF, Tracing
from routing.upstream import Upstream

__all__ = [
    "BATCH_KEY",
    "EMBEDDING_MODEL",
    "MODEL",
    "TEAM_KEY",
    "UNGRANTED_MODEL",
    "Answer",
    "EmbeddedGateway",
]

TEAM_KEY = "sk-team-embedded"
BATCH_KEY = "sk-team-embedded-batch"
MODEL = "chat-7b"
# A live model the team has no limits row on (default deny: 403 to it).
UNGRANTED_MODEL = "reason-70b"
# An embedding model (with ``embedding=True``): 4 dimensions, inputs up to 32
# tokens, the team granted, served by the same replica URL (``embedding_replicas``
# replicas of it there, for failover). The team's limits on every model are
# unbounded unless ``tokens_per_minute`` and ``max_concurrency`` are given.
EMBEDDING_MODEL = "embed-1"
_TEAM = "alpha"


@dataclass(frozen=True)
class Answer:
    """What the gateway sent for one request."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        """Return the SSE events' data, ``[DONE]`` included."""
        return [
            event.removeprefix("data: ")
            for event in self.body.decode().split("\n\n")
            if event
        ]


def _snapshot(
    replica_url: str | None,
    *,
    embedding: bool = False,
    embedding_replicas: int = 1,
    tokens_per_minute: int = 10**9,
    max_concurrency: int = 10_000,
) -> ConfigSnapshot:
    now = time.time()
    served = [MODEL, EMBEDDING_MODEL] if embedding else [MODEL]
    names = [MODEL, UNGRANTED_MODEL, *served[1:]]
    replicas = (
        [
            ReplicaRecord(
                replica_id=f"{name}-v1-embedded-{index}",
                model=name,
                version="v1",
                region="embedded",
                url=replica_url,
                state="serving",
                queue_depth=0,
                tokens_in_flight=0,
                kv_cache_usage_perc=0.0,
                last_heartbeat_at=now,
            )
            for name in served
            for index in range(embedding_replicas if name == EMBEDDING_MODEL else 1)
        ]
        if replica_url
        else []
    )
    return ConfigSnapshot(
        built_at=now,
        region="embedded",
        keys={
            hashlib.sha256(TEAM_KEY.encode()).hexdigest(): KeyRecord(
                key_id=1, team=_TEAM
            ),
            hashlib.sha256(BATCH_KEY.encode()).hexdigest(): KeyRecord(
                key_id=2, team=_TEAM, batch=True
            ),
        },
        teams=frozenset({_TEAM}),
        limits={
            (_TEAM, name): LimitRecord(
                team=_TEAM,
                model=name,
                tokens_per_minute=tokens_per_minute,
                max_concurrency=max_concurrency,
                guaranteed_share=0.0,
            )
            for name in served
        },
        models={
            name: ModelRecord(
                model=name,
                live_version="v1",
                canary_version=None,
                canary_percent=0.0,
                shadow_version=None,
                shadow_percent=0.0,
                kind="embedding" if name == EMBEDDING_MODEL else "chat",
                dimensions=4 if name == EMBEDDING_MODEL else 0,
                max_input_tokens=32 if name == EMBEDDING_MODEL else 0,
            )
            for name in names
        },
        versions={
            (name, "v1"): VersionRecord(
                model=name,
                version="v1",
                status="live",
                max_model_len=8192,
                load_test_tokens_in_flight=None,
            )
            for name in names
        },
        replicas=tuple(replicas),
    )


class EmbeddedGateway:
    """A gateway served in this process; use as a context manager."""

    def __init__(
        self,
        replica_url: str | None = None,
        *,
        counters: VersionCounters | None = None,
        default_max_tokens: int = 1024,
        settings: GatewaySettings | None = None,
        embedding: bool = False,
        embedding_replicas: int = 1,
        tokens_per_minute: int = 10**9,
        max_concurrency: int = 10_000,
        tiers: tuple[str, ...] | None = None,
        budget: BudgetRecord | None = None,
        usd_per_million: float = 0.0,
        tracing: Tracing = TRACING_OFF,
    ) -> None:
        snapshot = _snapshot(
            replica_url,
            embedding=embedding,
            embedding_replicas=embedding_replicas,
            tokens_per_minute=tokens_per_minute,
            max_concurrency=max_concurrency,
        )
        if tiers is not None:
            # The team's entitlement on MODEL: these tiers only.
            snapshot = dataclasses.replace(
                snapshot,
                entitlements={(_TEAM, MODEL): EntitlementRecord(_TEAM, MODEL, tiers)},
            )
        if budget is not None:
            snapshot = dataclasses.replace(
                snapshot, budgets={(budget.team, budget.model): budget}
            )
        if usd_per_million:
            # Every version's price (the snapshot's cost model figure).
            snapshot = dataclasses.replace(
                snapshot,
                versions={
                    key: dataclasses.replace(record, usd_per_million=usd_per_million)
                    for key, record in snapshot.versions.items()
                },
            )
        self.loop = asyncio.new_event_loop()
        self.settings = settings or GatewaySettings(
            region="embedded", default_max_tokens=default_max_tokens
        )
        self.live = LiveLoad(
            gateway_id="embedded",
            region="embedded",
            redis=None,
            prefix="embedded",
            beat_s=60.0,
            missed_beats=3,
        )

        async def load() -> ConfigSnapshot:
            return snapshot

        self.snapshots = SnapshotHolder(
            load, prompt_counters=counters or VersionCounters()
        )
        self.buckets = MemoryBucketStore()
        self.slots = MemoryConcurrency()
        admission = LiveAdmission(
            control=AdmissionControl(
                LivePoolView(
                    snapshot=lambda: self.snapshots.current,
                    live=self.live,
                    default_replica_tokens_in_flight=10**6,
                )
            ),
            limits=self.buckets.pair(self.slots),
        )
        self.usage = MemoryUsageCounter()
        self.upstream = Upstream(connect_timeout_s=2.0)
        background = BackgroundTasks()
        self.background = background
        self.app = Gateway(
            settings=self.settings,
            snapshots=self.snapshots,
            live=self.live,
            chat=ChatService(
                settings=self.settings,
                live=self.live,
                admission=admission,
                upstream=self.upstream,
                usage_counter=self.usage,
                background=background,
                rng=random.Random(0),
            ),
            upstream=self.upstream,
            background=background,
            hosts=HostPolicy.from_patterns(["127.0.0.1"]),
            tracing=tracing,
        )

    def __enter__(self) -> EmbeddedGateway:
        # Not Gateway.start: its loops and collector settings belong to a server
        # process, not to the test runner's.
        self.loop.run_until_complete(self.upstream.open())
        self.loop.run_until_complete(self.snapshots.refresh())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.loop.run_until_complete(self.background.drain())
        self.loop.run_until_complete(self.upstream.close())
        self.loop.close()

    def request(
        self,
        path: str,
        body: bytes | Any = b"",
        *,
        method: str = "POST",
        key: str | None = TEAM_KEY,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        """Send one request and return the whole answer (a JSON body, or bytes)."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent_headers = [(b"host", b"127.0.0.1")]
        if key is not None:
            sent_headers.append((b"authorization", f"Bearer {key}".encode()))
        sent_headers.extend(
            (name.encode(), value.encode()) for name, value in (headers or {}).items()
        )
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "query_string": b"",
            "headers": sent_headers,
            "server": ("127.0.0.1", 8000),
        }
        return self.loop.run_until_complete(self._call(scope, raw))

    async def _call(self, scope: dict[str, Any], raw: bytes) -> Answer:
        incoming: list[Message] = [
            {"type": "http.request", "body": raw, "more_body": False}
        ]
        finished = asyncio.Event()
        sent: list[Message] = []

        async def receive() -> Message:
            if incoming:
                return incoming.pop()
            await finished.wait()  # the client stays until the answer is whole
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            # As strict as uvicorn: one start, then body until more_body is false.
            is_start = message["type"] == "http.response.start"
            has_started = any(m["type"] == "http.response.start" for m in sent)
            is_complete = any(
                m["type"] == "http.response.body" and not m.get("more_body")
                for m in sent
            )
            if is_start == has_started or is_complete:
                raise RuntimeError(f"unexpected ASGI message {message['type']!r}")
            sent.append(message)

        try:
            await self.app(scope, receive, send)
        finally:
            finished.set()
        starts = [m for m in sent if m["type"] == "http.response.start"]
        assert len(starts) == 1, f"expected one response start, got {sent}"
        return Answer(
            status=starts[0]["status"],
            headers={
                name.decode(): value.decode() for name, value in starts[0]["headers"]
            },
            body=b"".join(
                m.get("body", b"") for m in sent if m["type"] == "http.response.body"
            ),
        )

    def is_charged(self) -> bool:
        """Return True if any bucket was charged or slot taken since the start."""
        return len(self.buckets) > 0 or len(self.slots) > 0

    def metered(self) -> dict[UsageKey, UsageCounts]:
        """Return (and take) the usage counted so far, background counts included."""
        self.loop.run_until_complete(self.background.drain())
        return self.usage.drain()

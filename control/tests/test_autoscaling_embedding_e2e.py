"""An embedding pool autoscaled end to end: the live tick sizes it on the input
tokens/s the gateway admits, up under load and back down when the load stops.

Real processes: a gateway, the node agent and its simulated replicas (``embed-1``
run as vLLM's pooling runner), PostgreSQL, Redis and ``openai`` SDK clients
sending requests of 32 texts (a RAG ingestion's chunks). The test drives the
autoscaler's live tick itself (``control.autoscaling.autoscale_region``, the
function the Celery task calls) about once a second against the gateway's
live-load shares in Redis, polling with deadlines.

Each replica is said to sustain ``TOKENS_PER_S`` input tokens/s (the load-test
gate's figure, set on the version), far below what the clients send, so the
pool must grow.

GIVEN a pool of one replica (min 1, max 3), WHEN four clients send requests of
32 texts without pause, THEN the tick measures their input tokens/s (within
reason of what the clients were told they used), raises the pool, and the agent
starts the replicas it asked for, which serve; WHEN the load stops, THEN the replicas
leave one at a time (scale_down rows, a scale-down interval apart) until one is
left, and no client saw an error.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import openai
import pytest
import redis
from django.utils import timezone

from control.autoscaling import autoscale_region, pool_state, set_pool_autoscaling
from engine_nodes.models import Replica, ScalingDecision
from localrun.processes import wait_until
from models_registry.models import ModelVersion, Pool
from tests.factories import embedding_model_seed
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker, Settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "embed-1"
TOKENS_PER_S = 300.0  # one replica's input tokens/s, as the test declares it
CLIENTS = 4
TEXTS = 32
POOL_SETTINGS = {
    "min_replicas": 1,
    "max_replicas": 3,
    "target_utilisation": 0.7,
    "scale_down_utilisation": 0.5,
    "stable_window_s": 6.0,
    "panic_window_s": 3.0,
    "scale_down_interval_s": 3.0,
}


@pytest.fixture
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
) -> Iterator[LivePlatform]:
    embed = embedding_model_seed(
        dimensions=384, max_input_tokens=256, min_replicas=1, max_replicas=3
    )
    tmp = tmp_path_factory.mktemp("embedding-autoscaling")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 1},
            extra_models=(embed,),
            PLATFORM_DRAIN_TIMEOUT_S="30",
        ) as live,
    ):
        # Tokens in flight stay large: admission (which divides by them) must
        # not queue this load; the autoscaler sizes the pool on tokens/s.
        ModelVersion.objects.filter(model_id=MODEL).update(
            load_test_tokens_per_s=TOKENS_PER_S, load_test_tokens_in_flight=100_000
        )
        set_pool_autoscaling(
            model_id=MODEL, version="v1", region=live.region, changes=POOL_SETTINGS
        )
        yield live


@dataclass
class Ingestion:
    """SDK clients sending 32 texts a request, one request after another; each
    answer's prompt tokens (what the client was told) or its error is kept."""

    platform: LivePlatform
    stop: threading.Event = field(default_factory=threading.Event)
    told: list[tuple[float, int]] = field(default_factory=list)  # (at, tokens)
    errors: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, clients: int) -> None:
        for index in range(clients):
            thread = threading.Thread(target=self._run, args=(index,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _run(self, index: int) -> None:
        client = self.platform.client("beta", timeout=60)
        sent = 0
        while not self.stop.is_set():
            sent += 1
            texts = [
                f"chunk {n} of document {index}-{sent}: the pool grows with its load"
                for n in range(TEXTS)
            ]
            try:
                result = client.embeddings.create(model=MODEL, input=texts)
            except openai.APIError as exc:
                self.errors.append(repr(exc))
                continue
            assert len(result.data) == TEXTS
            self.told.append((time.monotonic(), result.usage.prompt_tokens))

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in self.threads), "a client never ended"

    def rate(self, since: float, until: float) -> float:
        """Input tokens/s the clients were told of over ``[since, until]``."""
        tokens = sum(n for at, n in self.told if since <= at <= until)
        return tokens / (until - since)


@dataclass
class Ticker:
    """Runs the live tick on the region's pools; keeps the embedding pool's
    decisions as ticks saw them."""

    platform: LivePlatform
    client: redis.Redis
    rates: list[float] = field(default_factory=list)

    def tick(self) -> Pool:
        results = autoscale_region(
            region=self.platform.region, now=timezone.now(), redis_client=self.client
        )
        for result in results:
            signals = result.decision.signals
            if "admitted_tokens_per_s" in signals:
                self.rates.append(signals["admitted_tokens_per_s"])
        return Pool.objects.get(model_id=MODEL, region=self.platform.region)

    def until(self, condition: object, *, timeout_s: float, message: str) -> None:
        assert callable(condition)
        wait_until(
            lambda: condition(self.tick()),
            timeout_s=timeout_s,
            interval_s=1.0,
            message=f"{message}; rates seen {[round(r) for r in self.rates[-10:]]}",
        )


def serving(region: str) -> int:
    return Replica.objects.filter(
        region=region, version__model_id=MODEL, state="serving"
    ).count()


def test_live_tick_scales_an_embedding_pool_up_under_load_and_down_after(
    platform: LivePlatform,
    django_db_blocker: DjangoDbBlocker,
    redis_url: str,
    settings: Settings,
) -> None:
    # The tick reads the gateway's shares under the platform's key prefix.
    settings.REDIS_KEY_PREFIX = platform.prefix
    with django_db_blocker.unblock(), redis.Redis.from_url(redis_url) as client:
        run_scenario(platform, Ticker(platform, client))


def run_scenario(platform: LivePlatform, ticker: Ticker) -> None:
    region = platform.region
    assert ticker.tick().target_replicas == 1
    ingestion = Ingestion(platform)
    try:
        # WHEN the ingestion runs: far past 70% of one replica's input tokens/s.
        started = time.monotonic()
        ingestion.start(CLIENTS)
        ticker.until(
            lambda pool: pool.target_replicas >= 2,
            timeout_s=30,
            message="a scale-up on input tokens/s",
        )
        # The tick goes on while the agent starts what the pool asked for: it
        # counts only the rows the agent has written, and must not undo the
        # scale-up from those.
        ticker.until(
            lambda pool: serving(region) == pool.target_replicas,
            timeout_s=60,
            message="the replicas asked for serving",
        )
        loaded = time.monotonic()
        [entry] = pool_state(model_id=MODEL, now=timezone.now(), region=region)["pools"]
    finally:
        ingestion.finish()
    stopped_at = time.time()
    assert not ingestion.errors, ingestion.errors[:3]
    told = ingestion.rate(started, loaded)
    assert told > 3 * TOKENS_PER_S, told  # the load is what the test says it is
    # The tick measured what the clients were told they used: its highest rate
    # while they sent is of that order (windows differ: a tick spans a second).
    assert 0.5 * told <= max(ticker.rates) <= 3 * told, (told, ticker.rates)
    assert entry["kind"] == "embedding"
    assert entry["replica_tokens_per_s"] == TOKENS_PER_S
    assert not entry["capacity_is_assumed"]

    # WHEN the load stops, THEN the pool falls back to one replica, one at a time.
    ticker.until(
        lambda pool: pool.target_replicas == 1 and serving(region) == 1,
        timeout_s=90,
        message="the pool back to one replica",
    )
    rows = list(
        ScalingDecision.objects.filter(pool__model_id=MODEL).order_by(
            "decided_at", "id"
        )
    )
    ups = [r for r in rows if r.to_replicas > r.from_replicas]
    downs = [r for r in rows if r.to_replicas < r.from_replicas]
    assert ups and ups[0].from_replicas == 1, rows
    assert len(ups) == 1, rows  # all it needed, in one decision
    assert all(r.reason in {"utilisation", "panic", "queue", "ceiling"} for r in ups)
    assert all(r.signals["admitted_tokens_per_s"] > 0 for r in ups), rows
    assert downs and all(r.reason == "scale_down" for r in downs), rows
    assert all(r.from_replicas - r.to_replicas == 1 for r in downs), rows
    assert downs[-1].to_replicas == 1
    assert all(r.decided_at.timestamp() >= stopped_at for r in downs), rows
    gaps = [
        (b.decided_at - a.decided_at).total_seconds()
        for a, b in itertools.pairwise(downs)
    ]
    assert all(gap >= POOL_SETTINGS["scale_down_interval_s"] for gap in gaps), gaps

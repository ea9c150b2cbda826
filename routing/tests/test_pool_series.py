"""A pool's series in the gateway's /metrics live as long as the pool is this region's.

The gateway publishes each pool's load once a second from its snapshot; a pool that
left the snapshot (removed, released once nothing routes to its version, its last
replica gone) has its series removed (``metering.metrics.forget_pool``), so no gauge
stays at its last value and no label set outlives its pool.
"""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import REGISTRY

from metering import metrics
from routing.tests.embedded_gateway import MODEL, EmbeddedGateway

REGION = "embedded"  # the embedded gateway's
POOL = {"model": MODEL, "version": "v1", "region": REGION}
SERIES = (
    "platform_tokens_in_flight",
    "platform_queue_depth",
    "platform_output_tokens_total",
)


def test_a_pool_that_leaves_the_snapshot_has_its_series_removed() -> None:
    with EmbeddedGateway("http://127.0.0.1:9") as gateway:
        snapshot = gateway.snapshots.current
        assert snapshot is not None and snapshot.replicas
        metrics.observe_request(
            model=MODEL, version="v1", region=REGION, outcome="ok", output_tokens=3
        )
        gateway.app._publish_pool_gauges()
        for name in SERIES:
            assert REGISTRY.get_sample_value(name, POOL) is not None, name

        # The pool was released: its last replica is gone, no pool row wants one.
        # (The test swaps the snapshot in as a refresh would.)
        gateway.snapshots.current = replace(snapshot, replicas=(), pools=frozenset())
        gateway.app._publish_pool_gauges()

        for name in SERIES:
            assert REGISTRY.get_sample_value(name, POOL) is None, name


def test_a_pool_that_wants_replicas_keeps_its_series_at_zero_load() -> None:
    with EmbeddedGateway("http://127.0.0.1:9") as gateway:
        snapshot = gateway.snapshots.current
        assert snapshot is not None
        metrics.set_pool_load(
            model=MODEL, version="v1", region=REGION, tokens_in_flight=7, queue_depth=2
        )
        metrics.observe_request(
            model=MODEL, version="v1", region=REGION, outcome="ok", output_tokens=3
        )
        gateway.app._publish_pool_gauges()

        # Its replicas are gone, but the pool row still wants some: it stays, idle.
        gateway.snapshots.current = replace(
            snapshot, replicas=(), pools=frozenset({(MODEL, "v1")})
        )
        gateway.app._publish_pool_gauges()

        value = REGISTRY.get_sample_value
        assert value("platform_tokens_in_flight", POOL) == 0
        assert value("platform_queue_depth", POOL) == 0
        assert value("platform_output_tokens_total", POOL) is not None


def test_a_pool_never_in_the_snapshot_has_its_series_removed() -> None:
    """A request to a version with no pool in this region (pinned to one that
    another region serves, say) is counted (a 503), under a pool label set the
    snapshot never held: it is removed at the next publication all the same."""
    elsewhere = {**POOL, "version": "v-elsewhere"}
    with EmbeddedGateway("http://127.0.0.1:9") as gateway:
        metrics.observe_request(
            model=MODEL, version="v-elsewhere", region=REGION, outcome="error"
        )
        requests = {**elsewhere, "outcome": "error"}
        assert REGISTRY.get_sample_value("platform_requests_total", requests) == 1

        gateway.app._publish_pool_gauges()

        assert REGISTRY.get_sample_value("platform_requests_total", requests) is None
        # The snapshot's own pool keeps its series.
        assert REGISTRY.get_sample_value("platform_tokens_in_flight", POOL) is not None

"""A scale-down end to end: the drained replica's stream ends at the drain deadline.

Real gateway, agent and simulated replica processes, PostgreSQL, Redis and the
openai SDK. Two replicas each stream a long answer; the pool's target falls to
one. The agent drains one replica (it leaves the ring, its stream goes on); the
drain deadline is short here, so the stream is still open when it passes: the
agent stops the replica and the client gets the gateway's explicit error event,
not before the deadline. The other stream completes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import openai
import pytest

from engine_nodes.models import Replica
from localrun.processes import wait_until
from models_registry.models import Pool
from tests.live import LivePlatform, extra_of, start_platform, usage_of

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DRAIN_TIMEOUT_S = 5.0
# Long enough to outlast the deadline: about 90 tokens a second per stream.
MAX_TOKENS = 1500
# Timers fire late on a loaded machine, never early; this much late is allowed
# (the agent's beat, the stop's 1 s SIGTERM grace, the gateway's read).
LATE_S = 5.0


@pytest.fixture
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("scale-down")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp, pools={"v1": 2}, PLATFORM_DRAIN_TIMEOUT_S=str(DRAIN_TIMEOUT_S)
        ) as live,
    ):
        yield live


def conversations_on_each_replica(platform: LivePlatform) -> dict[str, str]:
    """Return {replica_id: a conversation id the gateway routes to it}."""
    owners: dict[str, str] = {}
    for n in range(200):
        answer = platform.client().chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=1,
            extra_headers={"x-conversation-id": f"scale-down-{n}"},
        )
        owners.setdefault(str(extra_of(answer)["replica_id"]), f"scale-down-{n}")
        if len(owners) == 2:
            return owners
    raise AssertionError(f"200 conversations all went to {set(owners)}")


def test_a_stream_on_a_drained_replica_ends_with_the_error_event_at_the_deadline(
    platform: LivePlatform, django_db_blocker: DjangoDbBlocker
) -> None:
    with django_db_blocker.unblock():
        owners = conversations_on_each_replica(platform)
        outcomes: dict[str, dict[str, Any]] = {}
        first_token = {replica_id: threading.Event() for replica_id in owners}

        def stream(replica_id: str, conversation: str) -> None:
            outcome: dict[str, Any] = outcomes.setdefault(replica_id, {"tokens": 0})
            raw = platform.client(timeout=60).chat.completions.with_raw_response.create(
                model="chat-7b",
                messages=[{"role": "user", "content": "tell me a long story"}],
                max_tokens=MAX_TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"x-conversation-id": conversation},
            )
            outcome["replica_id"] = raw.headers["x-replica-id"]
            try:
                for chunk in raw.parse():
                    if chunk.choices and chunk.choices[0].delta.content:
                        outcome["tokens"] += 1
                        first_token[replica_id].set()
                    if chunk.usage is not None:
                        outcome["usage"] = usage_of(chunk)
            except openai.APIError as exc:
                outcome["error"] = exc
            outcome["ended_at"] = time.monotonic()

        threads = [
            threading.Thread(target=stream, args=item, daemon=True)
            for item in owners.items()
        ]
        for thread in threads:
            thread.start()
        for event in first_token.values():
            assert event.wait(timeout=30), "a stream never started"
        pool = Pool.objects.get(region=platform.region)
        Pool.objects.filter(pk=pool.pk).update(min_replicas=1, desired_replicas=1)

        def draining() -> str | None:
            ids = list(
                Replica.objects.filter(
                    region=platform.region, state="draining"
                ).values_list("replica_id", flat=True)
            )
            assert len(ids) <= 1, ids
            return ids[0] if ids else None

        drained = wait_until(draining, timeout_s=15, message="a replica to drain")
        drained_seen_at = time.monotonic()
        (kept,) = set(owners) - {drained}
        for thread in threads:
            thread.join(timeout=60)

        broken, whole = outcomes[drained], outcomes[kept]
        assert broken["replica_id"] == drained
        assert isinstance(broken.get("error"), openai.APIError), broken
        assert "mid-stream" in str(broken["error"])
        assert 0 < broken["tokens"] < MAX_TOKENS
        # Not cut before the deadline; cut soon after it.
        ended_after_s = broken["ended_at"] - drained_seen_at
        assert DRAIN_TIMEOUT_S - 0.5 <= ended_after_s < DRAIN_TIMEOUT_S + LATE_S
        # The other replica's stream is untouched by the scale-down.
        assert "error" not in whole, whole
        assert whole["usage"].completion_tokens == MAX_TOKENS
        wait_until(
            lambda: (
                list(
                    Replica.objects.filter(region=platform.region).values_list(
                        "replica_id", "state"
                    )
                )
                == [(kept, "serving")]
            ),
            timeout_s=15,
            message="the drained replica to be removed",
        )

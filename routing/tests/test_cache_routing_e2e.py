"""Cache-aware routing end to end: real gateway, agent and simulated replicas that
publish KV events over ZMQ, the openai SDK.

Twenty conversations share one 2,000-token system prompt. With conversation
affinity alone each would land on its own hash's replica, about half on each of
the two; cache-aware routing sends every one to the replica whose events say it
holds the prefix, and the engine's own ``cached_tokens`` prove it did.
"""

from __future__ import annotations

import os
import random
import re
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from localrun.processes import wait_until
from routing.domain.policies import PrefixAffinityPolicy, RouteRequest
from routing.domain.snapshot import NodeSnapshot
from simengine.domain.tokens import OUTPUT_WORDS, encode
from tests.live import (
    LivePlatform,
    cached_tokens_of,
    extra_of,
    start_platform,
    usage_of,
)

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFIX_TOKENS = 2_000
BLOCK = 16  # the simulated replica's block size
CONVERSATIONS = 20


def system_prompt() -> str:
    """A system prompt of about 2,000 stand-in tokens (each word is one)."""
    rng = random.Random(37)
    words = [rng.choice(OUTPUT_WORDS) for _ in range(PREFIX_TOKENS - 8)]
    text = "You answer from this handbook:" + "".join(words)
    assert abs(len(encode(text)) - PREFIX_TOKENS) < 16
    return text


SYSTEM = system_prompt()


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("cache-routing")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 2},
            engine_config={"kv_events": True},
            PLATFORM_ROUTING_POLICY="cache_aware",
        ) as live,
    ):
        yield live


def ask(
    platform: LivePlatform, conversation: str, *, system: str = SYSTEM
) -> tuple[str, int, int]:
    """Send a new conversation's first turn; return (replica, prompt, cached)."""
    opening = system or f"You are assistant {conversation}."
    stream = platform.client("alpha").chat.completions.create(
        model="chat-7b",
        messages=[
            {"role": "system", "content": opening},
            {"role": "user", "content": f"Question {conversation}: what now?"},
        ],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-conversation-id": conversation},
    )
    chunks: list[Any] = list(stream)
    final = chunks[-1]
    return (
        extra_of(final)["replica_id"],
        usage_of(final).prompt_tokens,
        cached_tokens_of(final),
    )


def index_blocks(platform: LivePlatform) -> float:
    text = platform.metrics()
    found = re.search(
        r'^platform_prefix_index_blocks\{[^}]*model="chat-7b"[^}]*\} (\S+)$',
        text,
        re.MULTILINE,
    )
    return float(found.group(1)) if found else 0.0


def affinity_owners(platform: LivePlatform, conversations: list[str]) -> set[str]:
    """Return the replicas conversation affinity alone would pick (idle pool)."""
    nodes = [
        NodeSnapshot(replica_id=r.replica_id, url=r.url, tokens_in_flight=0)
        for r in platform.serving()
    ]
    policy = PrefixAffinityPolicy()
    return {
        policy.choose(
            RouteRequest(
                model="chat-7b",
                version="v1",
                routing_key=f"conv:{conversation}",
                team="alpha",
                request_tokens=PREFIX_TOKENS,
            ),
            nodes,
            0.0,
        ).candidates[0]
        for conversation in conversations
    }


def test_new_conversations_go_to_the_replica_holding_their_prefix(
    platform: LivePlatform, unblocked: None
) -> None:
    conversations = [f"conv-{k}" for k in range(CONVERSATIONS)]
    # Affinity alone would spread them over both replicas, and it does spread
    # conversations that share nothing.
    assert len(affinity_owners(platform, conversations)) == 2
    unshared = {ask(platform, f"solo-{k}", system="")[0] for k in range(12)}
    assert len(unshared) == 2
    shared_blocks = PREFIX_TOKENS // BLOCK * BLOCK - BLOCK  # below the prefix's end
    # Warm-up: the first conversation computes the prefix somewhere; its events
    # reach the gateway a moment later. New conversations probe until one is
    # answered from the cache.
    probes = iter(range(1000))

    def warmed() -> str | None:
        replica, _prompt, cached = ask(platform, f"warm-{next(probes)}")
        return replica if cached >= shared_blocks else None

    holder = wait_until(warmed, timeout_s=30, message="a probe answered from cache")
    answers = [ask(platform, conversation) for conversation in conversations]
    assert {replica for replica, _p, _c in answers} == {holder}
    for _replica, prompt, cached in answers:
        assert cached >= shared_blocks
        assert prompt - 64 < cached < prompt
    assert index_blocks(platform) >= PREFIX_TOKENS // BLOCK


def test_a_restarted_replica_leaves_the_index(
    platform: LivePlatform, unblocked: None
) -> None:
    holder, _prompt, _cached = ask(platform, "conv-0")
    before = wait_until(
        lambda: index_blocks(platform) or None, message="the index's blocks gauge"
    )
    url = next(r.url for r in platform.serving() if r.replica_id == holder)
    state = httpx.get(f"{url}/sim/state", headers=platform.sim_admin_headers())
    os.kill(state.json()["pid"], signal.SIGKILL)
    # Its connection drops: every block it held leaves the gateway's index.
    wait_until(
        lambda: index_blocks(platform) <= before - PREFIX_TOKENS // BLOCK,
        timeout_s=20,
        message="the dead replica's entries gone from the index",
    )

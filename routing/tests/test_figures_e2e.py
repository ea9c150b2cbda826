"""The rollout guards' figures end to end: real gateway, agent and replica processes.

A canary's and the live version's requests are counted per role, a degraded
canary's refusals are caught by the detector, and a shadow whose replica fails
every request never reaches the caller while its figures count the errors. With
no rollout at all, every pool's live figures (role ``pool``) still come back
through the pool state API, per region.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from django.utils import timezone

from accounts import services as accounts_services
from localrun.processes import wait_until
from metering.domain.figures import Role, VersionFigures
from metering.services import flush_redis_figures, version_figures
from rollouts import services as rollouts
from routing.domain.routing_key import routing_key, stable_fraction
from tests.live import LivePlatform, cached_tokens_of, extra_of, usage_of

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def platform(shared_platform: LivePlatform) -> LivePlatform:
    """The shared platform (conftest.py): v1 live, v2 ready for a rollout."""
    return shared_platform


def ask(platform: LivePlatform, conversation: str) -> tuple[str, int]:
    """Send one streaming request; return (version, completion tokens)."""
    stream = platform.client().chat.completions.create(
        model="chat-7b",
        messages=MESSAGES,
        max_tokens=16,
        stream=True,
        extra_headers={"x-conversation-id": conversation},
    )
    chunks = list(stream)
    return extra_of(chunks[-1])["model_version"], usage_of(chunks[-1]).completion_tokens


def is_canary_slice(conversation: str, percent: float) -> bool:
    """Return True if the canary split sends ``conversation`` to the canary."""
    key = routing_key(conversation, MESSAGES)
    return stable_fraction(key, salt="canary:chat-7b") * 100 < percent


def figures(
    platform: LivePlatform, version: str, role: Role, since: datetime
) -> VersionFigures:
    """Return the version's figures in ``role`` since ``since``, flushed first.

    With Redis, this test flushes as the beat task would; without, the gateway
    flushes its own every second.
    """
    if os.environ.get("REDIS_URL"):
        import redis

        with redis.Redis.from_url(os.environ["REDIS_URL"]) as client:
            flush_redis_figures(
                client=client,
                prefix=platform.prefix,
                region=platform.region,
                now=timezone.now(),
            )
    return version_figures(model_id="chat-7b", version=version, role=role, since=since)


def faults(platform: LivePlatform, version: str, **changes: Any) -> None:
    for replica in platform.serving(version):
        httpx.post(
            f"{replica.url}/sim/faults",
            json=changes,
            headers=platform.sim_admin_headers(),
        ).raise_for_status()


def wait_for_figures(
    platform: LivePlatform,
    version: str,
    role: Role,
    since: datetime,
    expected: dict[str, Any],
) -> VersionFigures:
    """Poll until the figures show ``expected`` (attribute -> value)."""
    seen: list[VersionFigures] = []

    def check() -> VersionFigures | None:
        current = figures(platform, version, role, since)
        seen.append(current)
        actual = {name: getattr(current, name) for name in expected}
        return current if actual == expected else None

    try:
        return wait_until(check, timeout_s=15, interval_s=0.2, message="figures")
    except AssertionError:
        raise AssertionError(
            f"{version} {role}: expected {expected}, last read {seen[-1:]}"
        ) from None


def test_canary_and_live_figures_with_a_degraded_canary(
    platform: LivePlatform, unblocked: None
) -> None:
    since = timezone.now()
    faults(platform, "v2", degraded=True)
    rollouts.set_rollout(
        model_id="chat-7b", version="v2", stage="canary", percent=50, now=since
    )
    answers: list[tuple[str, int]] = []
    slice_ = (f"probe-{i}" for i in range(10_000))
    try:
        # Until the gateway's snapshot has the canary, ask only conversations of
        # the canary's slice: a v1 answer to one of them was not recorded (no
        # rollout yet), a v2 answer was, as canary.
        probes = (c for c in slice_ if is_canary_slice(c, 50))

        def probe() -> bool:
            answer = ask(platform, next(probes))
            if answer[0] == "v2":
                answers.append(answer)
            return answer[0] == "v2"

        wait_until(probe, timeout_s=15, interval_s=0.1, message="the canary")
        answers += [ask(platform, f"conv-{i}") for i in range(16)]
        # Pinned requests are the team's choice: never counted (the exact counts
        # below would not be reached).
        for pinned_to in ("v1", "v2"):
            pinned = platform.client().chat.completions.create(
                model=f"chat-7b@{pinned_to}",
                messages=MESSAGES,
                max_tokens=4,
            )
            assert extra_of(pinned)["model_version"] == pinned_to
        canary = [tokens for version, tokens in answers if version == "v2"]
        live = [tokens for version, tokens in answers if version == "v1"]
        assert live and len(canary) > 1

        got = wait_for_figures(
            platform,
            "v2",
            Role.CANARY,
            since,
            {
                "requests": len(canary),
                "answered": len(canary),
                "refusals": len(canary),
                "output_tokens": sum(canary),
                "conversations": len(canary),
                "ttft_count": len(canary),
                "errors": {},
            },
        )
        assert got.refusal_rate == 1.0
        # Every live answer began its conversation beside a 50% canary: the
        # baseline band (routing.domain.sticky), which the guards compare with.
        wait_for_figures(
            platform,
            "v1",
            Role.BASELINE,
            since,
            {
                "requests": len(live),
                "answered": len(live),
                "refusals": 0,
                "output_tokens": sum(live),
                "conversations": len(live),
                "errors": {},
            },
        )
    finally:
        faults(platform, "v2", degraded=False)
        rollouts.set_alias(model_id="chat-7b", version="v1")
        # The next test makes v2 fail: wait until the gateway has dropped the
        # canary (a conversation of its slice is answered by v1 again).
        in_slice = next(c for c in slice_ if is_canary_slice(c, 50))
        wait_until(
            lambda: ask(platform, in_slice)[0] == "v1",
            timeout_s=15,
            interval_s=0.1,
            message="the canary to end at the gateway",
        )


def test_a_shadow_failure_never_reaches_the_caller(
    platform: LivePlatform, unblocked: None
) -> None:
    since = timezone.now()
    faults(platform, "v2", fail_rate=1.0)
    rollouts.set_rollout(
        model_id="chat-7b", version="v2", stage="shadow", percent=100, now=since
    )
    sent = 0
    try:

        def shadowed() -> bool:
            nonlocal sent
            version, tokens = ask(platform, f"shadow-probe-{sent}")
            sent += 1
            assert (version, tokens > 0) == ("v1", True)
            return figures(platform, "v2", Role.SHADOW, since).requests > 0

        wait_until(shadowed, timeout_s=15, interval_s=0.1, message="a shadow copy")
        for i in range(12):
            version, tokens = ask(platform, f"shadow-{i}")
            sent += 1
            assert version == "v1"
            assert tokens > 0

        def settled() -> VersionFigures | None:
            shadow = figures(platform, "v2", Role.SHADOW, since)
            return shadow if shadow.requests >= 13 else None

        shadow = wait_until(settled, timeout_s=15, interval_s=0.2, message="shadows")
        assert shadow.requests <= sent
        assert shadow.errors == {"upstream": shadow.requests}
        assert shadow.answered == 0
        assert shadow.error_rate == 1.0
    finally:
        faults(platform, "v2", fail_rate=0.0)
        rollouts.set_alias(model_id="chat-7b", version="v1")


def flush(platform: LivePlatform) -> None:
    """Flush the figures as the beat task would (without Redis the gateway
    flushes its own every second)."""
    if os.environ.get("REDIS_URL"):
        import redis

        with redis.Redis.from_url(os.environ["REDIS_URL"]) as client:
            flush_redis_figures(
                client=client,
                prefix=platform.prefix,
                region=platform.region,
                now=timezone.now(),
            )


def test_pool_state_shows_live_figures_per_region_without_a_rollout(
    platform: LivePlatform, unblocked: None
) -> None:
    _, secret = accounts_services.create_admin_token(name="pool-live-e2e")
    api = httpx.Client(
        base_url=platform.url,
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )
    system: ChatCompletionMessageParam = {
        "role": "system",
        "content": "You answer briefly. " * 40,
    }
    versions: set[str] = set()
    cached = 0
    ttfts: list[float] = []
    for i in range(6):
        turns: list[ChatCompletionMessageParam] = [system]
        for text in ("one", "two"):
            turns.append({"role": "user", "content": f"{text} {i}"})
            started = time.monotonic()
            stream = platform.client().chat.completions.create(
                model="chat-7b",
                messages=turns,
                max_tokens=8,
                stream=True,
                extra_headers={"x-conversation-id": f"pool-live-{i}"},
            )
            chunks: list[ChatCompletionChunk] = []
            for chunk in stream:
                if not chunks:
                    ttfts.append(time.monotonic() - started)
                chunks.append(chunk)
            final = chunks[-1]
            versions.add(extra_of(final)["model_version"])
            cached += cached_tokens_of(final)
            turns.append(
                {
                    "role": "assistant",
                    "content": "".join(
                        c.choices[0].delta.content or "" for c in chunks if c.choices
                    ),
                }
            )
    # No canary, no shadow: the alias sent everything to the live version.
    assert versions == {"v1"}
    assert cached > 0  # the follow-ups hit the replicas' prefix caches

    def pool_entry() -> dict[str, Any] | None:
        flush(platform)
        state = api.get(
            "/admin/pools/chat-7b/state", params={"region": platform.region}
        )
        state.raise_for_status()
        data = state.json()
        assert data["region"] == platform.region
        [v1] = [p for p in data["pools"] if p["version"] == "v1"]
        assert {p["region"] for p in data["pools"]} == {platform.region}
        found: dict[str, Any] = {**v1, "model_hit_rate": data["prefix_hit_rate"]}
        return found if v1["requests"] >= 12 and v1["prefix_hit_rate"] else None

    v1 = wait_until(pool_entry, timeout_s=15, interval_s=0.5, message="pool figures")

    assert v1["ttft_p95_ms"] is not None and v1["ttft_p95_ms"] > 0
    assert v1["ttft_p99_ms"] >= v1["ttft_p95_ms"]
    assert 0 < v1["prefix_hit_rate"] <= 1
    assert 0 < v1["model_hit_rate"] <= 1
    assert v1["tpot_p50_ms"] is not None
    # The routers' count is read from this region's gateways' shares in Redis
    # (what an earlier test left open may still be in it: a number, never null).
    # Without Redis the one gateway keeps it in its own memory, which the control
    # plane cannot read: null, as the docs say.
    if os.environ.get("REDIS_URL"):
        assert isinstance(v1["router_tokens_in_flight"], int)
        assert v1["router_tokens_in_flight"] >= 0
    else:
        assert v1["router_tokens_in_flight"] is None
    # Another region has no pool here; a malformed one is refused.
    elsewhere = api.get("/admin/pools/chat-7b/state", params={"region": "nowhere"})
    assert elsewhere.json()["pools"] == []
    assert elsewhere.json()["prefix_hit_rate"] is None
    bad = api.get("/admin/pools/chat-7b/state", params={"region": "Not A Region"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "region"

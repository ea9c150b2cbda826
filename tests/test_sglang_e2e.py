"""A version whose engine is SGLang, end to end: agent, replicas, beats, gateway.

The platform runs as real processes (``tests.live.start_platform``): the node
agent starts the version's replicas as simulated SGLang servers
(``python -m simengine --sim-engine sglang`` with the flags a real SGLang
would get and its API key in a 0600 ``--config`` file), they beat through Redis
with figures read from SGLang's ``sglang:`` metrics, and the gateway serves them
to the openai SDK. SGLang's radix cache reuses a repeated prompt to the token
(all but the last), where vLLM's block cache stops at a 16-token boundary, so
the cached tokens the client is told say which engine answered.
"""

from __future__ import annotations

import itertools
import json
import stat
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
import redis
from django.db.models import Sum
from django.utils import timezone

from engine_nodes.domain.scrape import parse_metrics_text
from engine_nodes.heartbeats import RedisBeatStore
from engine_nodes.models import Replica
from localrun.processes import wait_until
from metering.models import Usage
from metering.services import flush_redis_usage
from tests.live import LivePlatform, start_platform, usage_of

if TYPE_CHECKING:
    from openai.types import CompletionUsage
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# A long prompt, sent twice: the second is answered from the prefix cache.
PROMPT = " ".join(f"clause {i} of the shared system prompt;" for i in range(60))


def replica_process(port: int) -> tuple[int, list[str]]:
    """Return the pid and argv of the simulated replica listening on ``port``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            raw = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        argv = [arg.decode() for arg in raw.split(b"\0") if arg]
        flags = dict(itertools.pairwise(argv))
        if "simengine" in argv and flags.get("--port") == str(port):
            return int(proc.name), argv
    raise AssertionError(f"no simulated replica on port {port}")


@pytest.fixture
def live(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path: Path,
    redis_url: str,  # its beats and usage are read from Redis: skipped without
) -> Iterator[LivePlatform]:
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp_path, pools={"v1": 1}, engine_config={"engine": "sglang"}
        ) as platform,
    ):
        yield platform


def test_an_sglang_version_serves_with_its_own_cache_and_metrics(
    live: LivePlatform,
) -> None:
    """GIVEN chat-7b@v1 registered with engine sglang
    WHEN the agent starts its replica and team beta asks twice with one long prompt
    THEN the replica runs SGLang's command line with its key in a 0600 file (not
    in its process list), its beats carry the running request read from
    sglang:num_running_reqs, the second answer's cached tokens are the whole
    prompt but its last token (SGLang's radix cache, not 16-token blocks), and
    the usage rows equal what the client was told."""
    [replica] = Replica.objects.filter(region=live.region, state="serving")
    pid, argv = replica_process(int(replica.url.rsplit(":", 1)[1]))
    assert argv[1:5] == ["-m", "simengine", "--sim-engine", "sglang"]
    assert {"--model-path", "--tp-size", "--enable-cache-report"} <= set(argv)
    config = Path(argv[argv.index("--config") + 1])
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    engine_key = live.env["PLATFORM_ENGINE_API_KEY"]
    assert json.loads(config.read_text()) == {"api-key": engine_key}
    assert engine_key not in " ".join(argv)
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert engine_key.encode() not in environ

    # The replica speaks SGLang's metrics, and demands the key from its file.
    metrics = httpx.get(f"{replica.url}/metrics", timeout=5).text
    assert "sglang:num_running_reqs" in metrics and "vllm:" not in metrics
    refused = httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={"model": "chat-7b", "messages": [{"role": "user", "content": "x"}]},
        timeout=5,
    )
    assert refused.status_code == 401

    # Team beta: the platform's start-up pings are alpha's.
    client = openai.OpenAI(
        base_url=f"{live.url}/v1", api_key=live.keys["beta"], max_retries=0
    )
    told = {"prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "requests": 0}

    def ask() -> CompletionUsage:
        chunks = list(
            client.chat.completions.create(
                model="chat-7b",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = usage_of(chunks[-1])
        details = usage.prompt_tokens_details
        told["prompt_tokens"] += usage.prompt_tokens
        told["cached_tokens"] += (details.cached_tokens or 0) if details else 0
        told["output_tokens"] += usage.completion_tokens
        told["requests"] += 1
        return usage

    first = ask()
    second = ask()
    assert first.prompt_tokens == second.prompt_tokens > 200
    assert second.prompt_tokens_details is not None
    # To the token: all of the prompt but the last token, which is recomputed.
    assert second.prompt_tokens_details.cached_tokens == second.prompt_tokens - 1
    # (A prompt ending mid-block, so 16-token blocks could not give as much.)
    assert (second.prompt_tokens - 1) % 16 != 0

    # A held stream shows in the replica's beat, read from SGLang's metrics.
    held = client.chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": "hold"}],
        max_tokens=4000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    stream = iter(held)
    next(stream)
    beats = RedisBeatStore(
        redis.Redis.from_url(live.env["REDIS_URL"]),
        prefix=live.prefix,
        ttl_s=30,
    )
    wait_until(
        lambda: any(
            beat.num_running == 1 and beat.tokens_in_flight > 0
            for beat in beats.read_region(live.region)
        ),
        timeout_s=15,
        message="a beat with the held stream, from sglang: metrics",
    )
    stats = parse_metrics_text(httpx.get(f"{replica.url}/metrics", timeout=5).text)
    assert stats.num_requests_running == 1
    assert stats.block_size == 1  # SGLang's token pool: one-token pages
    assert stats.prefix_cache_hits >= second.prompt_tokens - 1
    held.close()

    def rows_match() -> bool:
        with redis.Redis.from_url(live.env["REDIS_URL"]) as redis_client:
            flush_redis_usage(
                client=redis_client,
                prefix=live.prefix,
                now=timezone.now() + timedelta(minutes=2),
            )
        rows = Usage.objects.filter(team_id="beta", model_id="chat-7b").aggregate(
            prompt_tokens=Sum("prompt_tokens"),
            cached_tokens=Sum("cached_tokens"),
            requests=Sum("requests"),
        )
        # The held stream (cut by the client) is a row too: at least what was told.
        return (
            rows["requests"] == told["requests"] + 1
            and rows["cached_tokens"] == told["cached_tokens"]
            and rows["prompt_tokens"] > told["prompt_tokens"]
        )

    wait_until(rows_match, timeout_s=20, message="usage rows with the cached tokens")

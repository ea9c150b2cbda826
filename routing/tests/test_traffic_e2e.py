"""The traffic twin end to end: real gateway and replicas, the openai SDK, Redis.

A pool that does not record keeps nothing. Once its ``record_traffic_share`` is
1, every request is recorded without its text, and ``export_traffic`` writes the
window as a trace the fleet simulator and the load-test gate read: a
conversation's second turn extends its first turn's block hashes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from drills.domain.workload import read_trace, trace_arrivals
from localrun.processes import wait_until
from models_registry.domain.load_test import read_replay_trace
from models_registry.models import Pool
from routing.traffic import read_traffic, stream_key
from tests.live import LivePlatform

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SECRET = "The codename Nightingale and its budget are confidential. " * 6


def ask(platform: LivePlatform, conversation: str, turns: int = 1) -> None:
    """Send ``turns`` turns of one conversation (each repeats the history)."""
    client = platform.client("alpha")
    messages: list[dict[str, str]] = [{"role": "system", "content": SECRET}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} {SECRET}"})
        answer = client.chat.completions.create(
            model="chat-7b",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            extra_headers={"x-conversation-id": conversation},
        )
        messages.append(
            {"role": "assistant", "content": answer.choices[0].message.content or ""}
        )


def set_share(platform: LivePlatform, share: float) -> None:
    Pool.objects.filter(
        model_id="chat-7b", version__version="v1", region=platform.region
    ).update(record_traffic_share=share)


def test_a_recording_pool_keeps_requests_without_text_for_the_export(
    shared_platform: LivePlatform, unblocked: None, redis_url: str, tmp_path: Path
) -> None:
    import redis

    platform = shared_platform
    key = stream_key(platform.prefix, "chat-7b")
    client = redis.Redis.from_url(redis_url)
    try:
        ask(platform, "off-1")
        time.sleep(1.5)  # past a flush
        assert client.xlen(key) == 0

        set_share(platform, 1.0)

        # Once the gateway's snapshot has the share, its requests are recorded.
        def recorded() -> bool:
            ask(platform, "warm")
            return bool(client.xlen(key))

        wait_until(
            recorded,
            timeout_s=20,
            interval_s=0.5,
            message="a request recorded",
        )
        since = time.time()
        ask(platform, "twin-a", turns=2)
        ask(platform, "twin-b")
        wait_until(
            lambda: (
                len(
                    list(
                        read_traffic(
                            client,
                            prefix=platform.prefix,
                            model="chat-7b",
                            since=since,
                            until=time.time(),
                        )
                    )
                )
                >= 3
            ),
            timeout_s=10,
            message="the window's records",
        )
        raw = repr(client.xrange(key))
        assert "Nightingale" not in raw and "twin-a" not in raw

        out = tmp_path / "trace.jsonl"
        subprocess.run(
            [
                sys.executable,
                "manage.py",
                "export_traffic",
                "--model",
                "chat-7b",
                "--since",
                datetime.fromtimestamp(since, UTC).isoformat(),
                "--out",
                str(out),
            ],
            cwd=ROOT,
            env=platform.env,
            check=True,
            timeout=60,
        )
    finally:
        set_share(platform, 0.0)
        client.delete(key)
        client.close()

    text = out.read_text()
    assert "Nightingale" not in text and "twin-a" not in text and "alpha" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == 3
    first, second, other = lines
    assert first["conversation"] == second["conversation"] != other["conversation"]
    assert first["tier"] == "standard" and first["team"].startswith("team-")
    assert (first["model"], first["version"]) == ("chat-7b", "v1")
    assert first["max_tokens"] == 8 and 1 <= first["output_tokens"] <= 8
    assert first["prompt_tokens"] > 100 and first["replica"]
    # The second turn extends the first; the other conversation shares the
    # system prompt's blocks.
    assert (
        second["prefix_blocks"][: len(first["prefix_blocks"])]
        == (first["prefix_blocks"])
    )
    assert other["prefix_blocks"][:4] == first["prefix_blocks"][:4]
    assert second["cached_tokens"] > 0
    arrivals = list(trace_arrivals(read_trace(out)))
    assert arrivals[1].history_tokens > 0
    assert len(read_replay_trace(out)) == 3

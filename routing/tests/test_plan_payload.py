"""What the gateway sends the engine: its own fields, never a client's."""

from __future__ import annotations

import asyncio
import json
import random
import time

from routing.plan import GatewaySettings, plan_chat
from routing.prompt_tokens import VersionCounters
from routing.tests.embedded_gateway import MODEL, _snapshot


def test_a_clients_priority_never_reaches_the_engine() -> None:
    plan = asyncio.run(
        plan_chat(
            snapshot=_snapshot(None),
            settings=GatewaySettings(region="embedded"),
            counters=VersionCounters(),
            team="alpha",
            headers={b"x-priority": b"batch"},
            body={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
                "priority": -100,  # vLLM's field: a client would jump every queue
                "temperature": 0.5,
            },
            started_at=time.monotonic(),
            rng=random.Random(0),
        )
    )
    sent = json.loads(plan.payload)
    assert "priority" not in sent
    assert sent["temperature"] == 0.5  # the rest passes through
    assert sent["stream"] is True and sent["max_tokens"] == 8

"""Batch work is metered as such: the batch tier, or a batch job's key at any tier.

In process (``embedded_gateway``) against one real simulated replica, so a test
reads the usage counter itself. A batch job's runner sends its lines with the
job's key (``BATCH_KEY``), at the batch tier or, near the deadline, raised to
standard: both count as batch work, and both take the team's tokens per minute.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from localrun.processes import Process, sim_replica
from metering.domain.usage import UsageCounts
from routing.tests.embedded_gateway import BATCH_KEY, MODEL, TEAM_KEY, EmbeddedGateway

BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 4,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    with sim_replica(tmp_path_factory.mktemp("sim"), model=MODEL) as process:
        yield process


def metered_one(gateway: EmbeddedGateway, *, key: str, tier: str | None) -> UsageCounts:
    """Send one chat request; return the usage it was metered (all rows summed)."""
    headers = {"x-priority": tier} if tier else {}
    answer = gateway.request("/v1/chat/completions", BODY, key=key, headers=headers)
    assert answer.status == 200, answer.body[:300]
    return sum(gateway.metered().values(), UsageCounts())


@pytest.mark.parametrize(
    ("key", "tier"),
    [
        pytest.param(TEAM_KEY, "batch", id="batch-tier"),
        pytest.param(BATCH_KEY, "standard", id="batch-key-raised-to-standard"),
        pytest.param(BATCH_KEY, None, id="batch-key-default-tier"),
        pytest.param(BATCH_KEY, "batch", id="batch-key-batch-tier"),
    ],
)
def test_batch_work_is_metered_as_batch(
    replica: Process, key: str, tier: str | None
) -> None:
    with EmbeddedGateway(replica.url) as gateway:
        counts = metered_one(gateway, key=key, tier=tier)

    assert counts.requests == counts.batch_requests == 1
    assert counts.output_tokens == counts.batch_output_tokens == 4
    assert counts.prompt_tokens == counts.batch_prompt_tokens > 0


@pytest.mark.parametrize("tier", ["standard", "interactive"])
def test_a_team_key_at_another_tier_is_not_batch_work(
    replica: Process, tier: str
) -> None:
    with EmbeddedGateway(replica.url) as gateway:
        counts = metered_one(gateway, key=TEAM_KEY, tier=tier)

    assert (counts.requests, counts.output_tokens) == (1, 4)
    assert counts.prompt_tokens > 0
    assert (
        counts.batch_requests,
        counts.batch_prompt_tokens,
        counts.batch_output_tokens,
    ) == (0, 0, 0)


def test_batch_work_takes_the_teams_tokens_per_minute(replica: Process) -> None:
    with EmbeddedGateway(replica.url) as gateway:
        metered_one(gateway, key=BATCH_KEY, tier="batch")
        # One bucket: the team's on the model, charged by the batch line ...
        assert len(gateway.buckets) == 1
        metered_one(gateway, key=TEAM_KEY, tier="standard")
        # ... and the same one by the team's own request.
        assert len(gateway.buckets) == 1


@pytest.mark.parametrize(
    ("path", "method", "body"),
    [
        ("/v1/models", "GET", b""),
        ("/tokenize", "POST", {"model": MODEL, "prompt": "hello"}),
    ],
)
def test_a_batch_key_opens_only_what_a_batch_runs(
    replica: Process, path: str, method: str, body: bytes | dict[str, str]
) -> None:
    with EmbeddedGateway(replica.url) as gateway:
        refused = gateway.request(path, body, method=method, key=BATCH_KEY)
        allowed = gateway.request(path, body, method=method, key=TEAM_KEY)

    assert refused.status == 403, refused.body
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == (
        "permission_error",
        "batch_key_not_allowed",
    )
    assert allowed.status == 200, allowed.body

"""Tier entitlements in the gateway, in process against one simulated replica.

A tier the team may not use is a 403 before anything is charged or metered; a
batch job's key is judged as the batch tier whatever tier its line asks for.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from localrun.processes import Process, sim_replica
from routing.tests.embedded_gateway import BATCH_KEY, MODEL, TEAM_KEY, EmbeddedGateway

BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 4,
}


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    with sim_replica(tmp_path_factory.mktemp("sim"), model=MODEL) as process:
        yield process


def _status(gateway: EmbeddedGateway, key: str, tier: str | None) -> int:
    headers = {"x-priority": tier} if tier else {}
    answer = gateway.request("/v1/chat/completions", BODY, key=key, headers=headers)
    if answer.status == 403:
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == (
            "tier_not_entitled",
            "permission_error",
        )
    return answer.status


def test_a_tier_not_entitled_is_403_uncharged_and_unmetered(replica: Process) -> None:
    with EmbeddedGateway(replica.url, tiers=("batch",)) as gateway:
        assert _status(gateway, TEAM_KEY, "interactive") == 403
        assert _status(gateway, TEAM_KEY, None) == 403  # standard, the default
        assert not gateway.is_charged()
        assert gateway.metered() == {}
        assert _status(gateway, TEAM_KEY, "batch") == 200


@pytest.mark.parametrize("tier", [None, "standard", "interactive", "batch"])
def test_a_batch_key_is_judged_as_the_batch_tier(
    replica: Process, tier: str | None
) -> None:
    with EmbeddedGateway(replica.url, tiers=("batch",)) as gateway:
        assert _status(gateway, BATCH_KEY, tier) == 200
    with EmbeddedGateway(replica.url, tiers=("interactive", "standard")) as gateway:
        assert _status(gateway, BATCH_KEY, tier) == 403

"""USD budgets in the gateway without Redis (this process's ledger), in process
against one simulated replica: the reservation, its settlement to the usage's
cost, its return when admission refuses, and the 429 past the hard limit."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from localrun.processes import Process, sim_replica
from metering.domain.cost import TokenWeights
from routing.budgets import MemoryBudgetStore
from routing.domain.budget import Price, budget_key, month_of
from routing.domain.snapshot import BudgetRecord
from routing.tests.embedded_gateway import MODEL, EmbeddedGateway

PRICE = 1_000.0  # USD per million weighted tokens: a request costs a few cents
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 8,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    with sim_replica(tmp_path_factory.mktemp("sim"), model=MODEL) as process:
        yield process


def _budget(monthly_usd: float, spent_here_usd: float = 0.0) -> BudgetRecord:
    return BudgetRecord(
        team="alpha",
        model="",
        monthly_usd=monthly_usd,
        soft_fraction=0.8,
        hard_fraction=1.0,
        month=month_of(time.time()),
        spent_here_usd=spent_here_usd,
    )


def _spent(gateway: EmbeddedGateway) -> int:
    store = gateway.app.chat.meter.budgets.store
    assert isinstance(store, MemoryBudgetStore)
    return store.ledger.spent.get(budget_key("alpha", "", month_of(time.time())), 0)


def test_spend_settles_to_the_usage_cost_and_stops_at_the_hard_limit(
    replica: Process,
) -> None:
    """GIVEN a 1 USD budget of which 0.5 was flushed already
    WHEN the team sends requests one after another
    THEN the counter holds the flushed spend plus each served request's cost,
    and the request that would pass 1 USD is a 429 budget_exceeded."""
    price = Price(usd_per_million=PRICE, weights=TokenWeights())
    with EmbeddedGateway(
        replica.url, budget=_budget(1.0, 0.5), usd_per_million=PRICE
    ) as gateway:
        costs = []
        for _ in range(200):
            answer = gateway.request("/v1/chat/completions", BODY)
            if answer.status != 200:
                break
            usage = answer.json()["usage"]
            costs.append(
                price.cost_nano(
                    prompt_tokens=usage["prompt_tokens"],
                    cached_tokens=(usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    ),
                    output_tokens=usage["completion_tokens"],
                )
            )
            gateway.loop.run_until_complete(gateway.background.drain())
            assert _spent(gateway) == 500_000_000 + sum(costs)
        assert answer.status == 429
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == ("budget_exceeded", "rate_limit_error")
        assert int(answer.headers["retry-after"]) >= 1
        assert 500_000_000 + sum(costs) <= 1_000_000_000
        assert costs, "the budget had room for some requests"
        # The refusal is metered as a rate-limited request, and held nothing.
        counted = sum(c.rate_limited for c in gateway.metered().values())
        assert counted == 1
        assert _spent(gateway) == 500_000_000 + sum(costs)


def test_a_request_admission_refuses_gives_its_reservation_back(
    replica: Process,
) -> None:
    """With a bucket too small for the request (a 400) and then an empty one
    (a 429), the budget's counter is where it started."""
    with EmbeddedGateway(
        replica.url,
        budget=_budget(1.0),
        usd_per_million=PRICE,
        tokens_per_minute=60,
    ) as gateway:
        big = gateway.request("/v1/chat/completions", {**BODY, "max_tokens": 100})
        assert big.status == 400
        assert _spent(gateway) == 0
        for _ in range(20):
            answer = gateway.request("/v1/chat/completions", BODY)
            if answer.status == 429:
                break
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"
        gateway.loop.run_until_complete(gateway.background.drain())
        served = sum(c.requests for c in gateway.metered().values())
        assert served >= 1
        spent = _spent(gateway)
        assert gateway.request("/v1/chat/completions", BODY).status == 429
        assert _spent(gateway) == spent

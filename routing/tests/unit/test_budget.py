"""Budget pricing, months and the ledger (pure): explicit inputs, no clock."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from accounts.domain.entitlements import TIERS, budget_errors
from metering.domain.cost import TokenWeights, usd_per_million_at_full
from routing.domain.budget import (
    BudgetLedger,
    BudgetLine,
    Price,
    budget_key,
    month_of,
    seconds_to_next_month,
    to_nano,
)
from routing.domain.tiers import Tier

SEED_PRICE = usd_per_million_at_full(
    gpus_per_replica=1, gpu_hour_usd=2.5, tokens_per_s=2500.0
)


def _unix(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> float:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC).timestamp()


def test_tiers_in_accounts_match_the_gateway() -> None:
    assert tuple(t.value for t in Tier) == TIERS


def test_price_of_a_million_output_tokens_is_the_seed_price() -> None:
    price = Price(usd_per_million=SEED_PRICE, weights=TokenWeights())
    cost = price.cost_nano(prompt_tokens=0, cached_tokens=0, output_tokens=1_000_000)
    assert cost == pytest.approx(SEED_PRICE * 1e9, abs=1)
    assert round(SEED_PRICE, 2) == 0.28


def test_price_weighs_prompt_and_cached_tokens() -> None:
    price = Price(usd_per_million=1.0, weights=TokenWeights())
    # 1,000 uncached prompt tokens weigh 250 output tokens; 1,000 cached weigh 25.
    assert price.cost_nano(prompt_tokens=2000, cached_tokens=1000, output_tokens=0) == (
        275_000
    )


def test_embedding_is_priced_per_input_token() -> None:
    price = Price(usd_per_million=1.0, weights=TokenWeights(), input_priced=True)
    assert price.cost_nano(prompt_tokens=1000, cached_tokens=500, output_tokens=0) == (
        1_000_000
    )


def test_worst_case_is_never_below_the_cost_of_any_usage() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        weights = TokenWeights(
            prompt=rng.uniform(0, 2),
            cached=rng.uniform(0, 2),
            output=rng.uniform(0.1, 2),
        )
        price = Price(usd_per_million=rng.uniform(0.01, 50), weights=weights)
        prompt, output = rng.randrange(0, 9000), rng.randrange(0, 9000)
        worst = price.worst_nano(prompt_tokens=prompt, output_tokens=output)
        used = price.cost_nano(
            prompt_tokens=prompt,
            cached_tokens=rng.randrange(0, prompt + 1),
            output_tokens=rng.randrange(0, output + 1),
        )
        assert used <= worst


def test_month_and_seconds_to_the_next_one_are_utc_calendar_months() -> None:
    assert month_of(_unix(2026, 12, 31, 23, 59, 59)) == "2026-12"
    assert seconds_to_next_month(_unix(2026, 12, 31, 23, 59, 59)) == 1
    assert seconds_to_next_month(_unix(2027, 2, 1)) == 28 * 86_400
    assert seconds_to_next_month(_unix(2027, 1, 31, 12) + 0.5) == 43_200


def _line(key: str, limit: int, seed: int = 0) -> BudgetLine:
    return BudgetLine(key=key, limit_nano=limit, seed_nano=seed)


def test_ledger_reserves_up_to_the_limit_and_not_past_it() -> None:
    ledger = BudgetLedger()
    line = _line("a:*:2026-12", 100, seed=40)
    assert ledger.reserve([line], 60).allowed
    refused = ledger.reserve([line], 1)
    assert not refused.allowed
    assert refused.spent_nano == (100,)
    ledger.adjust([line.key], -30)  # settled below the reservation
    assert ledger.reserve([line], 30).allowed


def test_ledger_reserves_on_every_line_or_none() -> None:
    ledger = BudgetLedger()
    team, model = _line("a:*:2026-12", 1000), _line("a:m:2026-12", 50)
    assert ledger.reserve([team, model], 40).allowed
    refused = ledger.reserve([team, model], 20)
    assert (refused.allowed, refused.refused) == (False, 1)
    assert ledger.spent == {team.key: 40, model.key: 40}


def test_ledger_forgets_past_months() -> None:
    ledger = BudgetLedger()
    ledger.reserve([_line(budget_key("a", "", "2026-11"), 10)], 5)
    ledger.reserve([_line(budget_key("a", "m", "2026-12"), 10)], 5)
    ledger.forget_before("2026-12")
    assert list(ledger.spent) == ["a:m:2026-12"]


def test_to_nano_rounds_down() -> None:
    assert to_nano(0.000_000_001_9) == 1
    assert to_nano(12.5) == 12_500_000_000


@pytest.mark.parametrize(
    ("usd", "soft", "hard", "param"),
    [
        (0.0, 0.8, 1.0, "monthly_usd"),
        (10.0, 0.0, 1.0, "soft_fraction"),
        (10.0, 0.9, 0.5, "soft_fraction"),
        (10.0, 0.8, 11.0, "hard_fraction"),
    ],
)
def test_budget_errors_name_the_field(
    usd: float, soft: float, hard: float, param: str
) -> None:
    errors = budget_errors(monthly_usd=usd, soft_fraction=soft, hard_fraction=hard)
    assert [p for p, _ in errors] == [param]


def test_a_valid_budget_has_no_errors() -> None:
    assert budget_errors(monthly_usd=100.0, soft_fraction=0.8, hard_fraction=1.2) == []

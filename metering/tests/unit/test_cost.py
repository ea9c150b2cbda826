"""The cost model (metering.domain.cost): the seed's figures, the split, idle cost."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from metering.domain.cost import (
    PoolCost,
    PoolTime,
    Span,
    TeamTokens,
    TokenWeights,
    allocate,
    gpu_hour_usd_for,
    pool_times,
    replica_tokens_per_s,
    usd_per_million_at_full,
)

T0 = datetime(2026, 11, 1, tzinfo=UTC)
HOUR = 3600.0


def seed_pool(*, replicas: int = 1, hours: float = 1.0) -> PoolCost:
    """The seed's chat replica: 1 GPU at 2.50 USD an hour, 2,500 output tokens/s."""
    seconds = replicas * hours * HOUR
    return PoolCost(
        time=PoolTime(
            model="chat",
            version="v1",
            region="east",
            held_s=seconds,
            serving_s=seconds,
            gpu_s=seconds,
        ),
        gpus_per_replica=1,
        gpu_hour_usd=2.50,
        tokens_per_s=2500.0,
    )


def tokens(
    team: str,
    output: int,
    *,
    prompt: int = 0,
    cached: int = 0,
    region: str = "east",
) -> TeamTokens:
    return TeamTokens(
        team=team,
        model="chat",
        version="v1",
        region=region,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
    )


def test_seed_full_replica_costs_028_per_million() -> None:
    assert round(
        usd_per_million_at_full(
            gpus_per_replica=1, gpu_hour_usd=2.50, tokens_per_s=2500
        ),
        2,
    ) == pytest.approx(0.28)
    # Kept full for an hour: 9 million tokens for 2.50 USD.
    (cost,) = allocate(
        [seed_pool()], [tokens("search", 9_000_000)], weights=TokenWeights()
    )
    assert cost.utilisation == pytest.approx(1.0)
    assert round(cost.usd_per_million_tokens or 0, 2) == pytest.approx(0.28)
    assert cost.idle_usd == pytest.approx(0.0)
    assert cost.teams_usd == pytest.approx(2.50)


def test_seed_half_busy_replica_costs_056_per_million_and_shows_the_idle_half() -> None:
    (cost,) = allocate(
        [seed_pool()], [tokens("search", 4_500_000)], weights=TokenWeights()
    )
    assert cost.utilisation == pytest.approx(0.5)
    assert round(cost.usd_per_million_tokens or 0, 2) == pytest.approx(0.56)
    assert round(cost.usd_per_million_tokens_at_full or 0, 2) == pytest.approx(0.28)
    # The team pays the full-pool price for its tokens; the empty half is idle.
    assert cost.teams_usd == pytest.approx(1.25)
    assert cost.idle_usd == pytest.approx(1.25)
    assert cost.usd == pytest.approx(cost.teams_usd + cost.idle_usd)


def test_seed_fleet_month() -> None:
    """36 GPUs at 2.50 USD for 720 hours: 64,800 USD a month."""
    pool = PoolCost(
        time=PoolTime(
            model="chat",
            version="v1",
            region="east",
            held_s=36 * 720 * HOUR,
            serving_s=36 * 720 * HOUR,
            gpu_s=36 * 720 * HOUR,
        ),
        gpus_per_replica=1,
        gpu_hour_usd=2.50,
        tokens_per_s=2500.0,
    )
    (cost,) = allocate([pool], [], weights=TokenWeights())
    assert cost.usd == pytest.approx(64_800.0)
    assert cost.idle_usd == pytest.approx(64_800.0)
    assert cost.usd_per_million_tokens is None


def test_teams_split_the_used_cost_by_weighted_tokens() -> None:
    weights = TokenWeights(prompt=0.25, cached=0.025, output=1.0)
    usage = [
        tokens("a", 1_000_000, prompt=4_000_000, cached=0),  # 1M + 1M weighted
        tokens("b", 2_000_000, prompt=4_000_000, cached=4_000_000),  # 2M + 0.1M
    ]
    (cost,) = allocate([seed_pool()], usage, weights=weights)
    a, b = cost.teams
    assert a.weighted_tokens == pytest.approx(2_000_000)
    assert b.weighted_tokens == pytest.approx(2_100_000)
    assert cost.utilisation == pytest.approx(4.1 / 9)
    # Each pays the full pool's price per weighted token: 2.50 USD per 9 million.
    assert a.usd == pytest.approx(2.0 / 9 * 2.50)
    assert b.usd == pytest.approx(2.1 / 9 * 2.50)
    assert a.usd + b.usd + cost.idle_usd == pytest.approx(cost.usd)


def test_long_prompts_keep_a_pool_busy_and_pay_for_it() -> None:
    """Prefill is work: 30 million uncached prompt tokens with one-token answers
    fill the pool's hour (0.25 each) and pay its cost; they are not idle time."""
    (cost,) = allocate(
        [seed_pool()],
        [tokens("rag", 1_000, prompt=36_000_000)],
        weights=TokenWeights(),
    )
    assert cost.utilisation == pytest.approx(1.0)
    assert cost.teams[0].usd == pytest.approx(2.50)
    assert cost.idle_usd == pytest.approx(0.0)


def test_over_capacity_puts_all_cost_on_the_teams() -> None:
    (cost,) = allocate([seed_pool()], [tokens("a", 12_000_000)], weights=TokenWeights())
    assert cost.utilisation == 1.0
    assert cost.idle_usd == pytest.approx(0.0)
    assert cost.teams_usd == pytest.approx(2.50)


def test_usage_without_gpu_time_keeps_its_tokens_at_no_cost() -> None:
    (cost,) = allocate([], [tokens("a", 100)], weights=TokenWeights())
    assert cost.output_tokens == 100
    assert cost.usd == 0.0
    assert cost.teams[0].usd == 0.0


def west_pool(*, gpu_hour_usd: float = 3.50) -> PoolCost:
    return PoolCost(
        time=PoolTime("chat", "v1", "west", HOUR, HOUR, HOUR),
        gpus_per_replica=1,
        gpu_hour_usd=gpu_hour_usd,
        tokens_per_s=2500.0,
    )


def test_each_region_pays_its_own_gpu_hour_price() -> None:
    """East (2.50 USD) half busy, west (3.50 USD) full: the team pays 1.25 + 3.50.

    Splitting the version's 6.00 USD over both regions' 18 million tokens of
    capacity would bill the same 13.5 million tokens 4.50 USD.
    """
    usage = [tokens("a", 4_500_000), tokens("a", 9_000_000, region="west")]
    east, west = allocate([seed_pool(), west_pool()], usage, weights=TokenWeights())
    assert (east.region, west.region) == ("east", "west")
    assert east.teams[0].usd == pytest.approx(1.25)
    assert east.idle_usd == pytest.approx(1.25)
    assert west.teams[0].usd == pytest.approx(3.50)
    assert west.idle_usd == pytest.approx(0.0)
    assert east.teams[0].usd + west.teams[0].usd == pytest.approx(4.75)
    assert west.usd_per_million_tokens_at_full == pytest.approx(3.50 / 9)


def test_a_regions_tokens_never_fill_another_regions_pool() -> None:
    """West's tokens with no west pool cost nothing; east's pool stays idle."""
    east, west = allocate(
        [seed_pool()], [tokens("a", 9_000_000, region="west")], weights=TokenWeights()
    )
    assert east.idle_usd == pytest.approx(2.50)
    assert east.teams == ()
    assert (west.usd, west.teams[0].usd, west.output_tokens) == (0.0, 0.0, 9_000_000)


def test_pool_times_clip_spans_and_count_only_holding_states() -> None:
    spans = [
        Span(
            "chat",
            "v1",
            "east",
            2,
            "starting",
            T0 - timedelta(minutes=5),
            T0 + timedelta(minutes=5),
        ),
        Span("chat", "v1", "east", 2, "serving", T0 + timedelta(minutes=5), None),
        Span("chat", "v1", "east", 2, "gone", T0, None),
    ]
    (time,) = pool_times(spans, start=T0, end=T0 + timedelta(hours=1))
    assert time.held_s == pytest.approx(HOUR)
    assert time.serving_s == pytest.approx(55 * 60)
    assert time.gpu_s == pytest.approx(2 * HOUR)


def test_region_price_falls_back_to_the_default() -> None:
    assert gpu_hour_usd_for("west", default=2.5, by_region={"west": 3.0}) == 3.0
    assert gpu_hour_usd_for("east", default=2.5, by_region={"west": 3.0}) == 2.5


def test_weights_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        TokenWeights(output=0.0)
    with pytest.raises(ValueError):
        TokenWeights(prompt=-1.0)


def test_a_replica_without_a_measurement_is_assumed() -> None:
    assert replica_tokens_per_s(1800.0, assumed=2500.0) == (1800.0, False)
    assert replica_tokens_per_s(None, assumed=2500.0) == (2500.0, True)
    # A measured 0 is no measurement, as the autoscaler reads it.
    assert replica_tokens_per_s(0.0, assumed=2500.0) == (2500.0, True)


def test_an_embedding_pool_is_priced_per_input_token() -> None:
    """GIVEN a chat pool and an embedding pool of one GPU-hour each (2.50 USD),
    the embedding replica measured at 50,000 input tokens/s WHEN a team embeds
    90 million tokens (half the capacity) and another chats THEN the embedding
    team pays for its input tokens at the full-pool price, the idle half is its
    own line, and the cost per million is over input tokens."""
    embed_time = PoolTime(
        model="embed",
        version="v1",
        region="east",
        held_s=HOUR,
        serving_s=HOUR,
        gpu_s=HOUR,
    )
    embed_pool = PoolCost(
        time=embed_time, gpus_per_replica=1, gpu_hour_usd=2.50, tokens_per_s=50_000.0
    )
    embedded = TeamTokens(
        team="rag",
        model="embed",
        version="v1",
        region="east",
        prompt_tokens=90_000_000,
        cached_tokens=0,
        output_tokens=0,
    )
    chat, embed = allocate(
        [seed_pool(), embed_pool],
        [tokens("a", 4_500_000), embedded],
        weights=TokenWeights(),
        input_priced={"embed"},
    )
    assert (chat.priced_by, chat.priced_tokens) == ("output", 4_500_000)
    assert chat.utilisation == pytest.approx(0.5)
    assert (embed.priced_by, embed.priced_tokens) == ("input", 90_000_000)
    assert embed.capacity_tokens == 180_000_000
    assert embed.utilisation == pytest.approx(0.5)
    assert embed.teams[0].usd == pytest.approx(1.25)
    assert embed.idle_usd == pytest.approx(1.25)
    # 2.50 USD / (50,000 x 3600 / 1e6) at full; twice that at half.
    assert embed.usd_per_million_tokens_at_full == pytest.approx(2.50 / 180)
    assert embed.usd_per_million_tokens == pytest.approx(2.50 / 90)
    # Priced per output token instead, 0 output tokens would bill it nothing.
    (as_chat,) = allocate([embed_pool], [embedded], weights=TokenWeights())
    assert as_chat.usd_per_million_tokens is None

"""The capacity plan's embedding pool: off in the seed's scenario, and when set, its
replicas, GPUs and cost recompute from the inputs and join the fleet's totals."""

from __future__ import annotations

import math

import pytest

from drills.domain.capacity_plan import (
    EmbeddingPool,
    Scenario,
    ScenarioError,
    plan,
)
from simengine.domain.embedding_perf import EMBEDDING_PROFILES

RAG = {
    "embedding.ingest_requests_per_s": 60,
    "embedding.texts_per_request": 32,
    "embedding.tokens_per_text": 256,
    "embedding.search_queries_per_s": 50,
    "embedding.query_tokens": 32,
}


def test_the_seed_has_no_embedding_pool() -> None:
    seed = plan(Scenario())
    assert not Scenario().embedding.is_on
    names = [figure.name for figure in seed.figures]
    assert not [name for name in names if name.startswith("embedding")]
    assert all(figure.section != "Embedding pool" for figure in seed.figures)
    # The seed's totals, untouched: 12 + 3 x 2 GPUs a region.
    assert seed["gpus_per_region"] == 12 + 3 * 2
    assert seed["usd_per_month"] == 2 * 18 * 2.5 * 720


def test_the_default_replica_capacity_is_the_a100_profile_in_full_batches() -> None:
    profile = EMBEDDING_PROFILES["a100-minilm"]
    expected = profile.max_batch_tokens / profile.batch_seconds(
        profile.max_batch_tokens
    )
    assert EmbeddingPool().replica_input_tokens_per_s == round(expected)
    cpu = EMBEDDING_PROFILES["cpu-minilm"]
    assert EmbeddingPool.from_profile(cpu).replica_input_tokens_per_s == round(
        cpu.full_batch_tokens_per_s
    )


def test_a_rag_pool_is_sized_on_input_tokens_and_joins_the_fleet() -> None:
    capacity = 400_000
    scenario = Scenario.from_mapping(
        {**RAG, "embedding.replica_input_tokens_per_s": capacity}
    )
    p = plan(scenario)
    seed = plan(Scenario())
    load = 60 * 32 * 256 + 50 * 32
    assert p["embedding_input_tokens_per_s"] == load
    # Each region carries the whole peak (2 regions, 1 lost), at 70% of a replica.
    replicas = math.ceil(load / (capacity * 0.7))
    assert replicas > 1
    assert p["embedding_replicas_per_region"] == replicas
    assert p["embedding_gpus_per_region"] == replicas
    assert p["embedding_utilisation_normal"] == pytest.approx(
        load / 2 / (replicas * capacity)
    )
    assert p["gpus_per_region"] == seed["gpus_per_region"] + replicas
    assert p["gpus_total"] == seed["gpus_total"] + 2 * replicas
    assert p["embedding_usd_per_month"] == pytest.approx(2 * replicas * 2.5 * 720)
    assert p["usd_per_month"] == pytest.approx(
        seed["usd_per_month"] + p["embedding_usd_per_month"]
    )
    assert p["gpus_total_with_prefill"] == seed["gpus_total_with_prefill"] + 2 * (
        replicas
    )
    assert p["usd_per_month_with_prefill"] == pytest.approx(
        seed["usd_per_month_with_prefill"] + p["embedding_usd_per_month"]
    )
    per_million_full = 2.5 / (capacity * 3_600) * 1e6
    assert p["embedding_usd_per_million_tokens_full"] == pytest.approx(per_million_full)
    assert p["embedding_usd_per_million_tokens_normal"] == pytest.approx(
        per_million_full / p["embedding_utilisation_normal"]
    )
    # The chat side is the seed's.
    for name in ("chat_replicas_per_region", "chat_replicas_per_region_with_prefill"):
        assert p[name] == seed[name]


def test_the_pool_follows_regions_gpus_and_target() -> None:
    base = {**RAG, "embedding.replica_input_tokens_per_s": 100_000}
    load = 60 * 32 * 256 + 50 * 32
    four = plan(Scenario.from_mapping({**base, "regions": 4}))
    # 3 survivors share the peak.
    assert four["embedding_replicas_per_region"] == math.ceil(load / 3 / 70_000)
    two_gpus = plan(
        Scenario.from_mapping(
            {**base, "embedding.gpus_per_replica": 2, "embedding.target_utilisation": 1}
        )
    )
    replicas = math.ceil(load / 100_000)
    assert two_gpus["embedding_replicas_per_region"] == replicas
    assert two_gpus["embedding_gpus_per_region"] == 2 * replicas
    assert two_gpus["embedding_usd_per_million_tokens_full"] == pytest.approx(
        2.5 * 2 / (100_000 * 3_600) * 1e6
    )


def test_search_alone_makes_a_pool() -> None:
    p = plan(Scenario.from_mapping({"embedding.search_queries_per_s": 10}))
    assert p["embedding_input_tokens_per_s"] == 10 * 32
    assert p["embedding_replicas_per_region"] == 1


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("embedding.ingest_requests_per_s", -1, "at least 0"),
        ("embedding.target_utilisation", 1.5, "at most 1"),
        ("embedding.target_utilisation", 0, "greater than 0"),
        ("embedding.gpus_per_replica", 1.5, "whole number"),
        ("embedding.replica_input_tokens_per_s", 0, "greater than 0"),
    ],
)
def test_the_embedding_section_refuses_bad_values(
    key: str, value: float, message: str
) -> None:
    with pytest.raises(ScenarioError, match=message) as caught:
        Scenario.from_mapping({key: value})
    assert caught.value.key == key

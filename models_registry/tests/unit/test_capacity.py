"""Tests for measured capacity and a pool's token capacity."""

from __future__ import annotations

import pytest

from models_registry.domain.capacity import (
    CapacityRecord,
    pool_capacity_tokens,
    replica_tokens_in_flight,
)

UNMEASURED = CapacityRecord(tokens_per_s=None, tokens_in_flight=None)
MEASURED = CapacityRecord(tokens_per_s=2_500.0, tokens_in_flight=32_000)


def test_capacity_record_is_measured_with_both_figures() -> None:
    assert MEASURED.is_measured


@pytest.mark.parametrize(
    "record",
    [
        UNMEASURED,
        CapacityRecord(tokens_per_s=2_500.0, tokens_in_flight=None),
        CapacityRecord(tokens_per_s=None, tokens_in_flight=32_000),
    ],
)
def test_capacity_record_is_not_measured_without_both_figures(
    record: CapacityRecord,
) -> None:
    assert not record.is_measured


def test_pool_capacity_tokens_uses_measured_capacity() -> None:
    assert pool_capacity_tokens(3, MEASURED, default_tokens_in_flight=8_000) == 96_000


def test_pool_capacity_tokens_uses_default_until_measured() -> None:
    assert pool_capacity_tokens(3, UNMEASURED, default_tokens_in_flight=8_000) == 24_000


def test_pool_capacity_tokens_measured_zero_is_not_replaced_by_default() -> None:
    record = CapacityRecord(tokens_per_s=0.0, tokens_in_flight=0)
    assert pool_capacity_tokens(3, record, default_tokens_in_flight=8_000) == 0


@pytest.mark.parametrize("replicas", [0, -1])
def test_pool_capacity_tokens_zero_without_serving_replicas(replicas: int) -> None:
    assert pool_capacity_tokens(replicas, MEASURED, default_tokens_in_flight=8_000) == 0


def test_pool_capacity_tokens_never_negative_for_negative_default() -> None:
    assert pool_capacity_tokens(2, UNMEASURED, default_tokens_in_flight=-5) == 0


def test_pool_capacity_tokens_scales_linearly_with_replicas() -> None:
    one = pool_capacity_tokens(1, MEASURED, default_tokens_in_flight=8_000)
    assert pool_capacity_tokens(5, MEASURED, default_tokens_in_flight=8_000) == 5 * one


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (MEASURED, (32_000, False)),
        (UNMEASURED, (110_000, True)),
        # A figure of 0 is no measurement, as admission reads it.
        (CapacityRecord(tokens_per_s=2_500.0, tokens_in_flight=0), (110_000, True)),
    ],
)
def test_one_replica_carries_its_measured_figure_or_the_assumed_default(
    record: CapacityRecord, expected: tuple[int, bool]
) -> None:
    assert replica_tokens_in_flight(record, 110_000) == expected

"""The one nearest-rank percentile, on explicit values."""

from __future__ import annotations

import pytest

from simengine.domain.percentiles import percentile


def test_percentile_is_nearest_rank() -> None:
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.95) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([], 0.95) is None


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [(0.0, 1.0), (0.01, 1.0), (0.1, 1.0), (0.11, 2.0), (0.5, 5.0), (0.99, 10.0)],
)
def test_percentile_takes_the_value_of_rank_ceil_fraction_n(
    fraction: float, expected: float
) -> None:
    values = [float(v) for v in range(10, 0, -1)]
    assert percentile(values, fraction) == expected


def test_percentile_is_always_one_of_the_values() -> None:
    values = [0.3, 7.25, 1.5, 9.0]
    for step in range(101):
        assert percentile(values, step / 100) in values


def test_percentile_reads_any_iterable_and_keeps_it() -> None:
    values = [3.0, 1.0, 2.0]
    assert percentile(iter(values), 1.0) == 3.0
    assert percentile((v for v in values), 0.5) == 2.0
    assert values == [3.0, 1.0, 2.0]

"""How the console writes its figures (``console.domain.formats``): no database."""

from __future__ import annotations

import pytest

from console.domain.formats import (
    UNKNOWN,
    attribute,
    milliseconds,
    per_second,
    percent,
)


@pytest.mark.parametrize(
    ("ratio", "text"), [(0.4567, "45.7%"), (0.0, "0.0%"), (1.25, "125.0%")]
)
def test_percent_writes_one_decimal(ratio: float, text: str) -> None:
    assert percent(ratio) == text


def test_milliseconds_round_to_whole_ones() -> None:
    assert milliseconds(123.6) == "124 ms"


def test_per_second_rounds_to_whole_tokens() -> None:
    assert per_second(12_345.6) == "12346"
    assert per_second(0.0) == "0"


@pytest.mark.parametrize("write", [percent, milliseconds, per_second])
def test_unknown_figures_read_as_a_dash(write: object) -> None:
    assert callable(write)
    assert write(None) == UNKNOWN


def test_attribute_is_empty_when_unknown_and_raw_otherwise() -> None:
    assert attribute(None) == ""
    assert attribute(0.5) == "0.5"
    assert attribute(0) == "0"

"""How the console writes its figures, on the server and (the same rules, in
``console/static/console/pool.js``) in the browser.

Public surface: ``UNKNOWN``, ``percent``, ``milliseconds``, ``per_second``,
``attribute``.
"""

from __future__ import annotations

__all__ = ["UNKNOWN", "attribute", "milliseconds", "per_second", "percent"]

# What a figure that is not known (no traffic, no measurement) reads as.
UNKNOWN = "\u2014"


def percent(ratio: float | None) -> str:
    """Write a ratio as a percentage with one decimal: 0.4567 -> "45.7%"."""
    return UNKNOWN if ratio is None else f"{ratio * 100:.1f}%"


def milliseconds(value: float | None) -> str:
    """Write milliseconds without decimals: 123.4 -> "123 ms"."""
    return UNKNOWN if value is None else f"{value:.0f} ms"


def per_second(value: float | None) -> str:
    """Write a rate (tokens/s) as a whole number: 12345.6 -> "12346"."""
    return UNKNOWN if value is None else f"{value:.0f}"


def attribute(value: object) -> str:
    """Write a raw figure for a ``data-value`` attribute: empty when unknown."""
    return "" if value is None else str(value)

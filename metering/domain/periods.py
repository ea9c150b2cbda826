"""Calendar periods of a report: UTC days or months, clipped to the asked window.

Public surface: ``Period``, ``GROUP_BYS``, ``INSTANT_PATTERN``, ``periods``,
``parse_instant``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

__all__ = ["GROUP_BYS", "INSTANT_PATTERN", "Period", "parse_instant", "periods"]

GROUP_BYS = ("day", "month")

# What ``parse_instant`` reads: a month, a day, or a day with a time (and offset).
INSTANT_PATTERN = (
    r"^\d{4}-\d{2}(-\d{2}(T\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?(Z|[+-]\d{2}:\d{2})?)?)?$"
)
_INSTANT = re.compile(INSTANT_PATTERN)
MIN_YEAR, MAX_YEAR = 1970, 9000
_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(frozen=True, slots=True)
class Period:
    """One day or month: ``label`` (``2026-11`` or ``2026-11-05``), its calendar
    ``start`` and ``end``, and the part of it the report covers, ``[lo, hi)``."""

    label: str
    start: datetime
    end: datetime
    lo: datetime
    hi: datetime


def _floor(at: datetime, group_by: str) -> datetime:
    day = at.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day.replace(day=1) if group_by == "month" else day


def _next(start: datetime, group_by: str) -> datetime:
    if group_by == "day":
        return start + timedelta(days=1)
    if start.month == 12:
        return start.replace(year=start.year + 1, month=1)
    return start.replace(month=start.month + 1)


def periods(start: datetime, end: datetime, group_by: str) -> list[Period]:
    """Return the days or months that ``[start, end)`` touches, in order."""
    if group_by not in GROUP_BYS:
        raise ValueError(f"group_by must be one of {GROUP_BYS}, not {group_by!r}")
    found = []
    at = _floor(start, group_by)
    while at < end:
        after = _next(at, group_by)
        label = at.strftime("%Y-%m" if group_by == "month" else "%Y-%m-%d")
        found.append(Period(label, at, after, max(at, start), min(after, end)))
        at = after
    return found


def parse_instant(text: str, *, is_end: bool = False) -> datetime:
    """Read ``YYYY-MM``, ``YYYY-MM-DD`` or an ISO 8601 instant (naive: UTC).

    A month or a day given as ``to`` means its end: ``to=2026-11`` is up to
    2026-12-01 00:00 UTC, so ``from=2026-11&to=2026-11`` is November.

    Raises:
        ValueError: not one of those forms.
    """
    if not _INSTANT.match(text):
        raise ValueError(f"not a month, day or ISO 8601 instant: {text!r}")
    if not MIN_YEAR <= int(text[:4]) <= MAX_YEAR:
        # A report's periods and offsets step past the year; keep far from the ends.
        raise ValueError(f"the year must be {MIN_YEAR} to {MAX_YEAR}")
    month = _MONTH.match(text)
    if month:
        at = datetime(int(month[1]), int(month[2]), 1, tzinfo=UTC)  # ValueError: 13
        return _next(at, "month") if is_end else at
    if _DAY.match(text):
        at = datetime.fromisoformat(text).replace(tzinfo=UTC)
        return at + timedelta(days=1) if is_end else at
    at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)

"""Tests for the usage key and the in-memory ledger (pure, no DB)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from metering.domain.usage import UsageCounts, UsageKey, UsageLedger

NOON = int(datetime(2025, 3, 1, 12, 0, tzinfo=UTC).timestamp())


def key_at(minute_epoch: int, team: str = "search") -> UsageKey:
    return UsageKey(team, "chat-7b", "v1", minute_epoch)


def test_usage_key_from_time_truncates_to_the_minute_start() -> None:
    key = UsageKey.from_time("search", "chat-7b", "v1", NOON + 59.999)
    assert key == UsageKey("search", "chat-7b", "v1", NOON)
    assert UsageKey.from_time("search", "chat-7b", "v1", NOON + 60).minute_epoch == (
        NOON + 60
    )


def test_usage_key_minute_at_is_aware_utc() -> None:
    assert key_at(NOON).minute_at == datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def test_usage_key_rejects_a_minute_epoch_that_is_not_a_minute_start() -> None:
    with pytest.raises(ValueError, match="minute start"):
        key_at(NOON + 1)


def test_ledger_sums_counts_per_key() -> None:
    ledger = UsageLedger()
    ledger.add(key_at(NOON), UsageCounts(prompt_tokens=10, requests=1))
    ledger.add(key_at(NOON), UsageCounts(prompt_tokens=5, cached_tokens=2, requests=1))
    ledger.add(key_at(NOON, team="ads"), UsageCounts(shed=1))
    assert len(ledger) == 2
    assert ledger.drain() == {
        key_at(NOON): UsageCounts(prompt_tokens=15, cached_tokens=2, requests=2),
        key_at(NOON, team="ads"): UsageCounts(shed=1),
    }


def test_ledger_drain_by_minute_keeps_the_open_minute() -> None:
    ledger = UsageLedger()
    ledger.add(key_at(NOON - 60), UsageCounts(output_tokens=1))
    ledger.add(key_at(NOON), UsageCounts(output_tokens=2))
    ledger.add(key_at(NOON + 60), UsageCounts(output_tokens=3))

    closed = ledger.drain(before_minute_epoch=NOON + 60)

    assert closed == {
        key_at(NOON - 60): UsageCounts(output_tokens=1),
        key_at(NOON): UsageCounts(output_tokens=2),
    }
    assert len(ledger) == 1
    assert ledger.drain() == {key_at(NOON + 60): UsageCounts(output_tokens=3)}
    assert len(ledger) == 0


def test_ledger_drain_removes_what_it_returns() -> None:
    ledger = UsageLedger()
    ledger.add(key_at(NOON), UsageCounts(requests=1))
    assert ledger.drain(before_minute_epoch=NOON + 60)
    assert ledger.drain(before_minute_epoch=NOON + 60) == {}
    ledger.add(key_at(NOON), UsageCounts(requests=1))
    assert ledger.drain() == {key_at(NOON): UsageCounts(requests=1)}

"""Replica states and the missed-heartbeat rule.

Public surface: ``ReplicaState``, ``silence_cutoff``, ``is_silent``.

A replica beats every ``beat_s`` seconds; after ``missed_beats`` beats without a word
it is off the ring and the reaper marks it gone (seed: "removal from the ring after
3 missed beats").
"""

from __future__ import annotations

import enum
from datetime import datetime, timedelta

__all__ = ["ReplicaState", "is_silent", "silence_cutoff"]


class ReplicaState(enum.StrEnum):
    """The seed's replica states, plus ``stalled`` and ``gone``.

    ``stalled``: serving, but its engine holds requests and has shown no progress
    for a while (``engine_nodes.domain.progress``); it beats on and routers skip it
    until it moves again (back to ``serving``). ``gone``: it stopped beating.
    """

    STARTING = "starting"
    LOADING = "loading"
    SERVING = "serving"
    STALLED = "stalled"
    DRAINING = "draining"
    GONE = "gone"


def silence_cutoff(now: datetime, beat_s: float, missed_beats: int) -> datetime:
    """Return the instant before which a last heartbeat means the replica is silent."""
    return now - timedelta(seconds=beat_s * missed_beats)


def is_silent(
    last_heartbeat: datetime | None, now: datetime, beat_s: float, missed_beats: int
) -> bool:
    """Return True when a replica has missed ``missed_beats`` beats (or never beat)."""
    if last_heartbeat is None:
        return True
    return last_heartbeat < silence_cutoff(now, beat_s, missed_beats)

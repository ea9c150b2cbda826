"""A retry budget: retries may add at most a fraction of a pool's recent requests.

Public surface: ``RetryBudget``.

A retry storm (shed requests coming straight back, each retried on another
replica) multiplies load exactly when a pool can least take it. The gateway keeps
one ``RetryBudget`` per pool and asks it before every retry.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["RetryBudget"]

_BUCKETS = 60


class RetryBudget:
    """Allow a retry while retries in the window < max(min_retries, ratio * requests).

    Invariants:

    - The window is kept as ``60`` buckets of ``window_s / 60`` seconds each (one
      second by default) in a deque with running totals, so memory is bounded and
      every call is O(1) amortised. The window therefore covers the current bucket
      and the 59 before it: deliberately inexact by up to one bucket.
    - Only ``record_request`` counts requests; a retry does not, so retries can
      never grow their own budget. ``try_spend`` counts the retry only when it
      returns True.
    - ``min_retries`` lets a quiet pool still retry a few times per window.
    - Time comes in as ``now`` (seconds, monotonic). A ``now`` earlier than the
      newest bucket is counted in the newest bucket rather than rewriting history.
    - Not thread-safe: one budget per pool per event loop.
    """

    __slots__ = (
        "_buckets",
        "_requests",
        "_retries",
        "bucket_s",
        "min_retries",
        "ratio",
        "window_s",
    )

    def __init__(
        self, ratio: float = 0.1, window_s: float = 60.0, min_retries: int = 3
    ) -> None:
        if not ratio >= 0:
            raise ValueError("ratio must be zero or more")
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError("window_s must be a positive number of seconds")
        if min_retries < 0:
            raise ValueError("min_retries must be zero or more")
        self.ratio = ratio
        self.window_s = window_s
        self.min_retries = min_retries
        self.bucket_s = window_s / _BUCKETS
        # Each entry is [bucket index, requests, retries], oldest on the left.
        self._buckets: deque[list[int]] = deque()
        self._requests = 0
        self._retries = 0

    def record_request(self, now: float) -> None:
        """Count one request (not a retry) at ``now``."""
        self._current(now)[1] += 1
        self._requests += 1

    def try_spend(self, now: float) -> bool:
        """Return True, and count the retry, if the budget allows one at ``now``."""
        bucket = self._current(now)
        if self._retries >= max(self.min_retries, self.ratio * self._requests):
            return False
        bucket[2] += 1
        self._retries += 1
        return True

    def counts(self, now: float) -> tuple[int, int]:
        """Return (requests, retries) in the window ending at ``now``."""
        self._expire(math.floor(now / self.bucket_s))
        return self._requests, self._retries

    def _current(self, now: float) -> list[int]:
        index = math.floor(now / self.bucket_s)
        self._expire(index)
        buckets = self._buckets
        if buckets and buckets[-1][0] >= index:
            return buckets[-1]
        bucket = [index, 0, 0]
        buckets.append(bucket)
        return bucket

    def _expire(self, index: int) -> None:
        oldest_kept = index - _BUCKETS + 1
        buckets = self._buckets
        while buckets and buckets[0][0] < oldest_kept:
            _, requests, retries = buckets.popleft()
            self._requests -= requests
            self._retries -= retries

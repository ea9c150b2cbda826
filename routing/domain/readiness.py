"""Whether a region can serve: the verdict ``/healthz`` gives the global load balancer.

Public surface: ``Readiness``, ``judge_readiness``.

A process that answers is not yet a region that serves. HAProxy sends a region
clients only while its gateways say all three hold:

- **serving replicas**: every pool of the region that wants replicas has at least
  one a request may go to now (serving, beating, not ejected). A region whose chat
  pool is gone would otherwise take chats it can only refuse;
- **a fresh snapshot**: while the control plane answers, the last refresh is
  younger than ``max_snapshot_age_s`` (an older one means the refresh loop is stuck
  and the region serves from a view it no longer checks). While the control plane
  is down every region serves from its last snapshot, by design, so staleness
  alone does not fail a region then: failing them all would turn an outage of the
  control plane into an outage of serving;
- **Redis**: the region's limits, live load and usage live there. Without it a
  gateway still serves (limits enforced in the process, usage summed in memory),
  but a region whose Redis answers serves better, so the balancer prefers it.

The verdict is pure: the gateway gathers the facts, this module judges them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Readiness", "judge_readiness"]


@dataclass(frozen=True, slots=True)
class Readiness:
    """The verdict and its reasons (empty when ready), for people and for HAProxy."""

    ready: bool
    reasons: tuple[str, ...]
    snapshot: str  # "fresh", "stale" (control plane down), "too old", "none"


def judge_readiness(
    *,
    has_snapshot: bool,
    snapshot_age_s: float | None,
    control_plane_up: bool,
    max_snapshot_age_s: float,
    redis: str,
    serving: Mapping[str, int],
) -> Readiness:
    """Judge a region from what its gateway sees.

    ``redis`` is "up", "unreachable" or "unused" (no Redis configured: one embedded
    process, nothing to lose); ``serving`` maps each pool that wants replicas
    ("model@version") to how many replicas may take a request now.
    """
    reasons: list[str] = []
    if not has_snapshot:
        snapshot = "none"
        reasons.append("no control-plane snapshot yet")
    elif not control_plane_up:
        snapshot = "stale"
    elif snapshot_age_s is not None and snapshot_age_s > max_snapshot_age_s:
        snapshot = "too old"
        reasons.append(
            f"the snapshot is {snapshot_age_s:.0f} s old "
            f"(more than {max_snapshot_age_s:g} s) while the control plane answers"
        )
    else:
        snapshot = "fresh"
    if redis == "unreachable":
        reasons.append("the region's Redis is unreachable")
    for pool, count in sorted(serving.items()):
        if count <= 0:
            reasons.append(f"no serving replica for {pool}")
    return Readiness(ready=not reasons, reasons=tuple(reasons), snapshot=snapshot)

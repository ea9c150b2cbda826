"""A conversation keeps the version it started on, through every rollout step.

Public surface: ``Remembered``, ``needs_memory``, ``routable_versions``,
``first_choice``, ``in_baseline_band``, ``stick``, ``figure_role``.

The canary split is a stable hash of the conversation (``resolve``), so at a fixed
share a chat never changes version. But a step that raises the share moves the
conversations of the band it adds onto the canary, mid-chat if they are under
way; a promotion moves every live conversation to the new version. So from a
rollout's start (its shadow step, or its wait for replicas) until the old version
is retired, the gateways remember each conversation's version (``routing.sticky``,
in Redis, shared by every process) and keep sending its turns there, as long as
that version still takes alias traffic: the live one, the canary, or the old one
during its retention. A rollback clears the canary, so its conversations go back
to the live version: that is what a rollback is for.

A conversation the gateways have not seen goes where the split says only on its
first turn (no assistant message yet): one already under way stays on the live
version, where its earlier turns were. So the canary only takes conversations
that began on it, since it began. Comparing it with all of the live version's
traffic would then be biased (new conversations' first prompts are in no cache,
later turns' are), so, as Kayenta runs a baseline beside the canary, the gateways
mark a **baseline** band of the live version: conversations that began on it while
the canary ran and whose stable fraction lies in ``[50, 50 + share)`` (above 50%,
``[share, 100)``). Its conversations begin at the same moments as the canary's,
in a band as wide, so the two see the same traffic; the guards compare the
canary with it (role ``baseline``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from routing.domain.resolve import Resolution
from routing.domain.routing_key import stable_fraction
from routing.domain.snapshot import ModelRecord

__all__ = [
    "Remembered",
    "figure_role",
    "first_choice",
    "in_baseline_band",
    "needs_memory",
    "routable_versions",
    "stick",
]


@dataclass(frozen=True, slots=True)
class Remembered:
    """A conversation's version, and whether it is in the canary's baseline band."""

    version: str
    baseline: bool = False

    def encode(self) -> str:
        return f"{self.version}|{'b' if self.baseline else 'o'}"

    @classmethod
    def decode(cls, text: str) -> Remembered | None:
        version, _, flag = text.rpartition("|")
        if not version or flag not in ("b", "o"):
            return None
        return cls(version, flag == "b")


def in_baseline_band(fraction: float, canary_percent: float) -> bool:
    """Return True for a stable fraction in the baseline band of a canary share."""
    share = fraction * 100
    low = max(50.0, canary_percent)
    return low <= share < min(100.0, 50.0 + canary_percent)


def needs_memory(record: ModelRecord) -> bool:
    """Return True while conversations of the model must remember their version:
    a rollout is running (from its start), a canary is set, or an old version is
    kept after a promotion."""
    return (
        record.rollout_pending
        or (record.canary_version is not None and record.canary_percent > 0)
        or record.retained_version is not None
    )


def routable_versions(record: ModelRecord) -> tuple[str, ...]:
    """Return the versions a remembered conversation may go on to (alias traffic)."""
    versions = [record.live_version]
    if record.canary_version is not None and record.canary_percent > 0:
        versions.append(record.canary_version)
    if record.retained_version is not None:
        versions.append(record.retained_version)
    return tuple(dict.fromkeys(v for v in versions if v is not None))


def first_choice(
    resolution: Resolution,
    record: ModelRecord,
    *,
    first_turn: bool,
    routing_key: str,
) -> Remembered:
    """Return what to remember for a conversation seen for the first time.

    On its first turn, where the split sent it, in the baseline band or not; under
    way already, the live version (it began before the memory, on it).
    """
    if not first_turn and record.live_version is not None:
        return Remembered(record.live_version)
    baseline = (
        not resolution.is_canary
        and resolution.version == record.live_version
        and record.canary_version is not None
        and record.canary_percent > 0
        and in_baseline_band(
            stable_fraction(routing_key, salt="canary:" + resolution.model),
            record.canary_percent,
        )
    )
    return Remembered(resolution.version, baseline=baseline)


def stick(
    resolution: Resolution, remembered: Remembered | None, record: ModelRecord
) -> Resolution:
    """Return ``resolution`` moved to the conversation's remembered version.

    Unchanged for a pinned request, a conversation with nothing remembered, or a
    remembered version that no longer takes alias traffic (rolled back, retired).
    """
    if (
        resolution.is_pinned
        or remembered is None
        or remembered.version == resolution.version
        or remembered.version not in routable_versions(record)
    ):
        return resolution
    version = remembered.version
    return replace(
        resolution,
        version=version,
        is_canary=version == record.canary_version,
        shadow_version=(
            None if resolution.shadow_version == version else resolution.shadow_version
        ),
    )


def figure_role(
    resolution: Resolution, remembered: Remembered | None, record: ModelRecord
) -> str | None:
    """Return the guards' role of a request (``metering.domain.figures.Role``'s
    values), or None when it is not recorded: a pinned request, a model with no
    canary and no shadow, or a version the rollout does not compare."""
    if resolution.is_pinned or (
        record.canary_version is None and record.shadow_version is None
    ):
        return None
    if resolution.is_canary:
        return "canary"
    if resolution.version != record.live_version:
        return None  # the retained old version: nothing compares it
    if remembered is not None and remembered.baseline:
        return "baseline"
    return "live"

"""The gateway's last snapshot as a file: what a gateway restarted while the
database is down serves from.

Public surface: ``FORMAT``, ``SnapshotFileError``, ``file_key``, ``snapshot_to_dict``,
``snapshot_from_dict``, ``encode_file``, ``decode_file``.

The file is one JSON document ``{format, region, written_at, digest, snapshot}``.
``digest`` is an HMAC-SHA256, keyed from SECRET_KEY, over the canonical JSON of
everything else, so an edited or corrupt file, or one from another region, is
refused rather than served. Keys are in it only as the SHA-256 of their secrets,
as the snapshot holds them: never a secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, fields
from typing import Any

from routing.domain.snapshot import (
    BudgetRecord,
    ConfigSnapshot,
    EntitlementRecord,
    KeyRecord,
    LimitRecord,
    ModelRecord,
    ReplicaRecord,
    VersionRecord,
)

__all__ = [
    "FORMAT",
    "SnapshotFileError",
    "decode_file",
    "encode_file",
    "file_key",
    "snapshot_from_dict",
    "snapshot_to_dict",
]

FORMAT = 1


class SnapshotFileError(ValueError):
    """A snapshot file that must not be served; ``reason`` is a bounded word
    (``format``, ``region``, ``digest``, ``malformed``) fit for a metric label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def file_key(secret_key: str) -> bytes:
    """Return the HMAC key of snapshot files, derived from SECRET_KEY (never the
    key itself, so the digest reveals nothing usable elsewhere)."""
    return hmac.new(
        secret_key.encode(), b"platform snapshot file", hashlib.sha256
    ).digest()


def snapshot_to_dict(snapshot: ConfigSnapshot) -> dict[str, Any]:
    """Return ``snapshot`` as JSON-able values (mappings as sorted pairs)."""
    out: dict[str, Any] = {}
    for item in fields(ConfigSnapshot):
        value = getattr(snapshot, item.name)
        if item.name in ("built_at", "region"):
            out[item.name] = value
        elif item.name == "replicas":
            out[item.name] = [asdict(replica) for replica in value]
        elif isinstance(value, frozenset):
            out[item.name] = sorted(
                list(entry) if isinstance(entry, tuple) else entry for entry in value
            )
        else:
            out[item.name] = sorted(
                ([list(k) if isinstance(k, tuple) else k, asdict(v)])
                for k, v in value.items()
            )
    return out


_RECORDS: dict[str, type] = {
    "keys": KeyRecord,
    "limits": LimitRecord,
    "entitlements": EntitlementRecord,
    "budgets": BudgetRecord,
    "models": ModelRecord,
    "versions": VersionRecord,
}


def snapshot_from_dict(data: dict[str, Any]) -> ConfigSnapshot:
    """Rebuild a snapshot from ``snapshot_to_dict``'s values; raise
    ``SnapshotFileError("malformed")`` on anything else."""
    try:
        values: dict[str, Any] = {
            "built_at": float(data["built_at"]),
            "region": str(data["region"]),
            "replicas": tuple(ReplicaRecord(**row) for row in data["replicas"]),
        }
        for item in fields(ConfigSnapshot):
            if item.name in values or item.name not in data:
                continue
            record = _RECORDS.get(item.name)
            if record is None:  # a set: teams, pools
                values[item.name] = frozenset(
                    tuple(entry) if isinstance(entry, list) else entry
                    for entry in data[item.name]
                )
            else:
                values[item.name] = {
                    (tuple(k) if isinstance(k, list) else k): record(**v)
                    for k, v in data[item.name]
                }
        unknown = set(data) - {item.name for item in fields(ConfigSnapshot)}
        if unknown:
            raise SnapshotFileError("malformed")
        return ConfigSnapshot(**values)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, SnapshotFileError):
            raise
        raise SnapshotFileError("malformed") from None


def _canonical(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), allow_nan=False
    ).encode()


def _digest(key: bytes, envelope: dict[str, Any]) -> str:
    return hmac.new(key, _canonical(envelope), hashlib.sha256).hexdigest()


def encode_file(snapshot: ConfigSnapshot, *, key: bytes, written_at: float) -> bytes:
    """Return the file's bytes for ``snapshot``, written at ``written_at`` (unix s)."""
    envelope: dict[str, Any] = {
        "format": FORMAT,
        "region": snapshot.region,
        "written_at": written_at,
        "snapshot": snapshot_to_dict(snapshot),
    }
    envelope["digest"] = _digest(key, envelope)
    return _canonical(envelope)


def decode_file(raw: bytes, *, key: bytes, region: str) -> tuple[ConfigSnapshot, float]:
    """Return (snapshot, written_at) from a file's bytes, or raise
    ``SnapshotFileError`` when it is not this format, not this region's, or its
    digest does not verify."""
    try:
        envelope = json.loads(raw)
    except ValueError:
        raise SnapshotFileError("malformed") from None
    if not isinstance(envelope, dict) or not isinstance(envelope.get("digest"), str):
        raise SnapshotFileError("malformed")
    digest = envelope.pop("digest")
    try:
        expected = _digest(key, envelope)
    except (TypeError, ValueError):
        raise SnapshotFileError("malformed") from None
    if not hmac.compare_digest(digest, expected):
        raise SnapshotFileError("digest")
    if envelope.get("format") != FORMAT:
        raise SnapshotFileError("format")
    if envelope.get("region") != region:
        raise SnapshotFileError("region")
    data = envelope.get("snapshot")
    if not isinstance(data, dict):
        raise SnapshotFileError("malformed")
    snapshot = snapshot_from_dict(data)
    if snapshot.region != region:
        raise SnapshotFileError("region")
    written_at = envelope.get("written_at")
    if not isinstance(written_at, int | float):
        raise SnapshotFileError("malformed")
    return snapshot, float(written_at)

"""The gateway's copy of the control plane: the last snapshot, refreshed in the background.

Public surface: ``SnapshotHolder``, ``SnapshotFile``.

The hot path reads ``SnapshotHolder.current`` and never the database. A refresh that
fails (the database is down) keeps the last snapshot and marks the control plane
unreachable; a gateway that started with the database down has no snapshot, says
so in ``/healthz`` and its metrics, and serves from the first refresh that works.

With a ``SnapshotFile``, the holder keeps its last snapshot on local disk (at most
every ``persist_s``, always at the first load) and a gateway whose first refresh
fails serves from that file instead (``source`` "disk") until the database answers.
The file is written mode 600 and replaced atomically, so the gateway processes of
a region may share it; one that fails verification, is another region's or is
readable by others is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from metering import metrics
from routing.domain.snapshot import ConfigSnapshot
from routing.domain.snapshot_file import SnapshotFileError, decode_file, encode_file
from routing.prompt_tokens import VersionCounters

logger = logging.getLogger(__name__)

__all__ = ["SnapshotFile", "SnapshotHolder"]


class SnapshotFile:
    """The region's last snapshot on local disk (blocking I/O: call it in a thread).

    ``write`` creates a temporary file beside the target with mode 600, fsyncs it
    and renames it over the target (the directory is created mode 700). ``read``
    refuses a file that is not a regular file owned by this user and closed to
    group and others, and one whose digest, format or region does not verify.
    """

    def __init__(self, path: Path, *, key: bytes, region: str) -> None:
        self.path = path
        self._key = key
        self.region = region

    def write(self, snapshot: ConfigSnapshot, *, written_at: float) -> None:
        data = encode_file(snapshot, key=self._key, written_at=written_at)
        directory = self.path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = directory / f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, self.path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def read(self) -> tuple[ConfigSnapshot, float]:
        """Return (snapshot, written_at); raise ``SnapshotFileError`` (reason
        ``missing``, ``mode`` or the decoder's) when it must not be served."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise SnapshotFileError("missing") from None
        except OSError:
            raise SnapshotFileError("unreadable") from None
        with os.fdopen(fd, "rb") as source:
            info = os.fstat(source.fileno())
            if (
                not stat.S_ISREG(info.st_mode)
                or info.st_uid != os.geteuid()
                or stat.S_IMODE(info.st_mode) & 0o077
            ):
                raise SnapshotFileError("mode")
            try:
                raw = source.read()
            except OSError:
                raise SnapshotFileError("unreadable") from None
        return decode_file(raw, key=self._key, region=self.region)


class SnapshotHolder:
    """The last snapshot that loaded, when it loaded, and whether the last try did.

    ``refresh`` is the only writer. ``prompt_counters`` starts loading each new
    version's tokenizer as soon as a snapshot names it.
    """

    def __init__(
        self,
        load: Callable[[], Awaitable[ConfigSnapshot]],
        *,
        prompt_counters: VersionCounters,
        clock: Callable[[], float] = time.monotonic,
        file: SnapshotFile | None = None,
        persist_s: float = 10.0,
        wall_clock: Callable[[], float] = time.time,
        max_file_age_s: float = 86_400.0,
        answer_within_s: float = 3.0,
    ) -> None:
        self._load = load
        # A refresh still waiting after this long counts as the control plane down
        # (a blackholed database answers nothing, for up to the TCP timeout).
        self.answer_within_s = answer_within_s
        self._refresh_started_at: float | None = None
        self.prompt_counters = prompt_counters
        self._clock = clock
        self._wall_clock = wall_clock
        self.file = file
        self.persist_s = persist_s
        self.current: ConfigSnapshot | None = None
        self.loaded_at = 0.0  # clock time of the last successful refresh
        self._answered = False  # the last refresh that ended succeeded
        # Where ``current`` came from: "database", "disk", or None without one.
        self.source: str | None = None
        self._has_failed = False  # warn once per outage, not on every refresh
        self._persisted_at: float | None = None  # clock time of the last write
        self.max_file_age_s = max_file_age_s
        # The file is read while no snapshot is held, until it is served or refused
        # for good (not this region's, edited, too old); a file being replaced or
        # unreadable for a moment is read again at the next refresh.
        self._file_refused = False
        self._refusals_seen: set[str] = set()  # warn once per reason

    @property
    def control_plane_up(self) -> bool:
        """True if the last refresh succeeded and none has waited too long since.

        A refresh in flight for more than ``answer_within_s`` means the database is
        not answering: the snapshot is stale by design then (degraded, still
        ready), not a stuck refresh loop.
        """
        started = self._refresh_started_at
        if started is not None and self._clock() - started > self.answer_within_s:
            return False
        return self._answered

    def age_s(self) -> float | None:
        """Seconds since the last successful refresh, None if none ever succeeded."""
        if self.current is None:
            return None
        return self._clock() - self.loaded_at

    async def refresh(self) -> None:
        """Swap in a fresh snapshot; on failure keep serving the last one."""
        self._refresh_started_at = self._clock()
        try:
            snapshot = await self._load()
        except Exception as exc:
            if self._answered or not self._has_failed:
                logger.warning(
                    "control plane unreachable, serving the last snapshot: %s",
                    type(exc).__name__,
                )
            self._answered = False
            self._has_failed = True
            if (
                self.current is None
                and self.file is not None
                and not self._file_refused
            ):
                await self._load_file(self.file)
            metrics.set_control_plane(up=False, snapshot_age_s=self.age_s())
            return
        finally:
            self._refresh_started_at = None
        self.current = snapshot
        self.loaded_at = self._clock()
        self.source = "database"
        metrics.set_snapshot_from_disk(from_disk=False)
        self.prompt_counters.prepare(snapshot.versions.values())
        if not self._answered:
            logger.info(
                "control plane snapshot loaded (%d models, %d replicas)",
                len(snapshot.models),
                len(snapshot.replicas),
            )
        self._answered = True
        self._has_failed = False
        metrics.set_control_plane(up=True, snapshot_age_s=0.0)
        await self._persist(snapshot)

    async def _persist(self, snapshot: ConfigSnapshot) -> None:
        """Write the snapshot to the file at the first load, then at most every
        ``persist_s``; a failed write is logged and retried at the next refresh."""
        if self.file is None:
            return
        now = self._clock()
        if self._persisted_at is not None and now - self._persisted_at < self.persist_s:
            return
        try:
            await asyncio.to_thread(
                self.file.write, snapshot, written_at=self._wall_clock()
            )
        except (OSError, ValueError) as exc:
            logger.warning("could not write the snapshot file: %s", type(exc).__name__)
            return
        self._persisted_at = now

    async def _load_file(self, file: SnapshotFile) -> None:
        """Serve from the file, when it verifies: the age counts from when the
        snapshot was built (wall clock), not from now."""
        try:
            snapshot, _written_at = await asyncio.to_thread(file.read)
        except SnapshotFileError as exc:
            self._refuse(exc.reason)
            return
        age = max(0.0, self._wall_clock() - snapshot.built_at)
        if age > self.max_file_age_s:
            self._refuse("too_old")
            return
        self.current = snapshot
        self.loaded_at = self._clock() - age
        self.source = "disk"
        metrics.set_snapshot_from_disk(from_disk=True)
        self.prompt_counters.prepare(snapshot.versions.values())
        logger.warning(
            "serving the snapshot file, %.0f s old (%d models, %d replicas)",
            age,
            len(snapshot.models),
            len(snapshot.replicas),
        )

    def _refuse(self, reason: str) -> None:
        """Count a refused file (warning once per reason); refuse it for good
        unless it may read well soon (missing, malformed or unreadable now)."""
        if reason in ("digest", "format", "region", "mode", "too_old"):
            self._file_refused = True
        if reason == "missing":
            return
        metrics.count_snapshot_file_refused(reason)
        if reason not in self._refusals_seen:
            self._refusals_seen.add(reason)
            logger.warning("snapshot file refused (%s)", reason)

"""The warm pool: a node pulls the weights of its region's versions before it needs them.

Public surface: ``WarmPool``, ``WeightsRef``, ``Readiness``.

A cold start costs the seed's four steps (node 4 min, weights 28 s, load 14 s,
warm-up 30 s); on a node that already holds a version's verified weights it costs
the last two. So every beat the agent hands its ``WarmPool`` the versions of its
region's pools (``hold``), and one background thread pulls and verifies
(``engine_nodes.weights.pull_weights``) those not yet on local disk, one at a
time (a node's disk and network are shared: one pull at full speed serves the
first start sooner than several interleaved). Nothing here runs in the beat loop,
and nothing here touches the database: the agent asks ``readiness`` before a
start (a replica whose weights are still being pulled waits, ``starting``, and
the agent vouches for it) and writes ``warm_version_ids`` into its node's row.

A version is warm once its tree verified against its hash in the cache (a tree
left there by an earlier agent verifies again first). The pool then keeps the
tree's stat fingerprint (``weights.tree_stat``), and a start trusts the verified
tree while the fingerprint holds instead of reading every byte again; a tree that
changed since is verified (and if need be pulled) again before the start.

A pull that fails (a hash mismatch, a URI outside the storage roots, no driver
for its scheme) is not tried again for ``retry_after_s``; meanwhile ``readiness``
answers FAILED, and the agent refuses that version's replicas on this node.

The agent pulls from its region's copy of the weights (``agent.weights_ref``:
the version's ready ``VersionRegion`` row). A version whose region copy is not
ready (copying, failed, or missing while other regions have one) comes with a
``refusal``: FAILED with that reason, nothing pulled, not counted warm, and asked
afresh at each beat, so it is startable the beat after its copy turns ready.

Simulated replicas load nothing, so ``kind="sim"`` pulls only ``file://`` weights
(a mismatch must stop them all the same, as it would a real engine); other
versions are ready at once and never counted warm.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine_nodes.weights import WeightsError, pull_weights, tree_stat

logger = logging.getLogger(__name__)

__all__ = ["Readiness", "WarmPool", "WeightsRef"]


@dataclass(frozen=True, slots=True)
class WeightsRef:
    """A version's weights: where they live and the hash they must have.

    ``refusal`` says why the version may not start on this node at all (its
    region's copy of the weights failed, or is not there yet); the pool then pulls
    nothing and answers FAILED with it, at every ask, until a ref without one comes.
    """

    version_id: int
    weights_uri: str
    weights_hash: str
    refusal: str = ""


class Readiness(enum.StrEnum):
    """Whether a replica of a version can start on this node now."""

    READY = "ready"  # verified on local disk, or none needed
    PULLING = "pulling"  # a pull is queued or running
    # The last pull failed (not tried again until retry_after_s), or the ref is
    # refused (its region's copy is not ready).
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class _Warm:
    path: Path
    fingerprint: tuple[tuple[str, int, int], ...]


class WarmPool:
    """Pull and verify weights ahead of need, in a thread of its own.

    Thread-safe: the agent's beat loop calls ``hold``, ``readiness`` and
    ``warm_version_ids``; the pull thread records what it found under the lock.
    """

    def __init__(
        self,
        *,
        kind: Literal["sim", "vllm"],
        cache_dir: Path,
        storage_roots: Sequence[str],
        retry_after_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kind = kind
        self.cache_dir = Path(cache_dir)
        self.storage_roots = list(storage_roots)
        self.retry_after_s = retry_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._warm: dict[str, _Warm] = {}  # by weights_hash
        self._pulling: dict[str, Future[None]] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # hash -> (at, why)
        self._versions: dict[str, set[int]] = {}  # hash -> version ids seen
        self._pulls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")

    def needs_weights(self, weights_uri: str) -> bool:
        """Return True when a replica of this kind needs the weights on disk."""
        return self.kind == "vllm" or weights_uri.startswith("file://")

    def hold(self, refs: Iterable[WeightsRef]) -> frozenset[int]:
        """Keep these versions' weights on local disk: queue pulls for the missing.

        Returns at once, with the ids of the versions whose last pull failed
        (within ``retry_after_s``) or whose ref is refused: the node should start
        none of them. A warm tree whose directory vanished is pulled again.
        """
        return frozenset(
            ref.version_id for ref in refs if self._ensure(ref)[0] == Readiness.FAILED
        )

    def readiness(self, ref: WeightsRef) -> tuple[Readiness, str]:
        """Return whether ``ref``'s replica can start now, and why not if it failed.

        Queues a pull when the weights are missing (returns PULLING). A ref with
        a ``refusal`` is FAILED with it, and pulls nothing.
        """
        return self._ensure(ref)

    def local_dir(self, ref: WeightsRef) -> Path | None:
        """Return the verified weights directory a start uses; None if none needed.

        A warm tree whose fingerprint still holds is used as it is. Otherwise the
        weights are verified (and pulled if need be) now, in the caller's thread:
        the agent asks only once ``readiness`` said READY, so that is rare.

        Raises:
            WeightsError: as ``pull_weights`` (a mismatch, a refused URI ...), or
                the ref's ``refusal``.
        """
        if ref.refusal:
            raise WeightsError(ref.refusal)
        if not self.needs_weights(ref.weights_uri):
            return None
        with self._lock:
            warm = self._warm.get(ref.weights_hash)
        if warm is not None:
            try:
                if tree_stat(warm.path) == warm.fingerprint:
                    return warm.path
            except (OSError, WeightsError):
                pass  # a file vanished or turned odd: verify below
            logger.warning("warm weights %s changed on disk; verifying", warm.path)
        self._pull(ref)
        with self._lock:
            return self._warm[ref.weights_hash].path

    def warm_version_ids(self) -> frozenset[int]:
        """Return the versions whose verified weights this node holds."""
        with self._lock:
            return frozenset(
                version_id
                for weights_hash in self._warm
                for version_id in self._versions.get(weights_hash, ())
            )

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for queued pulls to end; True if none is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = list(self._pulling.values())
            if not pending:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                pending[0].exception(timeout=remaining)
            except TimeoutError:
                return False

    def close(self) -> None:
        """Cancel queued pulls; a pull under way finishes in its thread."""
        self._pulls.shutdown(wait=False, cancel_futures=True)

    # -- internals ---------------------------------------------------------------------

    def _ensure(self, ref: WeightsRef) -> tuple[Readiness, str]:
        key = ref.weights_hash
        if ref.refusal:
            # Not startable here, whatever the cache holds (a sim loads nothing,
            # but a bad copy must stop it as it would a real engine); and not warm.
            with self._lock:
                self._versions.get(key, set()).discard(ref.version_id)
            return Readiness.FAILED, ref.refusal
        if not self.needs_weights(ref.weights_uri):
            return Readiness.READY, ""
        with self._lock:
            self._versions.setdefault(key, set()).add(ref.version_id)
            warm = self._warm.get(key)
            if warm is not None:
                if warm.path.is_dir():
                    return Readiness.READY, ""
                del self._warm[key]  # deleted under us: pull it again
            if key in self._pulling:
                return Readiness.PULLING, ""
            failed = self._failed.get(key)
            if failed is not None:
                if self.clock() - failed[0] < self.retry_after_s:
                    return Readiness.FAILED, failed[1]
                del self._failed[key]
            try:
                future = self._pulls.submit(self._pull_quietly, ref)
            except RuntimeError:  # closed: the agent is shutting down
                return Readiness.PULLING, ""
            self._pulling[key] = future
        return Readiness.PULLING, ""

    def _pull_quietly(self, ref: WeightsRef) -> None:
        try:
            self._pull(ref)
        except Exception as exc:
            # Recorded for readiness(); the agent logs it against the replica.
            logger.warning("prefetching weights %s failed: %s", ref.weights_uri, exc)
        finally:
            with self._lock:
                self._pulling.pop(ref.weights_hash, None)

    def _pull(self, ref: WeightsRef) -> None:
        started = time.monotonic()
        try:
            path = pull_weights(
                ref.weights_uri,
                ref.weights_hash,
                cache_dir=self.cache_dir,
                storage_roots=self.storage_roots,
            )
            fingerprint = tree_stat(path)
        except Exception as exc:
            with self._lock:
                self._failed[ref.weights_hash] = (self.clock(), str(exc))
                self._warm.pop(ref.weights_hash, None)
            raise
        with self._lock:
            self._warm[ref.weights_hash] = _Warm(path, fingerprint)
            self._failed.pop(ref.weights_hash, None)
            self._versions.setdefault(ref.weights_hash, set()).add(ref.version_id)
        logger.info(
            "weights %s warm in %s (%.1f s)",
            ref.weights_uri,
            path,
            time.monotonic() - started,
        )

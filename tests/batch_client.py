"""What the end-to-end Batch API tests share: the Celery processes the batch runner
needs, and the ``openai`` SDK's upload, poll and download.

``start_celery`` starts one Celery worker of the platform (``-B -Q celery``: beat,
which dispatches batches and flushes usage; ``-Q batches``: the runner), with its
beat schedule under ``tmp`` and its log beside it; its broker is the platform's
Redis under the platform's prefix, so it takes no other run's tasks. The caller
stops it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.processes import Process, spawn, wait_until

if TYPE_CHECKING:
    import openai

__all__ = ["content", "start_celery", "upload", "wait_batch"]


def start_celery(
    env: Mapping[str, str],
    tmp: Path,
    name: str,
    args: Sequence[str],
    *,
    concurrency: int = 2,
) -> Process:
    """Start ``celery -A config worker`` with ``args`` (its queues, ``-B``) as
    ``name@host``; its log is ``tmp/name-<ns>.log``."""
    argv = [sys.executable, "-m", "celery", "-A", "config", "worker", *args]
    argv += ["--concurrency", str(concurrency), "--loglevel", "INFO"]
    argv += ["-n", f"{name}@%h", "--schedule", str(tmp / f"{name}-schedule")]
    return spawn(argv, dict(env), tmp / f"{name}-{time.monotonic_ns()}.log", "")


def upload(client: openai.OpenAI, tmp: Path, rows: Sequence[Any]) -> str:
    """Upload ``rows`` (JSON values, or lines as they are) as a batch input file;
    return its id."""
    path = tmp / f"input-{time.monotonic_ns()}.jsonl"
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    )
    with path.open("rb") as handle:
        return client.files.create(file=handle, purpose="batch").id


def wait_batch(
    client: openai.OpenAI,
    batch_id: str,
    until: Callable[[Any], bool],
    *,
    timeout_s: float = 90,
) -> Any:
    """Poll the batch until ``until(batch)``; return it.

    Raises:
        AssertionError: not in ``timeout_s``; the message has the batch as last seen.
    """
    found: list[Any] = []

    def check() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return bool(until(found[0]))

    try:
        wait_until(check, timeout_s=timeout_s, interval_s=0.2, message=batch_id)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}; last seen: {found[0] if found else None}"
        ) from None
    return found[0]


def content(client: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    """Return a JSONL file's records (an output or error file)."""
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]

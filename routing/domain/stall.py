"""Which replicas have stalled, as one gateway process sees them.

Public surface: ``ReplicaStalled``, ``WaitingStream``, ``stalled_replicas``.

A hung engine (a GPU stuck in a kernel) keeps answering ``/health`` and
``/metrics``; the node agent marks it ``stalled`` once its figures stay flat for
``PLATFORM_STALL_AFTER_S`` (10 s), and until then every request routed to it waits
for the first-token deadline (30 s) before it is tried elsewhere. The gateway sees
the stall sooner, by its own clock on the streams it holds: a replica that holds at
least one of this process's requests waiting for its first token, and has sent
none of this process's streams a byte of answer for ``after_s``, is stalled. A
replica that streams to anyone here is not, however long a prefill waits behind
those streams: a loaded engine is slow, a stalled one is silent.

A request whose answer comes whole (embeddings: one JSON body, no stream) is
never waiting by this rule. Its silence is the engine computing it, however many
seconds a large batch takes, and a saturated pooling engine may finish nothing
for longer than ``after_s``; only the first-token deadline times it. Its answer,
when it comes, still counts as the replica's sign of life.

The clock starts at the later of the oldest waiting request's sending and the
replica's last byte of answer, so a request sent to a replica long silent does not
restart it, and a stream that moves does.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["ReplicaStalled", "WaitingStream", "stalled_replicas"]


class ReplicaStalled(TimeoutError):
    """A request's replica held it and sent no answer for the stall rule's time."""


@dataclass(frozen=True, slots=True)
class WaitingStream:
    """One request of this process at a replica, as the stall rule reads it.

    ``sent_at``: when it was sent; ``answered_at``: when its replica last sent it a
    byte of answer (None: never); ``has_first_token``: its answer has begun;
    ``answers_whole``: its answer comes whole, not streamed (never waiting here).
    """

    replica: Hashable
    sent_at: float
    answered_at: float | None
    has_first_token: bool
    answers_whole: bool = False


def stalled_replicas(
    streams: Iterable[WaitingStream], *, now: float, after_s: float
) -> dict[Hashable, float]:
    """Return the stalled replicas, each with how long it has been silent.

    Raises:
        ValueError: ``after_s`` is not positive.
    """
    if not after_s > 0:
        raise ValueError("after_s must be a positive number of seconds")
    oldest_wait: dict[Hashable, float] = {}
    last_answer: dict[Hashable, float] = {}
    for stream in streams:
        if stream.answered_at is not None:
            last_answer[stream.replica] = max(
                last_answer.get(stream.replica, stream.answered_at), stream.answered_at
            )
        if not stream.has_first_token and not stream.answers_whole:
            oldest_wait[stream.replica] = min(
                oldest_wait.get(stream.replica, stream.sent_at), stream.sent_at
            )
    stalled = {}
    for replica, waiting_since in oldest_wait.items():
        silent_since = max(waiting_since, last_answer.get(replica, waiting_since))
        if now - silent_since >= after_s:
            stalled[replica] = now - silent_since
    return stalled

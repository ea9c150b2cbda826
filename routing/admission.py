"""The admission seam of the gateway: what runs between parsing a request and routing it.

Public surface: ``AdmissionRequest``, ``Ticket``, ``Admission``, ``OpenAdmission``,
``Rejected``.

Every admitted request holds a ``Ticket`` until its answer ends; ``release`` is
called exactly once with the tokens actually used (on success, errors, client
disconnects and retries alike), so whatever admission charged can be refunded.
Token buckets, concurrency caps and tiered queues plug in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from routing.domain.snapshot import LimitRecord
from routing.domain.tiers import Tier


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What admission knows of a request before it is routed."""

    team: str
    model: str
    version: str
    tier: Tier
    prompt_tokens: int
    max_tokens: int
    limit: LimitRecord | None = None

    @property
    def charge_tokens(self) -> int:
        """The tokens charged up front: prompt plus the most the answer may use."""
        return self.prompt_tokens + self.max_tokens


class Rejected(Exception):
    """Admission refused the request: 429 (over a team limit) or 503 (shed)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after_s: float,
        code: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.code = code
        self.headers = headers or {}


class Ticket(Protocol):
    """An admitted request's claim on limits and capacity."""

    headers: dict[str, str]

    async def release(self, *, used_tokens: int) -> None: ...


class Admission(Protocol):
    """Decides whether (and when) a request may go to a replica."""

    async def admit(self, request: AdmissionRequest) -> Ticket: ...


@dataclass(slots=True)
class _OpenTicket:
    headers: dict[str, str]

    async def release(self, *, used_tokens: int) -> None:
        return None


class OpenAdmission:
    """Admit everything (no limits): the seam before token buckets and tiers."""

    async def admit(self, request: AdmissionRequest) -> Ticket:
        return _OpenTicket(headers={})

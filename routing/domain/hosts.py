"""Which ``Host`` headers the gateway serves: Django's ``ALLOWED_HOSTS`` rules.

Public surface: ``HostPolicy``.

The console and the control plane are Django views, and Django refuses a request
whose host is not in ``ALLOWED_HOSTS`` (a forged ``Host`` poisons links and caches
and is how DNS rebinding reaches a server on loopback). ``/v1`` is not Django's, so
the gateway applies the same rules itself, held equal to Django's
``split_domain_port`` and ``validate_host`` by ``routing/tests/unit/test_hosts.py``:
the host is lowercased, its port and one trailing dot dropped, and it must look like
a domain or a bracketed IPv6 address; then ``*`` allows any, ``.example.com``
allows ``example.com`` and its subdomains, anything else must match exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["HostPolicy"]

# Django's host_validation_re (django/http/request.py), matched whole.
_HOST = re.compile(r"([a-z0-9.-]+|\[[a-f0-9]*:[a-f0-9.:]+\])(?::([0-9]+))?")


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """``ALLOWED_HOSTS`` split once into what a lookup needs.

    ``exact`` holds the plain names, ``domains`` the ``.example.com`` patterns
    (with their dot), ``is_any`` is set by ``*``.
    """

    exact: frozenset[str] = frozenset()
    domains: tuple[str, ...] = ()
    is_any: bool = False

    @classmethod
    def from_patterns(cls, patterns: Iterable[str]) -> HostPolicy:
        """Return the policy of an ``ALLOWED_HOSTS`` list (empty patterns match nothing)."""
        lowered = [pattern.lower() for pattern in patterns if pattern]
        return cls(
            exact=frozenset(p for p in lowered if not p.startswith(".")),
            domains=tuple(p for p in lowered if p.startswith(".")),
            is_any="*" in lowered,
        )

    def allows(self, host: str) -> bool:
        """Return True if a request for ``host`` (a ``Host`` header) may be served."""
        match = _HOST.fullmatch(host.lower())
        if match is None:
            return False
        domain = match.group(1).removesuffix(".")
        if not domain:
            return False
        if self.is_any or domain in self.exact:
            return True
        return any(
            domain.endswith(pattern) or domain == pattern[1:]
            for pattern in self.domains
        )

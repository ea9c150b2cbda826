"""Network namespaces for the fault suite: a server behind a veth pair we can cut.

Public surface: ``Netns``, ``netns_unavailable``, ``remove_stale``.

A ``Netns`` is a network namespace joined to the root one by a veth pair on a
/30 subnet of its own; a server started under ``Netns.exec_argv`` listens on
``Netns.ip`` and the platform's processes, in the root namespace, reach it
through the pair. Faults are queueing disciplines on both ends of the pair
(``tc qdisc``): ``blackhole`` drops every packet (the ``blackhole`` qdisc: a
partition, where a connection attempt hangs and an open connection stops
answering), ``slow`` delays each one (``netem delay``, or where the kernel has
no netem, as on the CI machines' Firecracker kernel, a 64 kbit/s ``tbf``), ``heal``
takes the discipline away. A refused server is the server
stopped: the namespace's kernel answers its port with a reset.

Names carry this process's id (``flt<pid>x<n>``), so parallel runs never
collide, and ``remove_stale`` deletes those of processes that are gone (a run
killed before its teardown).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
from pathlib import Path
from types import TracebackType

__all__ = ["Netns", "netns_unavailable", "remove_stale"]

_PREFIX = "flt"
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, check=False, timeout=30
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _tc(*args: str, netns: str | None = None, check: bool = True) -> None:
    argv = ["tc", *args]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    result = subprocess.run(
        argv, capture_output=True, text=True, check=False, timeout=30
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")


def netns_unavailable() -> str | None:
    """Return why network namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if not any(
            os.access(Path(d) / tool, os.X_OK)
            for d in os.environ.get("PATH", "").split(os.pathsep)
        ):
            return f"{tool} (iproute2) is not installed"
    name = f"{_PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", name)
    except RuntimeError as exc:
        return f"cannot add a network namespace: {exc}"
    _ip("netns", "del", name, check=False)
    return None


def remove_stale() -> list[str]:
    """Delete the namespaces (and their veth pairs) of fault runs that are gone."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{_PREFIX}(\d+)(?:x\d+|probe)", name)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        _ip("link", "del", f"{name}h", check=False)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


class Netns:
    """A network namespace joined to the root one by a veth pair (a context manager).

    ``ip`` is the namespace's end (where its servers listen), ``host_ip`` the root
    namespace's end. ``__exit__`` deletes the pair and the namespace, whatever
    happened meanwhile.
    """

    def __init__(self) -> None:
        pid, n = os.getpid(), next(_counter)
        self.name = f"{_PREFIX}{pid}x{n}"
        self.host_if = f"{self.name}h"[-15:]
        self.ns_if = f"{self.name}n"[-15:]
        # A /30 of its own in 10.64.0.0/10, from the process id and a counter.
        block = (pid * 8 + n) % (1 << 20)
        base = (10 << 24) | (64 << 16) | (block << 2)
        self.host_ip = _dotted(base + 1)
        self.ip = _dotted(base + 2)
        self.fault = "none"  # the last fault applied (heal leaves it, for reports)

    def __enter__(self) -> Netns:
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            inside = ("netns", "exec", self.name, "ip")
            _ip(*inside, "addr", "add", f"{self.ip}/30", "dev", self.ns_if)
            _ip(*inside, "link", "set", self.ns_if, "up")
            _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._remove()

    def exec_argv(self, argv: list[str]) -> list[str]:
        """Return ``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def blackhole(self) -> None:
        """Drop every packet both ways: connections hang rather than fail."""
        # The blackhole qdisc is always built in; netem (loss 100%) may not be.
        self._qdisc("blackhole")
        self.fault = "blackhole"

    def slow(self, delay_ms: int) -> None:
        """Delay every packet by ``delay_ms`` each way (netem); where the kernel
        has no netem, slow the link to 64 kbit/s instead (tbf), so that a query
        of a few kilobytes takes about as long."""
        try:
            self._qdisc("netem", "delay", f"{delay_ms}ms")
            self.fault = f"netem delay {delay_ms} ms each way"
        except RuntimeError as exc:
            if "unknown" not in str(exc):
                raise
            self._qdisc("tbf", "rate", "64kbit", "burst", "1600", "latency", "10s")
            self.fault = "tbf 64 kbit/s each way (no netem in this kernel)"

    def heal(self) -> None:
        """Take the fault away (nothing if there is none)."""
        _tc("qdisc", "del", "dev", self.host_if, "root", check=False)
        _tc("qdisc", "del", "dev", self.ns_if, "root", netns=self.name, check=False)

    def _qdisc(self, *spec: str) -> None:
        _tc("qdisc", "replace", "dev", self.host_if, "root", *spec)
        _tc("qdisc", "replace", "dev", self.ns_if, "root", *spec, netns=self.name)

    def _remove(self) -> None:
        # Deleting one end of a veth pair deletes both (and their qdiscs).
        _ip("link", "del", self.host_if, check=False)
        _ip("netns", "del", self.name, check=False)


def _dotted(value: int) -> str:
    return ".".join(str((value >> shift) & 0xFF) for shift in (24, 16, 8, 0))

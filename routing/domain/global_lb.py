"""The global load balancer's configuration (HAProxy), rendered from the regions.

Public surface: ``Region``, ``HealthCheck``, ``ServerHealth``, ``render_haproxy``.

One frontend per region: a client reaches the frontend of its nearest region (in
production a GeoDNS name per region points there; here each has its own port). Its
backend lists that region's gateway first and every other region as a ``backup``,
so traffic stays home while home is healthy and moves only when it is not:

- HAProxy asks every region's ``GET /healthz`` each ``inter_s``; ``fall``
  failures in a row (a 503 saying the region cannot serve, or no answer) take it
  out, ``rise`` successes bring it back. A lost region is out within
  ``inter_s * fall`` (the health-check window), after which its clients go to the
  first backup;
- a request whose connection to a region fails (the gateway is gone) marks that
  region down at once (``observe layer4`` with ``on-error mark-down``: the checks
  bring it back after ``rise`` successes) and is sent again to the next region
  (``retry-on conn-failure``, ``option redispatch 1``): a request
  that never reached a gateway is safe to resend, even a POST, so clients see a
  region's loss only in the streams it was carrying;
- when no region passes its checks (a cause they share, such as their Redis), a
  frontend sends its clients to an unchecked ``last_resort`` backend, home first:
  a region that cannot serve well may still serve, which beats refusing everyone;
- Server-Sent Events pass through as they come: HAProxy forwards response data
  without buffering it whole, no compression is set, and the timeouts are long
  enough for a reasoning model's minutes-long stream.

The output is deterministic (the same regions give the same text), so the copy in
``platform/haproxy/`` is checked against a fresh rendering. ``HealthCheck.observe``
and ``HealthCheck.connection_failed`` state the same rules as code (a server's
state after each check), so the failover simulation
(``drills.domain.failover_drill``) judges a lost region by the rendered rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HealthCheck", "Region", "ServerHealth", "render_haproxy"]


@dataclass(frozen=True, slots=True)
class Region:
    """A region: its name, its gateway's address, and where its clients connect."""

    name: str
    gateway: str  # host:port of the region's gateway (or its local balancer)
    listen: str  # host:port of the region's frontend, what its clients dial


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """How HAProxy judges a region (HAProxy's ``inter``, ``fall``, ``rise``)."""

    inter_s: float = 2.0
    fall: int = 2
    rise: int = 2

    @property
    def window_s(self) -> float:
        """How long a lost region keeps its clients: ``inter_s * fall`` when its
        connections are refused or its /healthz says 503; a region that hangs holds
        each check up to ``timeout check`` (2 s) longer."""
        return self.inter_s * self.fall

    def observe(self, health: ServerHealth, *, is_passed: bool) -> ServerHealth:
        """Return a server's state after one check (``default-server ... fall rise``).

        Up, ``fall`` failed checks in a row take it down; down, ``rise`` passed
        checks in a row bring it back; a check that agrees with the state resets
        the count.
        """
        if is_passed == health.is_up:
            return ServerHealth(is_up=health.is_up)
        streak = health.streak + 1
        if streak >= (self.fall if health.is_up else self.rise):
            return ServerHealth(is_up=not health.is_up)
        return ServerHealth(is_up=health.is_up, streak=streak)

    def connection_failed(self, health: ServerHealth) -> ServerHealth:
        """Return a server's state after a request's connection to it failed:
        down at once (``observe layer4 error-limit 1 on-error mark-down``)."""
        return ServerHealth(is_up=False) if health.is_up else health


@dataclass(frozen=True, slots=True)
class ServerHealth:
    """A server as HAProxy's checks see it: up or down, and how many checks in a
    row have said otherwise."""

    is_up: bool = True
    streak: int = 0


def _ms(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def render_haproxy(
    regions: Sequence[Region],
    *,
    check: HealthCheck = HealthCheck(),
    stats_socket: str = "",
    stream_timeout_s: float = 600.0,
) -> str:
    """Return haproxy.cfg for ``regions`` (at least one; names unique).

    ``stats_socket`` is a path for HAProxy's admin socket (mode 600), where drills
    read the servers' state; empty leaves it out.
    """
    if not regions:
        raise ValueError("at least one region")
    names = [region.name for region in regions]
    if len(set(names)) != len(names):
        raise ValueError(f"region names must be unique: {names}")
    if check.inter_s <= 0 or check.fall < 1 or check.rise < 1:
        raise ValueError("the health check needs inter > 0, fall >= 1, rise >= 1")
    lines = [
        "# Rendered by `manage.py render_haproxy`: edit the regions, not this file.",
        "global",
        # 1,000 streams hold two connections each (client, gateway); 8,000 keeps
        # HAProxy's file descriptors under a common 20,000 limit.
        "    maxconn 8000",
        # One line per request (method, path, status, timings: never a body).
        "    log stdout format raw local0 info",
    ]
    if stats_socket:
        lines.append(f"    stats socket {stats_socket} mode 600 level admin")
    lines += [
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    timeout connect 2s",
        # A stream sends its first byte within the gateway's first-token timeout
        # and tokens after; a long reasoning answer runs for minutes.
        f"    timeout client {_ms(stream_timeout_s)}",
        f"    timeout server {_ms(stream_timeout_s)}",
        "    timeout http-request 30s",
        "    timeout http-keep-alive 30s",
        "    timeout check 2s",
        "    # A request that never reached a gateway goes to the next server.",
        "    retries 2",
        # Only a request that never reached a gateway: an empty response may come
        # from one that did the work (a chat run twice, metered twice).
        "    retry-on conn-failure",
        "    option redispatch 1",
        "    option http-no-delay",
        "",
    ]
    for home in regions:
        backend = f"via_{home.name}"
        lines += [
            f"frontend {home.name}",
            f"    bind {home.listen}",
            # The gateway names the region in each answer's final event; the
            # frontend that took the request is named here.
            f"    http-response set-header x-platform-entry-region {home.name}",
            # Every region judged unable to serve (all their Redis down, say):
            # try anyway, home first, rather than refuse everyone.
            f"    use_backend last_resort_{home.name} if {{ nbsrv({backend}) eq 0 }}",
            f"    default_backend {backend}",
            "",
            f"backend {backend}",
            "    option httpchk",
            "    http-check send meth GET uri /healthz",
            "    http-check expect status 200",
            (
                f"    default-server inter {_ms(check.inter_s)} "
                f"fall {check.fall} rise {check.rise}"
                # A refused connection takes the server out at once (the checks
                # bring it back), so the retry goes to the next region.
                " observe layer4 error-limit 1 on-error mark-down"
            ),
            f"    server {home.name} {home.gateway} check",
        ]
        lines += [
            f"    server {other.name} {other.gateway} check backup"
            for other in regions
            if other.name != home.name
        ]
        lines += [
            "",
            f"backend last_resort_{home.name}",
            f"    server {home.name} {home.gateway}",
        ]
        lines += [
            f"    server {other.name} {other.gateway} backup"
            for other in regions
            if other.name != home.name
        ]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"

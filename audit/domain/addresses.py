"""The address a request came from, seen through the proxies we trust.

Public surface: ``client_address``, ``parse_networks``.

A proxy appends the address it got the request from to ``X-Forwarded-For``, so
the list reads client first, nearest hop last; anyone may send the header, so
only the hops our own proxies added are believed. Walking right to left from
the connection's peer, each trusted hop vouches for the one before it; the
first address that is not one of our proxies is the client's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import TypeAlias

__all__ = ["Network", "client_address", "parse_networks"]

Network: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network
Address: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """Return the networks of ``cidrs`` (a bare address is one host).

    Raises:
        ValueError: one is not an IPv4 or IPv6 network.
    """
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def _address(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text.strip())
    except ValueError:
        return None


def _is_trusted(address: Address, trusted: Sequence[Network]) -> bool:
    return any(address in network for network in trusted)


def client_address(
    remote_addr: str, forwarded_for: str, trusted: Sequence[Network]
) -> str | None:
    """Return the client's address: the peer's (``remote_addr``), unless the peer
    is a trusted proxy; then the nearest hop of ``forwarded_for`` that is not one.

    A hop that is not an address ends the walk at the last one believed (what
    lies to its left cannot be told from a forgery); so does a list of trusted
    hops only, whose leftmost is the client. None when there is no peer address.
    """
    peer = _address(remote_addr)
    if peer is None:
        return remote_addr.strip() or None
    if not _is_trusted(peer, trusted):
        return str(peer)
    believed = peer
    for hop in reversed(forwarded_for.split(",")):
        address = _address(hop)
        if address is None:
            break
        believed = address
        if not _is_trusted(address, trusted):
            break
    return str(believed)

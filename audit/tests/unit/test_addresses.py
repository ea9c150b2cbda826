"""The client's address: the peer's, or what our trusted proxies forwarded."""

from __future__ import annotations

import pytest

from audit.domain.addresses import client_address, parse_networks

PROXIES = parse_networks(["10.0.0.0/8", "2001:db8::/32"])


def test_client_address_is_the_peer_without_trusted_proxies() -> None:
    assert client_address("198.51.100.4", "203.0.113.7", ()) == "198.51.100.4"


def test_client_address_ignores_a_header_an_untrusted_peer_sent() -> None:
    spoofed = "203.0.113.7, 10.0.0.5"
    assert client_address("198.51.100.4", spoofed, PROXIES) == "198.51.100.4"


def test_client_address_is_the_hop_a_trusted_proxy_forwarded() -> None:
    assert client_address("10.0.0.5", "203.0.113.7", PROXIES) == "203.0.113.7"


def test_client_address_skips_trusted_hops_right_to_left() -> None:
    # The client wrote 192.0.2.66 itself: the first of our proxies saw 203.0.113.7.
    forwarded = "192.0.2.66, 203.0.113.7, 10.1.2.3, 10.0.0.9"
    assert client_address("10.0.0.5", forwarded, PROXIES) == "203.0.113.7"


def test_client_address_through_ipv6_proxies() -> None:
    assert (
        client_address("2001:db8::1", "2001:0DB8:0:0::7, 2001:db8::2", PROXIES)
        == "2001:db8::7"
    )


def test_client_address_stops_at_a_hop_that_is_no_address() -> None:
    assert client_address("10.0.0.5", "203.0.113.7, unknown", PROXIES) == "10.0.0.5"


def test_client_address_of_trusted_hops_only_is_the_leftmost() -> None:
    assert client_address("10.0.0.5", "10.9.9.9, 10.0.0.6", PROXIES) == "10.9.9.9"


def test_client_address_without_a_header_is_the_proxy() -> None:
    assert client_address("10.0.0.5", "", PROXIES) == "10.0.0.5"


def test_client_address_without_a_peer_is_none() -> None:
    assert client_address("", "203.0.113.7", PROXIES) is None


def test_parse_networks_refuses_what_is_no_network() -> None:
    with pytest.raises(ValueError, match="proxy"):
        parse_networks(["proxy.internal"])

"""The gateway's Host rules against Django's own: one answer for every host."""

from __future__ import annotations

import pytest
from django.http.request import split_domain_port, validate_host

from routing.domain.hosts import HostPolicy

PATTERNS = [
    ["127.0.0.1", "localhost", "[::1]"],
    [".example.com"],
    ["api.example.com", ".internal"],
    ["*"],
    ["Example.COM"],
    [],
    [""],
    ["."],
]
HOSTS = [
    "127.0.0.1",
    "127.0.0.1:8000",
    "localhost",
    "LOCALHOST:80",
    "localhost.",
    "localhost..",
    "[::1]",
    "[::1]:8000",
    "[::1",
    "example.com",
    "example.com.",
    "www.example.com",
    "www.example.com:443",
    "evilexample.com",
    "example.com.evil.org",
    "api.example.com",
    "x.internal",
    "internal",
    "evil.example",
    "",
    ":8000",
    "host:port",
    "a b",
    "a,b",
    "127.0.0.1,evil.example",
    "exa_mple.com",
    "例え.jp",
    "xn--r8jz45g.jp",
    "localhost\n",
    "[::ffff:127.0.0.1]:1",
]


def django_allows(host: str, patterns: list[str]) -> bool:
    """Django's HttpRequest.get_host decision, without a request."""
    domain, _port = split_domain_port(host)
    return bool(domain) and validate_host(domain, patterns)


@pytest.mark.parametrize("patterns", PATTERNS, ids=repr)
def test_host_policy_decides_every_host_as_django_does(patterns: list[str]) -> None:
    policy = HostPolicy.from_patterns(patterns)
    assert {h: policy.allows(h) for h in HOSTS} == {
        h: django_allows(h, patterns) for h in HOSTS
    }


def test_host_policy_allows_the_loopback_names_make_up_serves() -> None:
    policy = HostPolicy.from_patterns(["127.0.0.1", "localhost", "[::1]"])
    assert policy.allows("127.0.0.1:8000")
    assert policy.allows("localhost:8000")
    assert not policy.allows("evil.example")
    assert not policy.allows("attacker.test:8000")

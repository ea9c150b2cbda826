"""Tests for secret generation, hashing and display of API keys."""

from __future__ import annotations

import hashlib
import re

import pytest

from accounts.domain.keys import (
    DISPLAY_PREFIX_LEN,
    KeyKind,
    display_prefix,
    hash_secret,
    kind_of,
    new_secret,
)

_URLSAFE = re.compile(r"[A-Za-z0-9_-]+")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.mark.parametrize("kind", list(KeyKind))
def test_new_secret_starts_with_kind_marker(kind: KeyKind) -> None:
    secret = new_secret(kind)
    assert secret.startswith(kind.value)
    assert kind_of(secret) is kind


@pytest.mark.parametrize("kind", list(KeyKind))
def test_new_secret_carries_43_url_safe_random_characters(kind: KeyKind) -> None:
    body = new_secret(kind).removeprefix(kind.value)
    assert len(body) == 43
    assert _URLSAFE.fullmatch(body)


@pytest.mark.parametrize("kind", list(KeyKind))
def test_new_secret_is_unique_per_call(kind: KeyKind) -> None:
    secrets = {new_secret(kind) for _ in range(200)}
    assert len(secrets) == 200


def test_key_kind_markers_do_not_prefix_each_other() -> None:
    # kind_of and display_prefix take the first marker that matches.
    assert not KeyKind.TEAM.value.startswith(KeyKind.ADMIN.value)
    assert not KeyKind.ADMIN.value.startswith(KeyKind.TEAM.value)


def test_hash_secret_is_64_lowercase_hex() -> None:
    digest = hash_secret(new_secret(KeyKind.TEAM))
    assert _HEX64.fullmatch(digest)


def test_hash_secret_is_stable() -> None:
    secret = "sk-team-abc"
    assert hash_secret(secret) == hash_secret(secret)


def test_hash_secret_is_sha256_of_utf8() -> None:
    assert hash_secret("sk-team-abc") == hashlib.sha256(b"sk-team-abc").hexdigest()
    assert (
        hash_secret("")
        == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )


def test_hash_secret_differs_for_different_secrets() -> None:
    assert hash_secret("sk-team-abc") != hash_secret("sk-team-abd")


@pytest.mark.parametrize("kind", list(KeyKind))
def test_display_prefix_reveals_marker_plus_four_characters(kind: KeyKind) -> None:
    secret = new_secret(kind)
    prefix = display_prefix(secret)
    assert prefix == secret[: len(kind.value) + 4]
    assert len(prefix) == len(kind.value) + 4


@pytest.mark.parametrize("kind", list(KeyKind))
def test_display_prefix_never_reveals_more_than_marker_plus_four(kind: KeyKind) -> None:
    for _ in range(50):
        secret = new_secret(kind)
        prefix = display_prefix(secret)
        assert secret.startswith(prefix)
        assert len(prefix) <= len(kind.value) + 4


def test_display_prefix_of_short_known_secret_is_whole_secret() -> None:
    assert display_prefix("sk-team-ab") == "sk-team-ab"


def test_display_prefix_of_foreign_string_is_cut_to_fixed_length() -> None:
    foreign = "ghp_0123456789abcdefghij"
    assert display_prefix(foreign) == foreign[:DISPLAY_PREFIX_LEN]
    assert len(display_prefix(foreign)) == DISPLAY_PREFIX_LEN


@pytest.mark.parametrize(
    ("secret", "expected"),
    [
        ("sk-team-xyz", KeyKind.TEAM),
        ("sk-admin-xyz", KeyKind.ADMIN),
        ("sk-team-", KeyKind.TEAM),
    ],
)
def test_kind_of_recognises_markers(secret: str, expected: KeyKind) -> None:
    assert kind_of(secret) is expected


@pytest.mark.parametrize(
    "secret", ["", "sk-xyz", "SK-TEAM-xyz", "sk-team", "Bearer sk-team-xyz", "sk-admin"]
)
def test_kind_of_returns_none_for_foreign_strings(secret: str) -> None:
    assert kind_of(secret) is None

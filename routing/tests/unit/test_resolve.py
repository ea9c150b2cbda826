"""Tests for resolving a model name to the version that serves the request."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypedDict, Unpack

import pytest

from routing.domain.resolve import (
    NoLiveVersion,
    Resolution,
    UnknownModel,
    UnknownVersion,
    resolve,
)
from routing.domain.routing_key import stable_fraction
from routing.domain.snapshot import ModelRecord

VERSIONS = {("chat-7b", "v12"), ("chat-7b", "v13"), ("chat-7b", "v14")}
KEYS = [f"conv:{i}" for i in range(10_000)]


BASE = ModelRecord(
    model="chat-7b",
    live_version="v13",
    canary_version=None,
    canary_percent=0.0,
    shadow_version=None,
    shadow_percent=0.0,
)


class ModelOverrides(TypedDict, total=False):
    """The fields of ``BASE`` a test may change."""

    live_version: str | None
    canary_version: str | None
    canary_percent: float
    shadow_version: str | None
    shadow_percent: float


def model(**overrides: Unpack[ModelOverrides]) -> dict[str, ModelRecord]:
    return {"chat-7b": dataclasses.replace(BASE, **overrides)}


def resolve_key(
    models: Mapping[str, ModelRecord],
    key: str = "conv:1",
    fraction: float = 0.99,
    ref: str = "chat-7b",
) -> Resolution:
    return resolve(ref, models, VERSIONS, key, fraction)


def test_resolve_alias_serves_the_live_version() -> None:
    assert resolve_key(model()) == Resolution(
        model="chat-7b",
        version="v13",
        is_pinned=False,
        is_canary=False,
        shadow_version=None,
    )


def test_resolve_pin_serves_that_version() -> None:
    resolution = resolve_key(model(), ref="chat-7b@v12")
    assert resolution.version == "v12"
    assert resolution.is_pinned
    assert not resolution.is_canary


def test_resolve_pin_skips_the_canary_split() -> None:
    models = model(canary_version="v14", canary_percent=100.0)
    assert resolve_key(models, ref="chat-7b@v13").version == "v13"


def test_resolve_pinned_request_is_never_shadowed() -> None:
    models = model(shadow_version="v14", shadow_percent=100.0)
    resolution = resolve_key(models, fraction=0.0, ref="chat-7b@v13")
    assert resolution.shadow_version is None


@pytest.mark.parametrize("ref", ["gpt-9", "gpt-9@v1"])
def test_resolve_unknown_model_raises_on_param_model(ref: str) -> None:
    with pytest.raises(UnknownModel) as excinfo:
        resolve_key(model(), ref=ref)
    assert excinfo.value.param == "model"
    assert "gpt-9" in str(excinfo.value)


@pytest.mark.parametrize("ref", ["Chat-7B", "chat-7b@13", "chat-7b@v13@v14", ""])
def test_resolve_malformed_model_ref_is_an_unknown_model(ref: str) -> None:
    with pytest.raises(UnknownModel):
        resolve_key(model(), ref=ref)


def test_resolve_unknown_pinned_version_raises() -> None:
    with pytest.raises(UnknownVersion) as excinfo:
        resolve_key(model(), ref="chat-7b@v99")
    assert excinfo.value.param == "model"
    assert "v99" in str(excinfo.value)


def test_resolve_pinned_version_must_belong_to_the_model() -> None:
    with pytest.raises(UnknownVersion):
        resolve("chat-7b@v1", model(), {("embed-small", "v1")}, "conv:1", 0.5)


def test_resolve_alias_without_live_version_raises() -> None:
    with pytest.raises(NoLiveVersion) as excinfo:
        resolve_key(model(live_version=None))
    assert excinfo.value.param == "model"


def test_resolve_canary_split_is_stable_per_conversation() -> None:
    models = model(canary_version="v14", canary_percent=30.0)
    for key in KEYS[:1_000]:
        first = resolve_key(models, key=key, fraction=0.1)
        again = resolve_key(models, key=key, fraction=0.9)
        assert first.version == again.version
        assert first.is_canary == (first.version == "v14")


def test_resolve_canary_split_follows_the_salted_stable_fraction() -> None:
    models = model(canary_version="v14", canary_percent=30.0)
    for key in KEYS[:1_000]:
        expected = stable_fraction(key, salt="canary:chat-7b") * 100 < 30.0
        assert resolve_key(models, key=key).is_canary == expected


@pytest.mark.parametrize("percent", [1.0, 10.0, 50.0])
def test_resolve_canary_share_is_about_the_percent(percent: float) -> None:
    models = model(canary_version="v14", canary_percent=percent)
    share = sum(resolve_key(models, key=key).is_canary for key in KEYS) / len(KEYS)
    assert abs(share * 100 - percent) <= max(1.0, percent * 0.1)


def test_resolve_raising_canary_percent_never_moves_a_conversation_back() -> None:
    on_canary: set[str] = set()
    for percent in [0.0, 1.0, 5.0, 20.0, 50.0, 100.0]:
        models = model(canary_version="v14", canary_percent=percent)
        now_on = {key for key in KEYS if resolve_key(models, key=key).is_canary}
        assert on_canary <= now_on
        on_canary = now_on
    assert on_canary == set(KEYS)


def test_resolve_canary_equal_to_live_is_not_a_canary() -> None:
    models = model(canary_version="v13", canary_percent=100.0)
    assert not resolve_key(models).is_canary


def test_resolve_shadow_sampling_is_about_the_percent() -> None:
    models = model(shadow_version="v14", shadow_percent=1.0)
    shadowed = sum(
        resolve_key(models, fraction=i / 10_000).shadow_version == "v14"
        for i in range(10_000)
    )
    assert shadowed == 100


def test_resolve_shadow_is_drawn_per_request_not_per_conversation() -> None:
    models = model(shadow_version="v14", shadow_percent=50.0)
    assert resolve_key(models, fraction=0.2).shadow_version == "v14"
    assert resolve_key(models, fraction=0.7).shadow_version is None


def test_resolve_shadow_zero_percent_never_copies() -> None:
    models = model(shadow_version="v14", shadow_percent=0.0)
    assert resolve_key(models, fraction=0.0).shadow_version is None

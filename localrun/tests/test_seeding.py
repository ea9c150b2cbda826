"""The platform seeding shared by make up, the tests, the drills and the benchmarks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from django.utils import timezone

from accounts.domain.keys import hash_secret
from accounts.models import ApiKey, Team, TeamLimit
from config.errors import Conflict
from localrun.seeding import (
    AdminTokenSeed,
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    digest,
    seed_platform,
    version_body,
)
from models_registry.models import Model, ModelVersion, Pool
from rollouts.models import Rollout

pytestmark = pytest.mark.django_db


def two_version_seed(**changes: Any) -> PlatformSeed:
    """Return teams alpha and beta on chat-7b v1 and v2, with ``changes`` applied."""
    versions = tuple(
        VersionSeed(label, version_body(weights_hash=digest(label)), 1, 2)
        for label in ("v1", "v2")
    )
    seed = PlatformSeed(
        region="seed",
        teams=(TeamSeed("alpha", name="Alpha"), TeamSeed("beta")),
        models=(ModelSeed("chat-7b", versions=versions),),
        limits=(
            LimitSeed("alpha", "chat-7b", tokens_per_minute=1_000, max_concurrency=5),
            LimitSeed(
                "beta",
                "chat-7b",
                tokens_per_minute=2_000,
                max_concurrency=5,
                guaranteed_share=0.5,
            ),
        ),
    )
    return replace(seed, **changes)


def test_seed_platform_creates_teams_keys_versions_pools_alias_and_limits() -> None:
    seeded = seed_platform(seed=two_version_seed(), now=timezone.now())

    assert set(seeded.keys) == {"alpha", "beta"}
    for team, secret in seeded.keys.items():
        assert ApiKey.objects.active().get(key_hash=hash_secret(secret)).team_id == team
    assert Team.objects.get(pk="alpha").name == "Alpha"
    assert [v.version for v in seeded.versions["chat-7b"]] == ["v1", "v2"]
    assert Model.objects.get(pk="chat-7b").live_version == seeded.versions["chat-7b"][0]
    assert sorted(
        Pool.objects.filter(region="seed").values_list(
            "version__version", "min_replicas", "max_replicas"
        )
    ) == [("v1", 1, 2), ("v2", 1, 2)]
    assert dict(TeamLimit.objects.values_list("team_id", "tokens_per_minute")) == {
        "alpha": 1_000,
        "beta": 2_000,
    }
    assert seeded.admin_token is None


def test_seed_platform_again_keeps_what_exists() -> None:
    first = seed_platform(seed=two_version_seed(), now=timezone.now())
    TeamLimit.objects.filter(team_id="alpha").update(tokens_per_minute=7)
    saved = tuple(TeamSeed(team, saved_key=key) for team, key in first.keys.items())

    second = seed_platform(seed=two_version_seed(teams=saved), now=timezone.now())

    assert second.keys == first.keys
    assert ApiKey.objects.count() == 2
    assert ModelVersion.objects.count() == 2
    assert Pool.objects.count() == 2
    assert TeamLimit.objects.get(team_id="alpha").tokens_per_minute == 7
    assert second.versions["chat-7b"] == first.versions["chat-7b"]


def test_seed_platform_moves_no_alias_that_is_set() -> None:
    first = seed_platform(seed=two_version_seed(), now=timezone.now())
    v2 = first.versions["chat-7b"][1]
    Model.objects.filter(pk="chat-7b").update(live_version=v2)

    seed_platform(seed=two_version_seed(), now=timezone.now())

    assert Model.objects.get(pk="chat-7b").live_version == v2
    assert not Rollout.objects.exists()


def test_seed_platform_replaces_a_saved_key_of_another_team() -> None:
    first = seed_platform(seed=two_version_seed(), now=timezone.now())
    stolen = (TeamSeed("alpha", saved_key=first.keys["beta"]), TeamSeed("beta"))

    second = seed_platform(seed=two_version_seed(teams=stolen), now=timezone.now())

    assert second.keys["alpha"] not in first.keys.values()


def test_seed_platform_hands_back_a_working_admin_token_only() -> None:
    token = AdminTokenSeed("tests")
    first = seed_platform(
        seed=PlatformSeed(region="seed", admin_token=token), now=timezone.now()
    )
    assert first.admin_token is not None
    again = AdminTokenSeed("tests", saved_secret=first.admin_token)
    assert (
        seed_platform(
            seed=PlatformSeed(region="seed", admin_token=again), now=timezone.now()
        ).admin_token
        == first.admin_token
    )
    unknown = AdminTokenSeed("tests", saved_secret="sk-admin-unknown")
    assert seed_platform(
        seed=PlatformSeed(region="seed", admin_token=unknown), now=timezone.now()
    ).admin_token not in {None, "sk-admin-unknown", first.admin_token}


def test_seed_platform_applies_the_registry_rules_and_writes_nothing() -> None:
    same_identity = VersionSeed("v2", version_body(weights_hash=digest("v1")), 1, 1)
    seed = two_version_seed(
        models=(
            ModelSeed(
                "chat-7b",
                versions=(
                    VersionSeed("v1", version_body(weights_hash=digest("v1")), 1, 1),
                    same_identity,
                ),
            ),
        )
    )
    with pytest.raises(Conflict):
        seed_platform(seed=seed, now=timezone.now())
    assert not Team.objects.exists()
    assert not Model.objects.exists()

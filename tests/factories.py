"""Shared test data: a valid version body, and factories for rows tests need in bulk.

The version body and its helpers are the platform seeding's (``localrun.seeding``),
so the tests, the drills and the benchmarks register the same versions.
"""

from __future__ import annotations

import factory

from accounts.models import Team
from engine_nodes.models import Replica
from localrun.seeding import VERSION_BODY, ModelSeed, VersionSeed, digest, version_body
from models_registry import services as registry_services
from models_registry.models import ModelVersion

__all__ = [
    "VERSION_BODY",
    "ReplicaFactory",
    "TeamFactory",
    "accept",
    "digest",
    "embedding_model_seed",
    "version_body",
]


def embedding_model_seed(
    *,
    dimensions: int,
    max_input_tokens: int,
    min_replicas: int = 1,
    max_replicas: int = 1,
) -> ModelSeed:
    """Return the embedding model ``embed-1`` the end-to-end tests seed: one
    version ``v1`` served by simulated pooling replicas (prefix caching off, as
    an encoder has no KV cache)."""
    return ModelSeed(
        model_id="embed-1",
        kind="embedding",
        dimensions=dimensions,
        max_input_tokens=max_input_tokens,
        versions=(
            VersionSeed(
                "v1",
                version_body(
                    weights_uri="s3://models/embed-1/",
                    weights_hash=digest("embed weights"),
                    engine_config={
                        **VERSION_BODY["engine_config"],
                        "runner": "pooling",
                        "enable_prefix_caching": False,
                    },
                ),
                min_replicas=min_replicas,
                max_replicas=max_replicas,
            ),
        ),
    )


class TeamFactory(factory.django.DjangoModelFactory[Team]):
    """Teams named team-0, team-1, ..."""

    class Meta:
        model = Team

    team = factory.Sequence(lambda n: f"team-{n}")
    name = factory.LazyAttribute(lambda obj: obj.team.title())


class ReplicaFactory(factory.django.DjangoModelFactory[Replica]):
    """Serving replicas of a given version; pass ``version=``."""

    class Meta:
        model = Replica

    replica_id = factory.Sequence(lambda n: f"replica-{n}")
    version = None
    model = factory.LazyAttribute(lambda obj: obj.version.model)
    region = "local"
    node = "node-1"
    state = "serving"


def accept(version: ModelVersion) -> ModelVersion:
    """Mark a version ready without running its gates, as a test's fixture does."""
    return registry_services.accept_version(
        model_id=version.model_id,
        version=version.version,
        by="tests",
        reason="a fixture: its gates are not what this test is about",
    )

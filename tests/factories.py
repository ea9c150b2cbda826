"""Shared test data: a valid version body, and factories for rows tests need in bulk."""

from __future__ import annotations

import hashlib
from typing import Any

import factory

from accounts.models import Team
from engine_nodes.models import Replica


def digest(text: str) -> str:
    """Return a SHA-256 hex digest, for building valid hashes in tests."""
    return hashlib.sha256(text.encode()).hexdigest()


VERSION_BODY: dict[str, Any] = {
    "weights_uri": "s3://models/chat-7b/2026-11-01/",
    "weights_hash": digest("chat-7b weights"),
    "tokenizer_hash": digest("chat-7b tokenizer"),
    "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}",
    "precision": "fp16",
    "gpus_per_replica": 1,
    "engine_config": {"max_num_seqs": 256, "enable_prefix_caching": True},
}


def version_body(**changes: Any) -> dict[str, Any]:
    """Return a copy of the example version body with ``changes`` applied."""
    return {**VERSION_BODY, **changes}


class TeamFactory(factory.django.DjangoModelFactory):
    """Teams named team-0, team-1, ..."""

    class Meta:
        model = Team

    team = factory.Sequence(lambda n: f"team-{n}")
    name = factory.LazyAttribute(lambda obj: obj.team.title())


class ReplicaFactory(factory.django.DjangoModelFactory):
    """Serving replicas of a given version; pass ``version=``."""

    class Meta:
        model = Replica

    replica_id = factory.Sequence(lambda n: f"replica-{n}")
    version = None
    model = factory.LazyAttribute(lambda obj: obj.version.model)
    region = "local"
    node = "node-1"
    state = "serving"

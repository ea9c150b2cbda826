"""Fixtures of the batches tests: a storage root of their own, a team with a key.

``chat_model`` here is the shared one with the 'search' team granted limits on it:
teams use only models they have limits on (default deny).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from rest_framework.test import APIClient

from accounts import services as accounts_services

if TYPE_CHECKING:
    from pytest_django import Settings

    from accounts.models import Team
    from models_registry.models import Model


@pytest.fixture
def store(settings: Settings, tmp_path: Path) -> Path:
    """A storage root in a temporary directory, the batch files' place under it."""
    root = tmp_path / "store"
    root.mkdir()
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{root}/"]
    settings.PLATFORM_BATCH_STORAGE_URI = f"file://{root}/batches/"
    return root


@pytest.fixture
def chat_model(chat_model: Model, team: Team) -> Model:
    """chat-7b, with the 'search' team's limits on it."""
    accounts_services.set_team_limit(
        team_id=team.team,
        model_id=chat_model.model,
        tokens_per_minute=600_000,
        max_concurrency=64,
        guaranteed_share=0.0,
    )
    return chat_model


@pytest.fixture
def client_of(team_secret: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {team_secret}")
    return client


def line(custom_id: str, content: str = "hello", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "chat-7b",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            **body,
        },
    }


def jsonl(*rows: dict[str, Any] | str) -> bytes:
    return b"".join(
        (row if isinstance(row, str) else json.dumps(row)).encode() + b"\n"
        for row in rows
    )

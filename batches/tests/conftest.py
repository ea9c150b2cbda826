"""Fixtures of the batches tests: a storage root of their own, a team with a key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from rest_framework.test import APIClient

if TYPE_CHECKING:
    from pytest_django import Settings


@pytest.fixture
def store(settings: Settings, tmp_path: Path) -> Path:
    """A storage root in a temporary directory, the batch files' place under it."""
    root = tmp_path / "store"
    root.mkdir()
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{root}/"]
    settings.PLATFORM_BATCH_STORAGE_URI = f"file://{root}/batches/"
    return root


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

"""Fixtures the drills' live tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker


@pytest.fixture
def unblocked(
    django_db_setup: None, django_db_blocker: DjangoDbBlocker, redis_url: str
) -> Iterator[None]:
    """The test database, set up and open to a live drill that runs its own
    processes against it (their rows are written outside any test transaction),
    and Redis, which those processes need."""
    with django_db_blocker.unblock():
        yield

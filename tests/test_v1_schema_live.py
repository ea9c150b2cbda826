"""The team API served by a real platform answers as its schema says.

A gateway process and a simulated replica (``tests.live.start_platform``), a
team key, and schemathesis run against ``GET /v1/openapi.json``: every phase and
every check, bounded and seeded, with no example database.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.live import LivePlatform, assert_conforms_to_schema, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Chats stay cheap without a schema that lies about max_tokens: the replica's
# context is short (a longer ask is the documented 400) and its steps fast.
ENGINE_CONFIG = {"max_model_len": 256, "sim_profile": "cpu-tiny"}
# Bounded and seeded: the same cases every run. The budget guards against a hang;
# it is no speed target.
SCHEMATHESIS_SEED = 7
SCHEMATHESIS_MAX_EXAMPLES = 8
SCHEMATHESIS_BUDGET_S = 240
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    with django_db_blocker.unblock():
        tmp = tmp_path_factory.mktemp("v1-schema")
        with start_platform(tmp, pools={"v1": 1}, engine_config=ENGINE_CONFIG) as live:
            yield live


def test_v1_schema_is_served_without_a_key(platform: LivePlatform) -> None:
    response = httpx.get(f"{platform.url}/v1/openapi.json", timeout=30)
    assert response.status_code == 200, response.text[:500]
    document = response.json()
    assert document["openapi"] == "3.1.0"
    assert "/v1/chat/completions" in document["paths"]


def test_v1_api_conforms_to_its_openapi_schema(
    platform: LivePlatform, tmp_path: Path
) -> None:
    """GIVEN a platform serving chat-7b and a team key
    WHEN schemathesis runs all its phases and checks against /v1/openapi.json
    THEN no operation answers outside its schema: no 5xx, no undocumented status,
    no body off its schema, no valid input refused and no invalid one accepted.
    """
    assert_conforms_to_schema(
        f"{platform.url}/v1/openapi.json",
        token=platform.keys["alpha"],
        config=HERE / "schemathesis_v1.toml",
        hooks="tests.schemathesis_v1_hooks",
        seed=SCHEMATHESIS_SEED,
        max_examples=SCHEMATHESIS_MAX_EXAMPLES,
        budget_s=SCHEMATHESIS_BUDGET_S,
        workdir=tmp_path,
        request_timeout_s=20,
    )

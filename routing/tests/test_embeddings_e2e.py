"""``/v1/embeddings`` end to end: the openai SDK, a real gateway, and a simulated
replica run as vLLM's pooling runner (``--runner pooling``) for ``embed-1``.

Every answer the team ``beta`` is told of is added up and held to the usage rows
the platform wrote (output 0); the refused ones (an input over the model's
longest, a chat model asked for embeddings) are never charged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

import openai
import pytest
from django.utils import timezone

from localrun.processes import wait_until
from localrun.seeding import ModelSeed, VersionSeed
from metering.models import Usage
from tests.factories import VERSION_BODY, digest, version_body
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "embed-1"
DIMENSIONS = 384  # the simulated replica's default vector size
LONGEST = 64


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    embed = ModelSeed(
        model_id=MODEL,
        kind="embedding",
        dimensions=DIMENSIONS,
        max_input_tokens=LONGEST,
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
                min_replicas=1,
                max_replicas=1,
            ),
        ),
    )
    tmp = tmp_path_factory.mktemp("embeddings")
    with (
        django_db_blocker.unblock(),
        start_platform(tmp, pools={"v1": 1}, extra_models=(embed,)) as live,
    ):
        yield live


class Told:
    """The prompt tokens the team ``beta`` was told of, answer by answer."""

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0

    def add(self, prompt_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens


@pytest.fixture(scope="module")
def told() -> Told:
    return Told()


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
@pytest.mark.parametrize("text", ["the cat sat", ["the cat sat", "a dog ran off"]])
def test_strings_and_lists_come_back_one_vector_each(
    platform: LivePlatform,
    told: Told,
    text: str | list[str],
    encoding_format: Literal["float", "base64"] | None,
) -> None:
    client = platform.client("beta")
    if encoding_format is None:
        result = client.embeddings.create(model=MODEL, input=text)
    else:
        result = client.embeddings.create(
            model=MODEL, input=text, encoding_format=encoding_format
        )
    inputs = text if isinstance(text, list) else [text]
    assert [item.index for item in result.data] == list(range(len(inputs)))
    for item in result.data:
        if encoding_format == "base64":
            assert isinstance(item.embedding, str)
        else:  # floats, or base64 the SDK asked for and decoded
            assert len(item.embedding) == DIMENSIONS
    assert result.model == MODEL
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens
    told.add(result.usage.prompt_tokens)


def test_an_input_over_the_longest_is_a_400_never_charged(
    platform: LivePlatform,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        platform.client("beta").embeddings.create(
            model=MODEL, input=["short", "word " * (4 * LONGEST)]
        )
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")


def test_a_chat_model_asked_for_embeddings_is_a_400_naming_model(
    platform: LivePlatform,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        platform.client("beta").embeddings.create(model="chat-7b", input="hello")
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "model"


def test_usage_rows_equal_what_the_team_was_told(
    platform: LivePlatform, told: Told, django_db_blocker: DjangoDbBlocker
) -> None:
    """Last in the module: every answer above was metered once, output 0; the
    refused ones were never charged (not even to chat-7b)."""
    assert told.requests == 6

    def rows() -> tuple[int, int, int, int]:
        _flush(platform)
        with django_db_blocker.unblock():
            found = Usage.objects.filter(team_id="beta")
            embedded = [r for r in found if r.model_id == MODEL]
            return (
                sum(r.requests for r in embedded),
                sum(r.prompt_tokens for r in embedded),
                sum(r.output_tokens for r in embedded),
                sum(r.requests for r in found if r.model_id != MODEL),
            )

    expected = (told.requests, told.prompt_tokens, 0, 0)
    wait_until(
        lambda: rows() == expected,
        timeout_s=30,
        message=f"usage rows equal to what beta was told {expected}",
    )


def _flush(platform: LivePlatform) -> None:
    if not os.environ.get("REDIS_URL"):
        return
    import redis

    from metering.services import flush_redis_usage

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    flush_redis_usage(
        client=client, prefix=platform.prefix, now=timezone.now() + timedelta(minutes=2)
    )

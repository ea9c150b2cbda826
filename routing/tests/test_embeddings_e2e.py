"""``/v1/embeddings`` end to end: the openai SDK, a real gateway, and a simulated
replica run as vLLM's pooling runner (``--runner pooling``) for ``embed-1``.

Every answer the team ``beta`` is told of is added up and held to the usage rows
the platform wrote (output 0); the refused ones (an input over the model's
longest, a chat model asked for embeddings, inputs over what its bucket holds:
a 429 counted as rate limited) are never charged.
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
from metering.models import Usage
from tests.factories import embedding_model_seed
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
    embed = embedding_model_seed(dimensions=DIMENSIONS, max_input_tokens=LONGEST)
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
        self.rate_limited = 0

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


# beta's limits on embed-1 while the 429 is tried: a token a second.
TIGHT_TOKENS_PER_MINUTE = 60


def test_inputs_over_what_the_bucket_holds_are_openais_429(
    platform: LivePlatform, told: Told, django_db_blocker: DjangoDbBlocker
) -> None:
    """GIVEN beta's bucket on embed-1 holds 60 tokens a minute and an answer
    took most of it, WHEN the next request's inputs count more than is left,
    THEN the SDK gets OpenAI's 429 (rate_limit_error, Retry-After), nothing is
    charged for it, and the usage rows count it as rate limited (last test)."""
    with django_db_blocker.unblock():
        seeded = _set_embed_limits(
            tokens_per_minute=TIGHT_TOKENS_PER_MINUTE, max_concurrency=4
        )
    client = platform.client("beta")
    try:
        _wait_for_limit(client, told, TIGHT_TOKENS_PER_MINUTE)
        texts = [" ".join(["word"] * 14)] * 3
        first = client.embeddings.create(model=MODEL, input=texts)
        told.add(first.usage.prompt_tokens)
        # It took most of the 60: what is left, and a few seconds' refill, are
        # less than the same inputs again.
        assert 30 <= first.usage.prompt_tokens <= 50
        with pytest.raises(openai.RateLimitError) as refused:
            client.embeddings.create(model=MODEL, input=texts)
        told.rate_limited += 1
        error = refused.value.body
        assert isinstance(error, dict)
        assert (error["type"], error["code"]) == (
            "rate_limit_error",
            "rate_limit_exceeded",
        )
        headers = refused.value.response.headers
        assert int(headers["retry-after"]) >= 1
        assert headers["x-ratelimit-limit-tokens"] == str(TIGHT_TOKENS_PER_MINUTE)
    finally:
        with django_db_blocker.unblock():
            _set_embed_limits(**seeded)
    _wait_for_limit(client, told, seeded["tokens_per_minute"])


def _set_embed_limits(
    *, tokens_per_minute: int, max_concurrency: int
) -> dict[str, int]:
    """Set beta's embed-1 limits; return what they were."""
    from accounts import services as accounts
    from accounts.models import TeamLimit

    before = TeamLimit.objects.get(team_id="beta", model_id=MODEL)
    accounts.set_team_limit(
        team_id="beta",
        model_id=MODEL,
        tokens_per_minute=tokens_per_minute,
        max_concurrency=max_concurrency,
        guaranteed_share=before.guaranteed_share,
    )
    return {
        "tokens_per_minute": before.tokens_per_minute,
        "max_concurrency": before.max_concurrency,
    }


def _wait_for_limit(client: openai.OpenAI, told: Told, limit: int) -> None:
    """Poll until the gateway holds beta to ``limit`` tokens a minute on embed-1:
    each probe is one short input (added to what beta was told), its answer's
    x-ratelimit-limit-tokens the limit the gateway applied. Under the tight
    limit a probe may be refused until the bucket refills: counted as such."""

    def applied() -> bool:
        try:
            raw = client.embeddings.with_raw_response.create(model=MODEL, input="probe")
        except openai.RateLimitError:
            told.rate_limited += 1
            return False
        told.add(raw.parse().usage.prompt_tokens)
        return raw.headers.get("x-ratelimit-limit-tokens") == str(limit)

    wait_until(
        applied,
        timeout_s=30,
        interval_s=0.5,
        message=f"beta's embed-1 limit at {limit}",
    )


def test_usage_rows_equal_what_the_team_was_told(
    platform: LivePlatform, told: Told, django_db_blocker: DjangoDbBlocker
) -> None:
    """Last in the module: every answer above was metered once, output 0; the
    refused ones were never charged (not even to chat-7b), the 429 counted as
    rate limited."""
    assert told.requests >= 9  # 6 answers, 2 probes and one before the 429 at least
    assert told.rate_limited >= 1

    def rows() -> tuple[int, int, int, int, int]:
        _flush(platform)
        with django_db_blocker.unblock():
            found = Usage.objects.filter(team_id="beta")
            embedded = [r for r in found if r.model_id == MODEL]
            return (
                sum(r.requests for r in embedded),
                sum(r.prompt_tokens for r in embedded),
                sum(r.output_tokens for r in embedded),
                sum(r.requests for r in found if r.model_id != MODEL),
                sum(r.rate_limited for r in embedded),
            )

    expected = (told.requests, told.prompt_tokens, 0, 0, told.rate_limited)
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

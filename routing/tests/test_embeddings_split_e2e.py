"""A large ``/v1/embeddings`` request split across two simulated pooling
replicas, end to end: the openai SDK, a real gateway, ``embed-1`` served by two
``--runner pooling`` replicas.

The split answer must be the unsplit one (the same vectors in input order), its
usage the sum of the chunks', each replica must have embedded its own part of
the inputs (as its own metrics count them), and the usage rows must equal what
the team was told.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

import httpx
import pytest
from django.utils import timezone

from engine_nodes.models import Replica
from localrun.processes import wait_until
from metering.models import Usage
from tests.factories import embedding_model_seed
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "embed-1"
# Enough short texts, and tokens, for the gateway's rule to split them in two.
TEXTS = [f"text {i} of the split with a few more words" for i in range(96)]
# Under the rule's least number of inputs: sent whole.
WHOLE = 24


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    embed = embedding_model_seed(
        dimensions=384, max_input_tokens=64, min_replicas=2, max_replicas=2
    )
    tmp = tmp_path_factory.mktemp("embeddings_split")
    with (
        django_db_blocker.unblock(),
        start_platform(tmp, pools={"v1": 1}, extra_models=(embed,)) as live,
    ):
        yield live


def test_a_large_request_is_split_over_both_replicas_and_merged_in_order(
    platform: LivePlatform, django_db_blocker: DjangoDbBlocker
) -> None:
    client = platform.client("beta")
    with django_db_blocker.unblock():
        urls = list(
            Replica.objects.filter(model_id=MODEL, state="serving").values_list(
                "url", flat=True
            )
        )
    assert len(urls) == 2
    wait_until(
        lambda: (
            httpx.get(f"{platform.url}/healthz")
            .json()["serving_replicas"]
            .get(f"{MODEL}@v1")
            == 2
        ),
        timeout_s=30,
        message="both embed-1 replicas routable",
    )
    # The vectors of each text, asked in parts under the rule: never split.
    whole = [
        client.embeddings.create(
            model=MODEL, input=TEXTS[start : start + WHOLE], encoding_format="float"
        )
        for start in range(0, len(TEXTS), WHOLE)
    ]
    assert all("replica_ids" not in (answer.model_extra or {}) for answer in whole)
    expected = [item.embedding for answer in whole for item in answer.data]
    before = [_embedded(url) for url in urls]

    split = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")

    assert [item.index for item in split.data] == list(range(len(TEXTS)))
    assert [item.embedding for item in split.data] == expected
    assert len(set((split.model_extra or {})["replica_ids"])) == 2
    prompt_tokens = sum(answer.usage.prompt_tokens for answer in whole)
    assert split.usage.prompt_tokens == prompt_tokens
    # Each replica embedded a part of the inputs, the two parts all of them.
    served = [_embedded(url) - seen for url, seen in zip(urls, before, strict=True)]
    assert all(count > 0 for count in served)
    assert sum(served) == len(TEXTS)

    told = (len(whole) + 1, 2 * prompt_tokens)

    def rows() -> tuple[int, int]:
        _flush(platform)
        with django_db_blocker.unblock():
            found = Usage.objects.filter(team_id="beta", model_id=MODEL)
            return (
                sum(r.requests for r in found),
                sum(r.prompt_tokens for r in found),
            )

    wait_until(
        lambda: rows() == told,
        timeout_s=30,
        message=f"usage rows equal to what beta was told {told}",
    )


def _embedded(url: str) -> int:
    """Return the inputs a replica has embedded (vLLM counts each a request)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return round(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total{")
        )
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

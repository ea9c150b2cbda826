"""An embedding version's eval and load test, live against its staging replica.

Public surface: ``EmbeddingGateError``, ``embedding_eval``, ``embedding_load_test``.

``control.gates`` runs these for a version of an embedding model in place of the
chat eval and the chat load test; the rules are
``models_registry.domain.embedding_eval`` and
``models_registry.domain.embedding_load_test``, and this module only talks HTTP.
Both reach the staging replica directly at its base URL (outside the gateway, as
the chat load test does): what is judged is the model's vectors and the
replica's speed, not the route to it.

**The eval** embeds every probe text (32 texts a request, ``encoding_format``
float) and hands the vectors to ``judge_embeddings``.

**The load test** interprets the search's ``MeasureStep`` effects: a step starts
``concurrency`` closed-loop clients, each sending its next batch of
``embedding_batches`` as soon as the last one answered (``encoding_format``
base64, so the client decodes little: only the usage is read). A request sent in
the window counts its latency (sent to answered) and its ``usage.prompt_tokens``;
one that runs past ``request_timeout_s`` counts as unanswered. Clients stop
sending at the window's end and the step ends when their last requests answered,
so each step starts from an idle replica.

**Errors** (a replica that cannot be reached, any answer but 200, an answer
without the vectors or usage asked for) raise ``EmbeddingGateError``, whose
message names the cause and never the engine key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from control.load_test import _error_text, _loop_factory, _safe_url
from models_registry.domain.embedding_eval import (
    EmbeddingEvalReport,
    EmbeddingProbe,
    judge_embeddings,
    probe_texts,
)
from models_registry.domain.embedding_load_test import (
    EmbeddingAnswer,
    EmbeddingLoadSettings,
    EmbeddingStep,
    MeasureStep,
    embedding_batches,
    embedding_search,
    judge_embedding_step,
)

__all__ = ["EmbeddingGateError", "embedding_eval", "embedding_load_test"]

_EVAL_BATCH = 32


class EmbeddingGateError(Exception):
    """The embedding gate could not run; the message says why (never a secret)."""


class _Replica:
    """The replica's ``/v1/embeddings``, as the gates use it."""

    def __init__(
        self, url: str, model: str, api_key: str | None, timeout_s: float
    ) -> None:
        self.safe_url = _safe_url(url.rstrip("/"))
        self.model = model
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=1024, keepalive_expiry=4.0),
        )

    async def embed(self, texts: Sequence[str], encoding_format: str) -> dict[str, Any]:
        """Return the answer to one request for ``texts``."""
        body = {
            "model": self.model,
            "input": list(texts),
            "encoding_format": encoding_format,
        }
        try:
            response = await self.client.post("/v1/embeddings", json=body)
        except httpx.TimeoutException:
            raise
        except httpx.HTTPError as exc:
            raise EmbeddingGateError(
                f"cannot reach the replica at {self.safe_url}: {type(exc).__name__}"
            ) from None
        if response.status_code != 200:
            raise EmbeddingGateError(
                f"the replica at {self.safe_url} answered {response.status_code} to "
                f"POST /v1/embeddings: {_error_text(response.content)}"
            )
        try:
            answer = response.json()
            data = answer["data"]
            tokens = answer["usage"]["prompt_tokens"]
        except (ValueError, KeyError, TypeError):
            data, tokens = None, None
        if (
            not isinstance(data, list)
            or len(data) != len(texts)
            or not isinstance(tokens, int)
        ):
            raise EmbeddingGateError(
                f"the replica at {self.safe_url} answered /v1/embeddings without "
                f"{len(texts)} vectors and their usage"
            )
        return dict(answer)


# -- the eval ---------------------------------------------------------------------


async def _embed_probes(
    replica: _Replica,
    probes: Sequence[EmbeddingProbe],
    progress: Callable[[int, int], None],
) -> dict[str, list[float]]:
    texts = list(dict.fromkeys(probe_texts(probes)))
    vectors: dict[str, list[float]] = {}
    for start in range(0, len(texts), _EVAL_BATCH):
        chunk = texts[start : start + _EVAL_BATCH]
        try:
            answer = await replica.embed(chunk, "float")
        except httpx.TimeoutException:
            raise EmbeddingGateError(
                f"the replica at {replica.safe_url} did not answer in time"
            ) from None
        for item in answer["data"]:
            index, vector = item.get("index"), item.get("embedding")
            if not isinstance(index, int) or not 0 <= index < len(chunk):
                raise EmbeddingGateError("an answer's vector has no valid index")
            if not isinstance(vector, list) or not all(
                isinstance(x, int | float) for x in vector
            ):
                raise EmbeddingGateError("an answer's vector is not a list of numbers")
            vectors[chunk[index]] = [float(x) for x in vector]
        progress(min(start + _EVAL_BATCH, len(texts)), len(texts))
    if len(vectors) != len(texts):
        raise EmbeddingGateError("the replica's answers left probe texts unembedded")
    return vectors


def embedding_eval(
    url: str,
    *,
    model: str,
    api_key: str | None,
    probes: Sequence[EmbeddingProbe],
    dimensions: int,
    is_normalized: bool,
    min_accuracy: float,
    progress: Callable[[int, int], None] | None = None,
) -> EmbeddingEvalReport:
    """Embed the probes' texts on the replica at ``url`` and judge the vectors.

    Raises:
        EmbeddingGateError: the replica or its answers (the message says).
    """

    async def run() -> dict[str, list[float]]:
        replica = _Replica(url, model, api_key, timeout_s=120.0)
        try:
            return await _embed_probes(
                replica, probes, progress or (lambda done, total: None)
            )
        finally:
            await replica.client.aclose()

    vectors = asyncio.run(run())
    return judge_embeddings(
        probes,
        vectors,
        dimensions=dimensions,
        is_normalized=is_normalized,
        min_accuracy=min_accuracy,
    )


# -- the load test ------------------------------------------------------------------


async def _measure(
    replica: _Replica, settings: EmbeddingLoadSettings, effect: MeasureStep
) -> EmbeddingStep:
    """Run one step of ``effect.concurrency`` closed-loop clients; return it judged."""
    started = time.monotonic()
    window_start = started + settings.warmup_s
    window_end = window_start + settings.duration_s
    latencies: list[float] = []
    counted = {"tokens": 0, "unanswered": 0}

    async def client(number: int) -> None:
        for batch in embedding_batches(settings, number, effect.concurrency):
            sent = time.monotonic()
            if sent >= window_end:
                return
            in_window = sent >= window_start
            try:
                answer = await replica.embed(batch.texts, "base64")
            except httpx.TimeoutException:
                counted["unanswered"] += in_window
                return  # this client is stuck behind a replica that does not answer
            if in_window:
                latencies.append(time.monotonic() - sent)
                counted["tokens"] += answer["usage"]["prompt_tokens"]

    try:
        async with asyncio.TaskGroup() as group:
            for number in range(effect.concurrency):
                group.create_task(client(number))
    except* EmbeddingGateError as failed:
        raise failed.exceptions[0] from None
    return judge_embedding_step(
        concurrency=effect.concurrency,
        latencies_s=latencies,
        input_tokens=counted["tokens"],
        unanswered=counted["unanswered"],
        window_s=settings.duration_s,
        latency_target_ms=settings.latency_target_ms,
    )


async def _run_search(
    url: str,
    *,
    model: str,
    api_key: str | None,
    settings: EmbeddingLoadSettings,
    on_step: Callable[[EmbeddingStep], None],
) -> EmbeddingAnswer:
    replica = _Replica(url, model, api_key, timeout_s=settings.request_timeout_s)
    search = embedding_search(settings)
    try:
        effect = next(search)
        while True:
            step = await _measure(replica, settings, effect)
            on_step(step)
            try:
                effect = search.send(step)
            except StopIteration as done:
                answer: EmbeddingAnswer = done.value
                return answer
    finally:
        await replica.client.aclose()


def embedding_load_test(
    url: str,
    *,
    model: str,
    api_key: str | None,
    settings: EmbeddingLoadSettings,
    on_step: Callable[[EmbeddingStep], None] | None = None,
) -> EmbeddingAnswer:
    """Run the embedding search against the replica at ``url`` to its answer.

    Raises:
        EmbeddingGateError: the replica or its answers (the message says).
    """
    coroutine = _run_search(
        url,
        model=model,
        api_key=api_key,
        settings=settings,
        on_step=on_step or (lambda step: None),
    )
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(coroutine)

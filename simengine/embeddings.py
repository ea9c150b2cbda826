"""The simulated replica's ``/v1/embeddings``: vLLM 0.32's pooling surface.

Public surface: ``EmbeddingError``, ``EmbeddingBatcher``, ``BATCH_BASE_MS``,
``PER_TOKEN_MS``, ``DEFAULT_EMBEDDING_DIM``, ``parse_inputs``, ``embedding_vector``,
``encode_embedding``, ``embedding_response``, ``batch_seconds``.

Started with ``--runner pooling`` the replica is an embedding model, as vLLM is:
``/v1/embeddings`` answers and the generating routes (``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses``) are not mounted, so they get FastAPI's
404 ``{"detail":"Not Found"}`` (the capture in ``tests/data/vllm_embeddings``).
Without it ``/v1/embeddings`` is that 404 in turn.

Vectors are deterministic: a function of the input's token ids (the stand-in
tokenizer ``simengine.domain.tokens`` for text), ``--sim-embedding-dim`` long,
of unit L2 norm, and already float32 values, so ``encoding_format: base64``
(little-endian float32, as vLLM's default ``embed_dtype``/``endianness``) decodes
to exactly the floats the JSON answer carries. They mean something, as a real
model's do: a hashed bag of the input's tokens (each token id adds a signed 1 at
two hashed positions), normalized, so texts that share words lie close and the
embedding eval gate's retrieval probes pass. ``--sim-embedding-random`` answers
a vector seeded by the ids instead, as meaningless as noise (a broken model: the
gate must refuse it).

The performance model is a batcher: waiting requests go to the engine together
(up to ``max_num_seqs``), and a batch takes the profile's ``batch_base_ms`` plus
``per_token_ms`` per input token in it (``simengine.domain.embedding_perf``). The
profile follows ``--sim-profile``'s device, as the chat model's step time does:
``cpu-minilm`` (measured against real vLLM 0.32.0's CPU build serving
all-MiniLM-L6-v2 on this box: 9 ms a batch plus 0.32 ms a token) when no profile
is given or for ``cpu-tiny``, ``a100-minilm`` for ``a100-8b`` (what an FP16
one-GPU version gets), ``h100-minilm`` for the H100 profiles; the GPU ones are
estimates scaled from the chat profiles' GPU/CPU ratio, not measurements.
``BATCH_BASE_MS`` and ``PER_TOKEN_MS`` are the measured CPU constants.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import math
import random
import struct
from collections.abc import Sequence
from typing import Any

from simengine.domain import tokens
from simengine.domain.embedding_perf import CPU_EMBEDDING_PROFILE, EmbeddingProfile

__all__ = [
    "BATCH_BASE_MS",
    "DEFAULT_EMBEDDING_DIM",
    "PER_TOKEN_MS",
    "EmbeddingBatcher",
    "EmbeddingError",
    "batch_seconds",
    "embedding_response",
    "embedding_vector",
    "encode_embedding",
    "parse_inputs",
]

DEFAULT_EMBEDDING_DIM = 384  # all-MiniLM-L6-v2's
BATCH_BASE_MS = CPU_EMBEDDING_PROFILE.batch_base_ms
PER_TOKEN_MS = CPU_EMBEDDING_PROFILE.per_token_ms


class EmbeddingError(ValueError):
    """A request vLLM answers with a 400; ``param`` as its error body's."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )


def parse_inputs(value: Any, max_model_len: int) -> list[list[int]]:
    """Return the token ids of each prompt in an embeddings request's ``input``
    (a string, a list of strings, a list of ids, or a list of lists of ids).

    Raises:
        EmbeddingError: an empty list, an input of another type, or a prompt
            over ``max_model_len`` tokens (vLLM's messages).
    """
    if isinstance(value, list) and not value:
        raise EmbeddingError("You must pass at least one prompt")
    prompts: list[tuple[list[int], bool]]
    if isinstance(value, str):
        prompts = [(tokens.encode(value), True)]
    elif _is_ids(value):
        prompts = [(list(value), False)]
    elif isinstance(value, list) and all(isinstance(item, str) for item in value):
        prompts = [(tokens.encode(item), True) for item in value]
    elif isinstance(value, list) and all(_is_ids(item) for item in value):
        prompts = [(list(item), False) for item in value]
    else:
        raise EmbeddingError(
            "input must be a string, a list of strings, a list of token ids or "
            "a list of lists of token ids",
            "input",
        )
    for ids, is_text in prompts:
        if len(ids) > max_model_len:
            # vLLM tokenizes text truncated to one past the limit ("at least").
            seen = min(len(ids), max_model_len + 1) if is_text else len(ids)
            raise EmbeddingError(
                f"This model's maximum context length is {max_model_len} tokens. "
                f"However, your prompt contains at least {seen} input tokens, "
                "which exceeds this limit even without any output tokens. Please "
                "reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={seen})",
                "input_tokens",
            )
    return [ids for ids, _ in prompts]


def _random_vector(ids: Sequence[int], dim: int) -> list[float]:
    digest = hashlib.blake2b(struct.pack(f"<{len(ids)}q", *ids), digest_size=8)
    rng = random.Random(int.from_bytes(digest.digest(), "little"))
    return [rng.gauss(0.0, 1.0) for _ in range(dim)]


@functools.lru_cache(maxsize=65536)
def _token_slots(token_id: int, dim: int) -> tuple[tuple[int, float], ...]:
    """Return the two (position, sign) pairs token ``token_id`` adds to."""
    digest = hashlib.blake2b(token_id.to_bytes(8, "little", signed=True)).digest()
    return tuple(
        (
            int.from_bytes(digest[i : i + 4], "little") % dim,
            1.0 if digest[i + 4] & 1 else -1.0,
        )
        for i in (0, 8)
    )


def _bag_vector(ids: Sequence[int], dim: int) -> list[float]:
    raw = [0.0] * dim
    for token_id in ids:
        for position, sign in _token_slots(token_id, dim):
            raw[position] += sign
    return raw


def embedding_vector(
    ids: Sequence[int], dim: int, *, is_random: bool = False
) -> list[float]:
    """Return a unit-norm vector of ``dim`` float32 values for ``ids``: their
    hashed bag of tokens, or (``is_random``) a vector seeded by them."""
    raw = _random_vector(ids, dim) if is_random else _bag_vector(ids, dim)
    if not any(raw):  # no tokens, or ones that cancelled out: still a unit vector
        raw = _random_vector(ids, dim)
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    packed = struct.pack(f"<{dim}f", *(x / norm for x in raw))
    return list(struct.unpack(f"<{dim}f", packed))


def encode_embedding(vector: Sequence[float], encoding_format: str) -> Any:
    """Return ``vector`` as the answer carries it: floats, or base64 of
    little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return list(vector)


def embedding_response(
    *,
    request_id: str,
    created: int,
    model: str,
    prompts: Sequence[Sequence[int]],
    dim: int,
    encoding_format: str,
    is_random: bool = False,
) -> dict[str, Any]:
    """Return vLLM's ``EmbeddingResponse`` for ``prompts`` (``embedding_vector``'s
    vectors)."""
    prompt_tokens = sum(len(ids) for ids in prompts)
    return {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": [
            {
                "index": index,
                "object": "embedding",
                "embedding": encode_embedding(
                    embedding_vector(ids, dim, is_random=is_random),
                    encoding_format,
                ),
            }
            for index, ids in enumerate(prompts)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }


def batch_seconds(
    batch_tokens: int, profile: EmbeddingProfile = CPU_EMBEDDING_PROFILE
) -> float:
    """Return how long the engine of ``profile`` takes over a batch of
    ``batch_tokens``."""
    return profile.batch_seconds(batch_tokens)


class EmbeddingBatcher:
    """The embedding engine's time: requests that wait together run as one batch
    of at most ``max_batch`` requests (``batch_seconds`` of its tokens on
    ``profile``)."""

    def __init__(
        self, max_batch: int, profile: EmbeddingProfile = CPU_EMBEDDING_PROFILE
    ) -> None:
        self.max_batch = max(1, max_batch)
        self.profile = profile
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    async def run(self, n_tokens: int) -> None:
        """Wait until a batch holding a request of ``n_tokens`` is done."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((n_tokens, done))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._engine())
        await done

    async def _engine(self) -> None:
        while self._waiting:
            batch = self._waiting[: self.max_batch]
            del self._waiting[: self.max_batch]
            await asyncio.sleep(self.profile.batch_seconds(sum(n for n, _ in batch)))
            for _, done in batch:
                if not done.done():
                    done.set_result(None)

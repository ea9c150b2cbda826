"""Real vLLM's pooling runner on real weights: all-MiniLM-L6-v2 on CPU.

Starts real vLLM 0.32.0 (CPU build) on ``make minilm``'s weights with
``MINILM_ENGINE_CONFIG`` (``simengine.embedding_capture``), embeds 50 texts
through the ``openai`` SDK and holds each vector to sentence-transformers' own
embedding of the same text (computed in the vLLM venv, which has
sentence-transformers, by a subprocess): cosine at least 0.999. It also
re-captures ``/v1/embeddings`` and diffs the shapes against the committed capture
the simulated replica is held to (``simengine/tests/data/vllm_embeddings``), so a
vLLM upgrade that changes the surface fails here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import openai
import pytest

from localrun.vllm_cpu import vllm_server
from simengine.conformance import diff_json_shapes, json_shape
from simengine.embedding_capture import (
    MINILM,
    MINILM_ENGINE_CONFIG,
    capture_embeddings,
    read_embeddings,
)

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".vllm" / "bin" / "python"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SUBJECTS = ["The cat", "A rocket", "My neighbour", "The old bridge", "A quiet river"]
ACTIONS = [
    "sleeps through the afternoon",
    "was launched at dawn",
    "plays the violin badly",
    "needs a new coat of paint",
    "floods every spring",
    "appears in the evening news",
    "costs more than expected",
    "is older than the town itself",
    "confuses every visitor",
    "smells faintly of pine",
]
TEXTS = [f"{s} {a}." for s in SUBJECTS for a in ACTIONS]

_REFERENCE = """
import json, sys
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu")
texts = json.load(sys.stdin)
json.dump(model.encode(texts, convert_to_numpy=True).tolist(), sys.stdout)
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, minilm_model: Path) -> Iterator[str]:
    with vllm_server(
        tmp_path_factory.mktemp("vllm-minilm"),
        engine_config=MINILM_ENGINE_CONFIG,
        model_dir=minilm_model,
        model=MINILM,
        name="vllm-minilm",
        env=OFFLINE,
    ) as server:
        yield server


def reference_embeddings(model_dir: Path, texts: Sequence[str]) -> list[list[float]]:
    """Return sentence-transformers' embeddings of ``texts`` (vLLM's venv)."""
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", _REFERENCE, str(model_dir)],
        input=json.dumps(list(texts)),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **OFFLINE},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    vectors: list[list[float]] = json.loads(done.stdout)
    return vectors


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_vllm_embeds_as_sentence_transformers_does(
    url: str, minilm_model: Path
) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(model=MINILM, input=TEXTS)
    assert [item.index for item in answer.data] == list(range(len(TEXTS)))
    expected = reference_embeddings(minilm_model, TEXTS)
    similarities = [
        cosine(item.embedding, reference)
        for item, reference in zip(answer.data, expected, strict=True)
    ]
    assert min(similarities) >= 0.999, similarities


def test_vllm_embeddings_keep_the_captured_shapes(url: str, tmp_path: Path) -> None:
    capture_embeddings(url, MINILM, tmp_path)
    live = read_embeddings(tmp_path)
    committed = read_embeddings()
    assert sorted(live) == sorted(committed)
    for case, (status, body) in committed.items():
        live_status, live_body = live[case]
        assert live_status == status, case
        assert diff_json_shapes(json_shape(body), json_shape(live_body)) == [], case
        if status != 200:
            assert live_body == body, case

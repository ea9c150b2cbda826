"""Record what a vLLM pooling server answers on ``/v1/embeddings``.

Public surface: ``EMBEDDING_CASES``, ``EMBEDDINGS_DIR``, ``MINILM_ENGINE_CONFIG``,
``MINILM_MODEL``, ``MINILM``, ``capture_embeddings``, ``read_embeddings``.

Each case is one request; its raw answer body is kept in ``<name>.json`` and
``index.json`` lists each case's path, request, status and content type. The
server's ``/v1/models`` and ``/metrics`` are kept as ``models.json`` and
``metrics.txt``. The committed capture (``EMBEDDINGS_DIR``) is of real vLLM 0.32.0
(CPU build) serving sentence-transformers' all-MiniLM-L6-v2 (``make minilm``) with
``MINILM_ENGINE_CONFIG``. To record again, with that server running:
``python -m simengine.embedding_capture URL MODEL OUTDIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "EMBEDDINGS_DIR",
    "EMBEDDING_CASES",
    "MINILM",
    "MINILM_ENGINE_CONFIG",
    "MINILM_MODEL",
    "capture_embeddings",
    "read_embeddings",
]

EMBEDDINGS_DIR = Path(__file__).resolve().parent / "tests" / "data" / "vllm_embeddings"
MINILM_MODEL = Path(__file__).resolve().parent.parent / ".local" / "weights" / "minilm"
MINILM = "minilm"

# The MiniLM server's flags over the tiny Llama's (localrun.vllm_cpu): the pooling
# runner, float32 (the reference embeddings are float32) and sentence-transformers'
# max_seq_length (256) as the context. Prefix caching off: the platform's argv
# turns it on, and an encoder-only model has no KV cache, so vLLM 0.32 dies at
# start ("HybridKVCacheCoordinator requires at least one cacheable group").
MINILM_ENGINE_CONFIG: Mapping[str, Any] = {
    "runner": "pooling",
    "enable_prefix_caching": False,
    "dtype": "float32",
    "max_model_len": 256,
}

# name -> (path, body without "model"); the model is added at capture time.
EMBEDDING_CASES: Mapping[str, tuple[str, dict[str, Any]]] = {
    "string": ("/v1/embeddings", {"input": "The quick brown fox jumps."}),
    "list": (
        "/v1/embeddings",
        {"input": ["first sentence", "a second one", "and the third, longer one"]},
    ),
    "token_ids": ("/v1/embeddings", {"input": [7592, 2088, 2003, 2307]}),
    "base64": (
        "/v1/embeddings",
        {"input": "The quick brown fox jumps.", "encoding_format": "base64"},
    ),
    "dimensions": ("/v1/embeddings", {"input": "short text", "dimensions": 128}),
    "over_length": ("/v1/embeddings", {"input": "hello " * 400}),
    "empty_list": ("/v1/embeddings", {"input": []}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ),
}


def capture_embeddings(
    url: str, model: str, outdir: Path, *, api_key: str = ""
) -> dict[str, Any]:
    """Send every case in ``EMBEDDING_CASES`` to ``url`` (serving ``model``, with
    ``api_key`` where the server wants one) and write the raw bodies,
    ``models.json``, ``metrics.txt`` and ``index.json`` under ``outdir``; return
    the index."""
    outdir.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, timeout=120, headers=headers) as client:
        for name, (path, body) in EMBEDDING_CASES.items():
            request = {"model": model, **body}
            response = client.post(path, json=request)
            (outdir / f"{name}.json").write_bytes(response.content)
            index[name] = {
                "path": path,
                "request": request,
                "status": response.status_code,
                "content_type": response.headers.get("content-type"),
            }
        (outdir / "models.json").write_bytes(client.get("/v1/models").content)
        (outdir / "metrics.txt").write_bytes(client.get("/metrics").content)
    (outdir / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def read_embeddings(outdir: Path = EMBEDDINGS_DIR) -> dict[str, tuple[int, Any]]:
    """Return each captured case's (status, parsed body)."""
    index = json.loads((outdir / "index.json").read_text())
    return {
        name: (entry["status"], json.loads((outdir / f"{name}.json").read_text()))
        for name, entry in index.items()
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("model")
    parser.add_argument("outdir", type=Path)
    args = parser.parse_args(argv)
    index = capture_embeddings(args.url, args.model, args.outdir)
    statuses = {name: entry["status"] for name, entry in index.items()}
    sys.stdout.write(json.dumps(statuses, indent=2) + "\n")


if __name__ == "__main__":
    main()

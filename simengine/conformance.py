"""Capture what a vLLM server shows its clients, reduce it to its shape, and diff.

Public surface: ``Capture``, ``capture``, ``read_capture``, ``write_capture``,
``MetricShape``, ``metric_shapes``, ``diff_metrics``, ``stream_facts``,
``diff_stream``, ``json_shape``, ``diff_json_shapes``, ``PLATFORM_METRICS``,
``REFERENCE_DIR``, ``CAPTURE_SERVER_FLAGS``, ``CAPTURE_API_KEY``, ``AUTH_PROBES``,
``probe_auth``, ``ENGINES``, ``SGLANG_PLATFORM_METRICS``,
``SGLANG_REFERENCE_DIR``, ``SGLANG_CAPTURE_SERVER_FLAGS``, ``reference_dir``,
``repeated_prompt_messages``.

Every reader, writer and diff takes ``engine`` (``"vllm"``, the default, or
``"sglang"``): it picks the metric prefix (``vllm:`` / ``sglang:``), the metrics
the platform reads (``PLATFORM_METRICS`` / ``SGLANG_PLATFORM_METRICS``) and the
reference files' names (``vllm_*`` / ``sglang_*``). SGLang's reference
(``SGLANG_REFERENCE_DIR``) is a capture of real SGLang 0.5.23 on CPU
(``UPDATE_SGLANG_REFERENCE=1 make test-sglang``, ``tests/test_sglang_real.py``);
its README says how.

The reference is a capture of real vLLM (the CPU build serving the tiny Llama),
committed under ``simengine/tests/data/``. ``capture`` sends the same few
requests to any server and keeps the raw bytes; the diffs compare only the shape,
never the values that differ by nature (ids, timestamps, text, latencies):

- metrics: every ``vllm:`` family's type, label names, sample names and histogram
  buckets;
- streams: the order of the chunk kinds (role chunk, content chunks, the chunk that
  finishes, the usage chunk, ``[DONE]``), each kind's nested key set with value
  types, the role chunk's delta, the finish and stop reasons;
- the non-streaming body: its nested key set with value types;
- the engine key (the server started with ``--api-key``): what ``AUTH_PROBES``
  answer, status and, for a refusal, the exact body and content type.

``make test-vllm`` re-captures from a live vLLM and diffs against the reference (a
vLLM upgrade that changes the surface fails there); the ordinary test suite diffs
the simulated replica against the same reference. To record a new reference from a
running server: ``python -m simengine.conformance --url URL --out DIR``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "AUTH_PROBES",
    "CAPTURE_API_KEY",
    "CAPTURE_SERVER_FLAGS",
    "ENGINES",
    "PLATFORM_METRICS",
    "REFERENCE_DIR",
    "SGLANG_CAPTURE_SERVER_FLAGS",
    "SGLANG_PLATFORM_METRICS",
    "SGLANG_REFERENCE_DIR",
    "Capture",
    "MetricShape",
    "capture",
    "diff_json_shapes",
    "diff_metrics",
    "diff_stream",
    "json_shape",
    "metric_shapes",
    "probe_auth",
    "read_capture",
    "reference_dir",
    "repeated_prompt_messages",
    "stream_facts",
    "write_capture",
]

REFERENCE_DIR = Path(__file__).resolve().parent / "tests" / "data"
SGLANG_REFERENCE_DIR = REFERENCE_DIR / "sglang-reference"
ENGINES = ("vllm", "sglang")

# The flags of the server a reference is captured from (and of the simulated
# replica diffed against it), as the node agent runs the tiny model.
CAPTURE_SERVER_FLAGS = (
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "32",
    "--block-size",
    "128",
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
)

# The same for SGLang, with the flags the platform gives it (sglang_launch_argv).
SGLANG_CAPTURE_SERVER_FLAGS = (
    "--context-length",
    "2048",
    "--tp-size",
    "1",
    "--enable-metrics",
    "--enable-cache-report",
)

# The capture server's engine key (VLLM_API_KEY); the capture sends it throughout.
CAPTURE_API_KEY = "sk-capture-engine-key"
# (method, path, credentials) probed for the engine key: none, a wrong key, the
# right key under another scheme, the right key with the scheme in lowercase, and
# the right key. vLLM guards every path under /v1 (an unknown one included) and
# nothing else.
AUTH_PROBES = (
    ("POST", "/v1/chat/completions", "none"),
    ("POST", "/v1/chat/completions", "wrong"),
    ("POST", "/v1/chat/completions", "basic"),
    ("POST", "/v1/chat/completions", "lowercase"),
    ("GET", "/v1/models", "none"),
    ("GET", "/v1/models", "right"),
    ("GET", "/v1/no-such-route", "none"),
    ("GET", "/health", "none"),
    ("GET", "/metrics", "none"),
    ("GET", "/version", "none"),
    ("POST", "/tokenize", "none"),
)

# What ``engine_nodes.domain.scrape`` reads: these must match the reference exactly
# (a router built on our scraper would misread a replica otherwise).
PLATFORM_METRICS = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:generation_tokens",
    }
)

# What engine_nodes.domain.scrape reads from SGLang.
SGLANG_PLATFORM_METRICS = frozenset(
    {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:max_total_num_tokens",
        "sglang:prompt_tokens",
        "sglang:cached_tokens",
        "sglang:generation_tokens",
    }
)
_PLATFORM = {"vllm": PLATFORM_METRICS, "sglang": SGLANG_PLATFORM_METRICS}


def _files(engine: str) -> dict[str, str]:
    """The reference file of each capture part, for ``engine``."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    return {
        "metrics": f"{engine}_metrics.txt",
        "stream": f"{engine}_stream.txt",
        "stream_no_usage": f"{engine}_stream_no_usage.txt",
        "completion": f"{engine}_completion.json",
        "meta": f"{engine}_capture.json",
        "auth": f"{engine}_auth.json",
    }


def reference_dir(engine: str = "vllm") -> Path:
    """Where ``engine``'s reference files are."""
    return SGLANG_REFERENCE_DIR if engine == "sglang" else REFERENCE_DIR


# A system prompt of several 128-token blocks, sent twice, so the capture shows a
# prefix hit (cached_tokens > 0) and non-zero prefix-cache counters.
_LONG_SYSTEM = (
    "You answer questions about the serving platform briefly." + " word" * 400
)


def repeated_prompt_messages(question: str) -> list[dict[str, str]]:
    """The messages of the capture's long prompt, asked as ``"one"`` then
    ``"two"`` (its prefix hit is ``Capture.cached_tokens``)."""
    return [
        {"role": "system", "content": _LONG_SYSTEM},
        {"role": "user", "content": question},
    ]


@dataclass(frozen=True, slots=True)
class Capture:
    """The raw bytes one server answered to the capture requests."""

    metrics: str  # GET /metrics after the requests below
    stream: str  # streaming chat, stream_options.include_usage
    stream_no_usage: str  # streaming chat without include_usage
    completion: str  # non-streaming chat, the raw JSON body
    stream_content_type: str
    # prompt_tokens_details.cached_tokens of the repeated prefix (a hand-written
    # reference may leave it 0: it depends on the tokenizer)
    cached_tokens: int
    # "METHOD path (credentials)" -> {"status"} (+ "body", "content_type" if 401)
    auth: Mapping[str, Any]


def capture(
    url: str, model: str, *, api_key: str = CAPTURE_API_KEY, timeout_s: float = 60.0
) -> Capture:
    """Send the capture requests to the server at ``url`` and keep what it answered.

    The server must demand ``api_key`` (vLLM's ``--api-key``). The same five
    requests every time (two streams, one plain answer, a long prompt twice for a
    prefix hit), then one scrape of ``/metrics``, then ``AUTH_PROBES``.

    Raises:
        httpx.HTTPError: the server is unreachable or answers an error.
    """
    chat = f"{url}/v1/chat/completions"
    hello = [{"role": "user", "content": "Say hello"}]
    auth = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(timeout=timeout_s, headers=auth) as client:

        def stream(body: dict[str, Any]) -> tuple[str, str]:
            with client.stream("POST", chat, json=body) as response:
                response.raise_for_status()
                raw = response.read().decode()
                return raw, response.headers.get("content-type", "")

        base = {"model": model, "temperature": 0, "ignore_eos": True}
        with_usage, content_type = stream(
            {
                **base,
                "messages": hello,
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        no_usage, _ = stream(
            {**base, "messages": hello, "max_tokens": 3, "stream": True}
        )
        answer = client.post(chat, json={**base, "messages": hello, "max_tokens": 3})
        answer.raise_for_status()
        cached = 0
        for question in ("one", "two"):
            repeated = client.post(
                chat,
                json={
                    **base,
                    "messages": repeated_prompt_messages(question),
                    "max_tokens": 2,
                },
            )
            repeated.raise_for_status()
            details = repeated.json()["usage"].get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or 0)
        metrics = client.get(f"{url}/metrics")
        metrics.raise_for_status()
    return Capture(
        metrics=metrics.text,
        stream=with_usage,
        stream_no_usage=no_usage,
        completion=answer.text,
        stream_content_type=content_type,
        cached_tokens=cached,
        auth=probe_auth(url, model, api_key=api_key, timeout_s=timeout_s),
    )


def probe_auth(
    url: str, model: str, *, api_key: str, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Return what the server answers each of ``AUTH_PROBES``."""
    credentials = {
        "none": {},
        "wrong": {"Authorization": "Bearer sk-not-the-key"},
        "basic": {"Authorization": f"Basic {api_key}"},
        "lowercase": {"Authorization": f"bearer {api_key}"},
        "right": {"Authorization": f"Bearer {api_key}"},
    }
    bodies: dict[str, Any] = {
        "/v1/chat/completions": {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 1,
        },
        "/tokenize": {"model": model, "prompt": "Say hello"},
    }
    answers: dict[str, Any] = {}
    with httpx.Client(timeout=timeout_s) as client:
        for method, path, who in AUTH_PROBES:
            response = client.request(
                method, f"{url}{path}", headers=credentials[who], json=bodies.get(path)
            )
            answer: dict[str, Any] = {"status": response.status_code}
            if response.status_code == 401:
                answer["body"] = response.json()
                answer["content_type"] = response.headers.get("content-type", "")
            answers[f"{method} {path} ({who})"] = answer
    return answers


def write_capture(captured: Capture, directory: Path, *, engine: str = "vllm") -> None:
    """Write ``captured`` as ``engine``'s reference files in ``directory``."""
    files = _files(engine)
    directory.mkdir(parents=True, exist_ok=True)
    for field in ("metrics", "stream", "stream_no_usage", "completion"):
        (directory / files[field]).write_text(getattr(captured, field))
    meta = {
        "stream_content_type": captured.stream_content_type,
        "cached_tokens": captured.cached_tokens,
    }
    (directory / files["meta"]).write_text(json.dumps(meta, indent=2) + "\n")
    (directory / files["auth"]).write_text(
        json.dumps(dict(captured.auth), indent=2) + "\n"
    )


def read_capture(directory: Path | None = None, *, engine: str = "vllm") -> Capture:
    """Read ``engine``'s reference files (written by ``write_capture``, or by
    hand) from ``directory`` (default: ``reference_dir(engine)``)."""
    files = _files(engine)
    if directory is None:
        directory = reference_dir(engine)
    meta = json.loads((directory / files["meta"]).read_text())
    return Capture(
        metrics=(directory / files["metrics"]).read_text(),
        stream=(directory / files["stream"]).read_text(),
        stream_no_usage=(directory / files["stream_no_usage"]).read_text(),
        completion=(directory / files["completion"]).read_text(),
        stream_content_type=meta["stream_content_type"],
        cached_tokens=int(meta.get("cached_tokens") or 0),
        auth={
            name: answer
            for name, answer in json.loads(
                (directory / files["auth"]).read_text()
            ).items()
            if not name.startswith("_")  # notes on where the file came from
        },
    )


# -- metrics ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MetricShape:
    """One metric family as a scraper sees it, values left out."""

    type: str
    label_names: frozenset[str]
    sample_names: frozenset[str]
    buckets: tuple[float, ...] = ()


def metric_shapes(text: str, *, engine: str = "vllm") -> dict[str, MetricShape]:
    """Return the shape of every ``vllm:`` (``sglang:``) family in an exposition
    text.

    Label names are the union over the family's samples, without ``le``; buckets are
    the ``le`` bounds of a histogram's first series. prometheus_client writes a
    counter's or histogram's ``_created`` series as a gauge family of its own; it
    is folded back into its family (as one more sample name).
    """
    shapes: dict[str, MetricShape] = {}
    prefix = f"{engine}:"
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(prefix):
            continue
        labels: set[str] = set()
        names: set[str] = set()
        buckets: list[float] = []
        first_series: dict[str, str] | None = None
        for sample in family.samples:
            names.add(sample.name)
            labels.update(k for k in sample.labels if k != "le")
            if sample.name.endswith("_bucket"):
                series = {k: v for k, v in sample.labels.items() if k != "le"}
                if first_series is None:
                    first_series = series
                if series == first_series:
                    buckets.append(float(sample.labels["le"]))
        shapes[family.name] = MetricShape(
            type=family.type,
            label_names=frozenset(labels),
            sample_names=frozenset(names),
            buckets=tuple(buckets),
        )
    for name in [n for n in shapes if n.endswith("_created")]:
        base = shapes.get(name.removesuffix("_created"))
        if base is not None and shapes[name].type == "gauge":
            created = shapes.pop(name)
            shapes[name.removesuffix("_created")] = MetricShape(
                type=base.type,
                label_names=base.label_names,
                sample_names=base.sample_names | created.sample_names,
                buckets=base.buckets,
            )
    return shapes


def diff_metrics(
    reference: str,
    candidate: str,
    *,
    allowed_missing: Mapping[str, str] | None = None,
    engine: str = "vllm",
) -> list[str]:
    """Return how ``candidate``'s ``vllm:`` (``sglang:``) metrics differ from
    ``reference``'s.

    Every reference family must be in the candidate with the same type, label
    names, sample names and buckets, unless ``allowed_missing`` names it (with the
    reason it is left out); the platform's own metrics (``PLATFORM_METRICS``) can
    never be left out. A candidate family the reference lacks is a difference, and
    so is an allowance for a family the candidate does have or the reference lacks
    (stale allowances hide drift).
    """
    allowed = dict(allowed_missing or {})
    ref = metric_shapes(reference, engine=engine)
    got = metric_shapes(candidate, engine=engine)
    platform = _PLATFORM[engine]
    problems: list[str] = []
    for name in sorted(platform):
        if name not in ref:
            problems.append(f"{name}: read by the platform, absent from the reference")
        if name in allowed:
            problems.append(f"{name}: read by the platform, cannot be allowed missing")
    for name, shape in sorted(ref.items()):
        if name not in got:
            if name not in allowed or name in platform:
                problems.append(f"{name}: missing ({shape.type})")
            continue
        if name in allowed:
            problems.append(f"{name}: allowed missing but present; drop the allowance")
        mine = got[name]
        if mine.type != shape.type:
            problems.append(f"{name}: type {mine.type}, reference {shape.type}")
        if mine.label_names != shape.label_names:
            problems.append(
                f"{name}: labels {sorted(mine.label_names)}, "
                f"reference {sorted(shape.label_names)}"
            )
        if mine.sample_names != shape.sample_names:
            problems.append(
                f"{name}: samples {sorted(mine.sample_names)}, "
                f"reference {sorted(shape.sample_names)}"
            )
        if mine.buckets != shape.buckets:
            problems.append(
                f"{name}: buckets {list(mine.buckets)}, reference {list(shape.buckets)}"
            )
    for name in sorted(set(got) - set(ref)):
        problems.append(f"{name}: not in the reference ({engine} has no such metric)")
    for name in sorted(set(allowed) - set(ref)):
        problems.append(f"{name}: allowed missing but not in the reference")
    return problems


# -- JSON and SSE ----------------------------------------------------------------------


def json_shape(value: Any) -> Any:
    """Return ``value`` with every leaf replaced by its JSON type name.

    Objects keep their keys; a list becomes the shape of its first item (``[]`` if
    empty). ``{"a": 1, "b": [{"c": None}]}`` -> ``{"a": "int", "b": [{"c": "null"}]}``.
    """
    if isinstance(value, Mapping):
        return {key: json_shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_shape(value[0])] if value else []
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "str"


def diff_json_shapes(reference: Any, candidate: Any, path: str = "$") -> list[str]:
    """Return where two ``json_shape`` results differ (missing/extra keys, types)."""
    if isinstance(reference, dict) and isinstance(candidate, dict):
        problems = [
            f"{path}.{key}: missing" for key in reference if key not in candidate
        ]
        problems += [
            f"{path}.{key}: extra" for key in candidate if key not in reference
        ]
        for key in reference:
            if key in candidate:
                problems += diff_json_shapes(
                    reference[key], candidate[key], f"{path}.{key}"
                )
        return problems
    if isinstance(reference, list) and isinstance(candidate, list):
        if reference and candidate:
            return diff_json_shapes(reference[0], candidate[0], f"{path}[0]")
        if bool(reference) != bool(candidate):
            return [f"{path}: {candidate!r}, reference {reference!r}"]
        return []
    if reference != candidate:
        return [f"{path}: {candidate!r}, reference {reference!r}"]
    return []


def _events(raw: str) -> tuple[list[Any], list[str]]:
    """Split SSE bytes into decoded ``data:`` payloads (``"[DONE]"`` kept as text)."""
    problems = []
    if not raw.endswith("\n\n"):
        problems.append("the stream does not end with a blank line")
    events: list[Any] = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        if not block.startswith("data: ") or "\n" in block:
            problems.append(f"not one 'data: ' line: {block[:60]!r}")
            continue
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events, problems


def _kind(event: Any) -> str:
    if event == "[DONE]":
        return "done"
    choices = event.get("choices")
    if choices == []:
        return "usage"
    choice = choices[0]
    if "role" in choice.get("delta", {}):
        return "role"
    if choice.get("finish_reason") is not None:
        return "finish"
    return "content"


def stream_facts(raw: str) -> dict[str, Any]:
    """Return what a stream's shape is made of.

    ``order``: the chunk kinds in order, a run of content chunks as one
    ``content*`` (vLLM may put several tokens in one chunk, or all of them in the
    chunk that finishes); ``shapes``: per kind, the distinct ``json_shape``s of its
    chunks; ``role_delta``, ``finish_reason``, ``stop_reason``, ``finish_delta``,
    ``matched_stop``: the exact values (SGLang finishes with an empty delta and
    a ``matched_stop``; vLLM has neither key: None); ``problems``: framing errors.
    """
    events, problems = _events(raw)
    order: list[str] = []
    shapes: dict[str, list[Any]] = {}
    facts: dict[str, Any] = {}
    for event in events:
        kind = _kind(event)
        label = "content*" if kind == "content" else kind
        if not order or order[-1] != label or kind != "content":
            order.append(label)
        if kind == "done":
            continue
        shape = json_shape(event)
        known = shapes.setdefault(kind, [])
        if shape not in known:
            known.append(shape)
        choice = event["choices"][0] if event["choices"] else {}
        if kind == "role":
            facts["role_delta"] = choice["delta"]
        elif kind == "finish":
            facts["finish_reason"] = choice["finish_reason"]
            facts["stop_reason"] = choice.get("stop_reason")
            facts["matched_stop"] = choice.get("matched_stop")
            facts["finish_delta"] = (
                choice.get("delta") if choice.get("delta") == {} else "non-empty"
            )
    ids = {e["id"] for e in events if isinstance(e, dict)}
    if len(ids) > 1:
        problems.append(f"chunks carry {len(ids)} different ids")
    return {**facts, "order": order, "shapes": shapes, "problems": problems}


def diff_stream(reference: str, candidate: str) -> list[str]:
    """Return how a candidate stream's shape differs from the reference's.

    The content run is optional on both sides (several tokens may ride on the
    chunk that finishes), so it is dropped before the order is compared.
    """
    ref = stream_facts(reference)
    got = stream_facts(candidate)
    problems = [f"candidate: {p}" for p in got["problems"]]
    problems += [f"reference: {p}" for p in ref["problems"]]
    ref_order = [k for k in ref["order"] if k != "content*"]
    got_order = [k for k in got["order"] if k != "content*"]
    if got_order != ref_order:
        problems.append(f"chunk order {got['order']}, reference {ref['order']}")
    for key in ("role_delta", "finish_reason", "stop_reason", "matched_stop"):
        if got.get(key) != ref.get(key):
            problems.append(f"{key} {got.get(key)!r}, reference {ref.get(key)!r}")
    for kind, ref_shapes in ref["shapes"].items():
        got_shapes = got["shapes"].get(kind, [])
        if not got_shapes:
            if kind != "content":
                problems.append(f"no {kind} chunk")
            continue
        for shape in got_shapes:
            # Any one of the reference's shapes of that kind will do.
            diffs = min((diff_json_shapes(r, shape, kind) for r in ref_shapes), key=len)
            problems += diffs
    for kind in set(got["shapes"]) - set(ref["shapes"]):
        if kind != "content":
            problems.append(f"{kind} chunk not in the reference")
    return problems


def _main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Capture a server's reference files.")
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--engine", choices=ENGINES, default="vllm")
    parser.add_argument(
        "--api-key", default=CAPTURE_API_KEY, help="The key the server demands."
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    write_capture(
        capture(args.url, args.model, api_key=args.api_key),
        args.out if args.out is not None else reference_dir(args.engine),
        engine=args.engine,
    )


if __name__ == "__main__":
    _main()

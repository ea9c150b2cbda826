"""Record what a server answers on the OpenAI surfaces beyond plain chat.

Public surface: ``Case``, ``CASES``, ``Answer``, ``TOOLS``, ``WEATHER_SCHEMA``,
``capture_surfaces``, ``write_surfaces``, ``read_surfaces``, ``surface_shape``,
``SURFACES_DIR``.

``simengine.conformance`` holds plain chat, metrics and the engine key to real
vLLM; this module does the same for tools (``tool_choice`` named, ``required``,
``auto``, tool history), structured output (``response_format``), ``n > 1``,
``/v1/completions`` (string, list, token ids, echo, logprobs, suffix),
``/tokenize`` with tools and ``/v1/responses`` (plain, streamed, a function tool,
``previous_response_id``, ``store``). Each case is one request, kept as the raw
bytes the server answered (SSE text as received, JSON bodies as sent), one file
per case, with an ``index.json`` of each case's request, status and content type.

The committed capture (``SURFACES_DIR``) is of real vLLM 0.32.0 (CPU build, the
tiny random-weight Llama, ``--enable-auto-tool-choice --tool-call-parser
hermes``); ``tests/test_vllm_surfaces.py`` re-captures from a live server and
diffs the shapes. To record again from a running server:
``python -m simengine.surface_capture URL MODEL OUTDIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from simengine.conformance import json_shape

__all__ = [
    "CASES",
    "SURFACES_DIR",
    "TOOLS",
    "WEATHER_SCHEMA",
    "Answer",
    "Case",
    "capture_surfaces",
    "read_surfaces",
    "surface_shape",
    "write_surfaces",
]

SURFACES_DIR = Path(__file__).resolve().parent / "tests" / "data" / "vllm_surfaces"

# A schema whose every valid instance is short (an enum and a small integer), so a
# random-weight model under guided decoding finishes within a few tokens.
WEATHER_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
# ``strict: true``: vLLM 0.32 pins a tool's arguments to its schema only for a
# strict tool (or under ``--tool-strict-level parameter``); a named call to a
# non-strict tool gets any JSON value as arguments (``chat_tool_named_nonstrict``).
TOOLS: Sequence[Mapping[str, Any]] = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city.",
            "parameters": WEATHER_SCHEMA,
            "strict": True,
        },
    },
)
_NONSTRICT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city.",
            "parameters": WEATHER_SCHEMA,
        },
    }
]
_NAMED = {"type": "function", "function": {"name": "get_weather"}}
_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
_HISTORY = [
    *_ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "days": 1}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "Sunny, 21 C"},
]
_RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast of a city.",
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}


@dataclass(frozen=True, slots=True)
class Case:
    """One request: ``body`` is sent as JSON (``None``: a GET).

    A string value ``"@NAME.id"`` in ``body`` is replaced by the ``id`` of case
    NAME's JSON answer (``previous_response_id``), captured earlier.
    """

    name: str
    path: str
    body: Mapping[str, Any] | None
    stream: bool = False
    note: str = ""

    @property
    def file(self) -> str:
        return f"{self.name}.sse" if self.stream else f"{self.name}.json"


@dataclass(frozen=True, slots=True)
class Answer:
    """What the server answered one case."""

    status: int
    content_type: str
    raw: str
    request: Mapping[str, Any] = field(default_factory=dict)


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "temperature": 0, "max_tokens": 48, **extra}


def _cases(model: str) -> tuple[Case, ...]:
    """The capture's requests for ``model``, in the order they are sent."""
    usage = {"include_usage": True}
    tools = [dict(t) for t in TOOLS]
    schema = {"name": "weather", "schema": dict(WEATHER_SCHEMA), "strict": True}
    cases = [
        Case("chat_tool_named", "/v1/chat/completions",
             _chat(model, messages=_ASK, tools=tools, tool_choice=_NAMED)),
        Case("chat_tool_named_stream", "/v1/chat/completions",
             _chat(model, messages=_ASK, tools=tools, tool_choice=_NAMED,
                   stream=True, stream_options=usage), stream=True),
        Case("chat_tool_named_nonstrict", "/v1/chat/completions",
             _chat(model, messages=_ASK, tools=_NONSTRICT_TOOLS, tool_choice=_NAMED),
             note="the tool without strict: its arguments are not pinned"),
        Case("chat_tool_required", "/v1/chat/completions",
             _chat(model, messages=_ASK, tools=tools, tool_choice="required",
                   parallel_tool_calls=False, max_tokens=96),
             note="parallel_tool_calls false: one call (else the array runs on)"),
        Case("chat_tool_required_stream", "/v1/chat/completions",
             _chat(model, messages=_ASK, tools=tools, tool_choice="required",
                   parallel_tool_calls=False, max_tokens=96, stream=True,
                   stream_options=usage), stream=True),
        Case("chat_tool_auto", "/v1/chat/completions",
             _chat(model, messages=_ASK, tools=tools, tool_choice="auto",
                   max_tokens=8)),
        Case("chat_tool_auto_stream", "/v1/chat/completions",
             _chat(model, messages=_ASK, tools=tools, tool_choice="auto",
                   max_tokens=8, stream=True, stream_options=usage), stream=True),
        Case("chat_tool_history", "/v1/chat/completions",
             _chat(model, messages=_HISTORY, tools=tools, max_tokens=8)),
        Case("tokenize_tool_history", "/tokenize",
             {"model": model, "messages": _HISTORY, "tools": tools},
             note="/tokenize of chat_tool_history's messages with its tools"),
        Case("tokenize_tool_history_no_tools", "/tokenize",
             {"model": model, "messages": _HISTORY}),
        Case("chat_json_schema", "/v1/chat/completions",
             _chat(model, messages=_ASK,
                   response_format={"type": "json_schema", "json_schema": schema})),
        Case("chat_json_schema_stream", "/v1/chat/completions",
             _chat(model, messages=_ASK,
                   response_format={"type": "json_schema", "json_schema": schema},
                   stream=True, stream_options=usage), stream=True),
        Case("chat_json_object", "/v1/chat/completions",
             _chat(model, messages=_ASK, response_format={"type": "json_object"},
                   max_tokens=16)),
        Case("chat_n3_greedy", "/v1/chat/completions",
             _chat(model, messages=_ASK, n=3, max_tokens=4),
             note="n > 1 at temperature 0: refused"),
        Case("chat_n3", "/v1/chat/completions",
             _chat(model, messages=_ASK, n=3, max_tokens=4, temperature=1.0,
                   seed=7)),
        Case("chat_n3_stream", "/v1/chat/completions",
             _chat(model, messages=_ASK, n=3, max_tokens=4, temperature=1.0,
                   seed=7, stream=True, stream_options=usage), stream=True),
        Case("completion_string", "/v1/completions",
             _chat(model, prompt="def hello():", max_tokens=4)),
        Case("completion_string_stream", "/v1/completions",
             _chat(model, prompt="def hello():", max_tokens=4, stream=True,
                   stream_options=usage), stream=True),
        Case("completion_list", "/v1/completions",
             _chat(model, prompt=["def hello():", "import os"], max_tokens=3)),
        Case("completion_list_stream", "/v1/completions",
             _chat(model, prompt=["def hello():", "import os"], max_tokens=3,
                   stream=True, stream_options=usage), stream=True),
        Case("completion_token_ids", "/v1/completions",
             _chat(model, prompt=[1, 2, 3, 4], max_tokens=3)),
        Case("completion_echo", "/v1/completions",
             _chat(model, prompt="def hello():", max_tokens=3, echo=True)),
        Case("completion_logprobs", "/v1/completions",
             _chat(model, prompt="def hello():", max_tokens=3, logprobs=2)),
        Case("completion_logprobs_stream", "/v1/completions",
             _chat(model, prompt="def hello():", max_tokens=3, logprobs=2,
                   stream=True), stream=True),
        Case("completion_suffix", "/v1/completions",
             _chat(model, prompt="def hello():", max_tokens=3, suffix="x")),
        Case("responses_string", "/v1/responses",
             {"model": model, "input": "Say hello", "temperature": 0,
              "max_output_tokens": 8}),
        Case("responses_stream", "/v1/responses",
             {"model": model, "input": "Say hello", "temperature": 0,
              "max_output_tokens": 4, "stream": True}, stream=True),
        Case("responses_tool_named", "/v1/responses",
             {"model": model, "input": "What is the weather in Paris?",
              "temperature": 0, "max_output_tokens": 48,
              "tools": [_RESPONSES_TOOL],
              "tool_choice": {"type": "function", "name": "get_weather"}}),
        Case("responses_store_true", "/v1/responses",
             {"model": model, "input": "Say hello", "temperature": 0,
              "max_output_tokens": 4, "store": True}),
        Case("responses_store_false", "/v1/responses",
             {"model": model, "input": "Say hello", "temperature": 0,
              "max_output_tokens": 4, "store": False}),
        Case("responses_previous_id", "/v1/responses",
             {"model": model, "input": "And again", "temperature": 0,
              "max_output_tokens": 4,
              "previous_response_id": "@responses_store_true.id"},
             note="previous_response_id = responses_store_true's id"),
        Case("responses_previous_id_unstored", "/v1/responses",
             {"model": model, "input": "And again", "temperature": 0,
              "max_output_tokens": 4,
              "previous_response_id": "@responses_store_false.id"},
             note="previous_response_id = responses_store_false's id"),
        Case("responses_get_stored", "/v1/responses/@responses_store_true.id",
             None, note="GET of responses_store_true's id"),
        Case("responses_get_unstored", "/v1/responses/@responses_store_false.id",
             None, note="GET of responses_store_false's id"),
    ]  # fmt: skip
    return tuple(cases)


CASES = _cases("tiny-llama")


def _resolve(value: Any, answers: Mapping[str, Answer]) -> Any:
    if isinstance(value, str) and "@" in value:
        head, _, ref = value.partition("@")
        name, _, rest = ref.partition(".id")
        answer = answers.get(name)
        found = ""
        if answer is not None and answer.status == 200:
            found = str(json.loads(answer.raw).get("id", ""))
        return f"{head}{found or 'missing'}{rest}"
    if isinstance(value, Mapping):
        return {key: _resolve(item, answers) for key, item in value.items()}
    if isinstance(value, list):
        return [_resolve(item, answers) for item in value]
    return value


def capture_surfaces(
    url: str,
    model: str,
    *,
    api_key: str = "",
    timeout_s: float = 120.0,
    only: Iterable[str] | None = None,
) -> dict[str, Answer]:
    """Send every case (or those named in ``only``) to ``url``; keep the answers.

    Errors are answers too (their status and body are kept); only an unreachable
    server raises (``httpx.HTTPError``).
    """
    wanted = set(only) if only is not None else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    answers: dict[str, Answer] = {}
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        for case in _cases(model):
            if wanted is not None and case.name not in wanted:
                continue
            path = _resolve(case.path, answers)
            body = _resolve(case.body, answers) if case.body is not None else None
            method = "GET" if body is None else "POST"
            with client.stream(method, f"{url}{path}", json=body) as response:
                raw = response.read().decode()
            answers[case.name] = Answer(
                status=response.status_code,
                content_type=response.headers.get("content-type", ""),
                raw=raw,
                request={"method": method, "path": path, "body": body},
            )
    return answers


def write_surfaces(answers: Mapping[str, Answer], directory: Path) -> None:
    """Write each answer's raw bytes to its case file and its entry in
    ``index.json`` (the entries of cases not in ``answers`` are kept)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {case.name: case for case in CASES}
    index_file = directory / "index.json"
    index: dict[str, Any] = {}
    if index_file.exists():
        index = json.loads(index_file.read_text())
    for name, answer in answers.items():
        case = files[name]
        (directory / case.file).write_text(answer.raw)
        index[name] = {
            "file": case.file,
            "status": answer.status,
            "content_type": answer.content_type,
            "request": dict(answer.request),
            **({"note": case.note} if case.note else {}),
        }
    ordered = {case.name: index[case.name] for case in CASES if case.name in index}
    index_file.write_text(json.dumps(ordered, indent=2) + "\n")


def read_surfaces(directory: Path = SURFACES_DIR) -> dict[str, Answer]:
    """Read a capture written by ``write_surfaces``."""
    index = json.loads((directory / "index.json").read_text())
    return {
        name: Answer(
            status=int(entry["status"]),
            content_type=str(entry["content_type"]),
            raw=(directory / entry["file"]).read_text(),
            request=entry["request"],
        )
        for name, entry in index.items()
    }


def _sse_payloads(raw: str) -> list[Any]:
    """Decode an SSE body's ``data:`` payloads (``"[DONE]"`` kept as text); an
    ``event:`` line is kept as ``{"event": name}`` before its data."""
    events: list[Any] = []
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("event: "):
                events.append({"event": line.removeprefix("event: ")})
            elif line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def surface_shape(answer: Answer) -> dict[str, Any]:
    """The shape of an answer: status, content type and the JSON shapes.

    For a stream, the distinct shapes of its events in order of first sight (a
    Responses stream keyed by each event's ``type``), and whether it ends with
    ``[DONE]``.
    """
    shape: dict[str, Any] = {
        "status": answer.status,
        "content_type": answer.content_type.split(";")[0],
    }
    if "text/event-stream" not in answer.content_type:
        shape["body"] = json_shape(json.loads(answer.raw)) if answer.raw else None
        return shape
    events = _sse_payloads(answer.raw)
    shape["done"] = bool(events) and events[-1] == "[DONE]"
    kinds: dict[str, list[Any]] = {}
    for event in events:
        if not isinstance(event, dict) or ("event" in event and len(event) == 1):
            continue
        key = str(event.get("type") or event.get("object") or "chunk")
        seen = kinds.setdefault(key, [])
        item = json_shape(event)
        if item not in seen:
            seen.append(item)
    shape["events"] = kinds
    return shape


def _main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("model")
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--api-key", default="")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args(list(argv) if argv is not None else None)
    answers = capture_surfaces(
        args.url, args.model, api_key=args.api_key, only=args.only
    )
    write_surfaces(answers, args.outdir)
    for name, answer in answers.items():
        sys.stdout.write(f"{answer.status} {name}\n")


if __name__ == "__main__":
    _main()

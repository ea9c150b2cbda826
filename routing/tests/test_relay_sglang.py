"""The relay and the answer's end on SGLang's stream, which differs from vLLM's.

SGLang's OpenAI server (``python/sglang/srt/entrypoints/openai/serving_chat.py``,
``sse_utils.py``, ``usage_processor.py``; 0.5.23 as captured in
``simengine/tests/data/sglang-reference/``) streams a role chunk, content
chunks whose choices carry ``"matched_stop":null``, then a *separate* finish chunk
with no content, then (``stream_options.include_usage``, which the gateway always
asks for) a usage chunk dumped with its nulls, then ``[DONE]``. Its usage says
``"prompt_tokens_details":null`` without ``--enable-cache-report`` (and, in its
newer source, also when nothing was cached), where vLLM always gives
``{"cached_tokens": N}``. The gateway's final event must say ``cached_tokens`` as
an integer either way: 0 for SGLang's null, N otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from routing.responses import FinalUsage, final_event, whole_answer
from routing.tests.test_relay import Run, cut

CHUNK_ID = "3f0c2a7e9b1d4e5f8a6b7c8d9e0f1a2b"


def sglang_chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    body = {
        "id": CHUNK_ID,
        "object": "chat.completion.chunk",
        "created": 1764700000,
        "model": "chat-7b",
        "choices": choices,
        **extra,
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": None,
    }


def sglang_stream(details: dict[str, int] | None) -> tuple[bytes, list[bytes]]:
    """Return an SGLang stream of three tokens and its token events."""
    tokens = [
        sglang_chunk([choice({"role": "assistant", "content": ""})]),
        *(sglang_chunk([choice({"content": word})]) for word in ("Hi", " there", "!")),
        sglang_chunk([choice({}, finish="stop")]),
    ]
    usage = {
        "prompt_tokens": 1200,
        "total_tokens": 1203,
        "completion_tokens": 3,
        "prompt_tokens_details": details,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }
    tail = sglang_chunk([], usage=usage, sglext=None) + b"data: [DONE]\n\n"
    return b"".join(tokens) + tail, tokens


@pytest.mark.parametrize(
    ("details", "cached"), [(None, 0), ({"cached_tokens": 1187}, 1187)]
)
@pytest.mark.parametrize("size", [1, 13, 200, 10_000])
def test_sglangs_stream_ends_with_the_right_cached_tokens(
    details: dict[str, int] | None, cached: int, size: int
) -> None:
    """GIVEN SGLang's stream, cut at any size, with or without cached tokens
    WHEN the gateway relays it and builds the final event
    THEN every token event (the separate finish chunk too) reaches the client
    byte for byte, SGLang's usage chunk does not, and the final event says
    cached_tokens as an integer: 0 for SGLang's null details."""
    stream, tokens = sglang_stream(details)
    run = Run(cut(stream, size))

    assert run.is_done is True
    assert run.body == b"".join(tokens)
    assert b'"choices":[]' not in run.body
    usage = FinalUsage.of(run.outcome, prompt_tokens=9)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (
        1200,
        cached,
        3,
    )
    end = final_event(
        answer_id=CHUNK_ID,
        model_ref="chat-7b",
        version="v4",
        region="r1",
        replica_id="rep-1",
        usage=usage,
    )
    final = json.loads(end.split(b"\n\n", 1)[0].removeprefix(b"data: "))
    assert final["usage"]["cached_tokens"] == cached
    assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


def test_a_whole_answer_from_sglang_takes_the_finish_from_its_own_chunk() -> None:
    """SGLang's last content chunk has no finish reason; its finish chunk has no
    text. The whole answer has the text of the one and the reason of the other."""
    stream, _ = sglang_stream({"cached_tokens": 16})
    body = stream.replace(b'"finish_reason":"stop"', b'"finish_reason":"length"')
    run = Run(cut(body, 7), stream=False)

    answer = json.loads(
        whole_answer(
            answer_id=CHUNK_ID,
            model_ref="chat-7b",
            version="v4",
            region="r1",
            replica_id="rep-1",
            outcome=run.outcome,
            usage=FinalUsage.of(run.outcome, prompt_tokens=9),
        )
    )
    assert answer["choices"][0]["message"]["content"] == "Hi there!"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["cached_tokens"] == 16


REFERENCE = (
    Path(__file__).resolve().parents[2]
    / "simengine/tests/data/sglang-reference/sglang_stream.txt"
)


@pytest.mark.parametrize("size", [1, 64, 100_000])
def test_the_sglang_reference_stream_relays_with_its_usage(size: int) -> None:
    """The reference the simulated SGLang replica is held to (captured from real
    SGLang 0.5.23) relays as the hand-built stream above: its token events untouched, its
    usage chunk kept back, its cached tokens carried to the final event."""
    stream = REFERENCE.read_bytes()
    events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    usage = json.loads(next(e for e in events if b'"choices":[]' in e)[6:])["usage"]
    run = Run(cut(stream, size))

    assert run.is_done is True
    assert run.body == b"".join(e for e in events if b'"choices":[{' in e)
    final = FinalUsage.of(run.outcome, prompt_tokens=1)
    assert (final.prompt_tokens, final.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    cached = (usage["prompt_tokens_details"] or {}).get("cached_tokens") or 0
    assert final.cached_tokens == cached

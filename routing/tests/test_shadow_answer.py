"""Reading a shadow answer whole: first token, length, refusal, how it failed."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from metering.domain.figures import one_request
from routing.domain.refusals import RefusalDetector
from routing.shadow import ShadowAnswer, read_shadow_answer

CAPTURE = Path(__file__).resolve().parents[2] / "simengine/tests/data/vllm_stream.txt"
STREAM = CAPTURE.read_bytes()
EVENTS = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]
TOKEN_EVENTS = [e for e in EVENTS if b'"choices":[{' in e]
ROLE = TOKEN_EVENTS[0]


def _content(text: str) -> bytes:
    return (
        b'data: {"id":"x","choices":[{"index":0,"delta":{"content":'
        + f'"{text}"'.encode()
        + b'},"finish_reason":null}]}\n\n'
    )


async def _chunks(
    parts: list[bytes], error: BaseException | None = None
) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
    if error is not None:
        raise error


def _read(parts: list[bytes], error: BaseException | None = None) -> ShadowAnswer:
    ticks = itertools.count(1)
    return asyncio.run(read_shadow_answer(_chunks(parts, error), lambda: next(ticks)))


@pytest.mark.parametrize("size", [1, 5, 100, len(STREAM)])
def test_a_whole_answer_has_its_usage_length_and_first_token(size: int) -> None:
    answer = _read([STREAM[i : i + size] for i in range(0, len(STREAM), size)])
    assert answer.error_kind is None
    assert answer.first_token_at == 1
    usage_tokens = 5  # the capture's usage chunk (max_tokens 5)
    assert answer.output_tokens == usage_tokens
    assert answer.text.startswith("shutdown")


def test_without_a_usage_chunk_content_events_are_counted() -> None:
    answer = _read([ROLE, _content("I am"), _content(" sorry"), b"data: [DONE]\n\n"])
    assert (answer.output_tokens, answer.error_kind) == (2, None)
    figures = answer.figures(started=0.5, detector=RefusalDetector())
    assert figures == one_request(ttft_s=0.5, output_tokens=2, refused=True)


@pytest.mark.parametrize(
    ("parts", "error", "kind"),
    [
        ([b'data: {"error": {"message": "boom"}}\n\n'], None, "upstream"),
        ([ROLE, _content("a"), b'data: {"error": {"code": 500}}\n\n'], None, "broken"),
        ([ROLE, _content("a")], None, "broken"),  # ended without [DONE]
        ([], None, "upstream"),
        ([b"data: [DONE]\n\n"], None, "upstream"),
        ([], TimeoutError(), "timeout"),
        ([ROLE], TimeoutError(), "broken"),
        ([], aiohttp.ClientPayloadError("cut"), "upstream"),
        ([ROLE, _content("a")], ConnectionResetError(), "broken"),
    ],
)
def test_failed_answers_are_errors_by_kind(
    parts: list[bytes], error: BaseException | None, kind: str
) -> None:
    answer = _read(parts, error)
    assert answer.error_kind == kind
    figures = answer.figures(started=0.0, detector=RefusalDetector())
    assert figures.errors == {kind: 1}
    assert figures.answered == 0

"""What the gateway answers when a body is hostile or the gateway itself fails.

In process (``embedded_gateway``), so a test can look at what a user cannot: the
limiter's buckets and slots, the usage counter, the log. The same probes are sent
to a real gateway process in ``test_gateway_e2e.py``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from localrun.processes import Process, sim_replica
from routing import attempt as attempt_module
from routing.domain.snapshot import VersionRecord
from routing.prompt_tokens import VersionCounters
from routing.tests.embedded_gateway import MODEL, EmbeddedGateway
from routing.tests.hostile_bodies import HOSTILE

SECRET = "the secret prompt text"


def assert_openai_error(answer: Any, status: int) -> dict[str, Any]:
    assert answer.status == status, answer.body[:300]
    assert answer.headers["content-type"] == "application/json"
    document = answer.json()
    assert set(document) == {"error"}
    error: dict[str, Any] = document["error"]
    assert set(error) == {"type", "message", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.fixture
def gateway() -> Iterator[EmbeddedGateway]:
    with EmbeddedGateway() as embedded:
        yield embedded


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    with sim_replica(tmp_path_factory.mktemp("sim"), model=MODEL) as process:
        yield process


@pytest.mark.parametrize(
    ("body", "param"),
    [pytest.param(body, param, id=name) for name, body, param in HOSTILE],
)
def test_hostile_bodies_are_400s_before_admission(
    gateway: EmbeddedGateway, body: str, param: str
) -> None:
    answer = gateway.request("/v1/chat/completions", body.encode())

    error = assert_openai_error(answer, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    # Refused before admission: no bucket charged, no slot taken, nothing metered.
    assert not gateway.is_charged()
    assert gateway.metered() == {}


class FailingCounters(VersionCounters):
    """Prompt counting that fails with the prompt in its message (a bug)."""

    async def encode(
        self,
        version: VersionRecord | None,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        raise KeyError(f"no such token in {messages[0]['content']}")


def test_an_unexpected_error_is_a_json_500_logged_without_prompt_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with EmbeddedGateway(counters=FailingCounters()) as gateway:
        caplog.set_level(logging.INFO)
        answer = gateway.request(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": SECRET}]},
        )

    error = assert_openai_error(answer, 500)
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert SECRET not in answer.body.decode()
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "unhandled KeyError on POST /v1/chat/completions" in logged
    assert "plan_chat" in logged  # where it failed, for whoever fixes it
    assert SECRET not in logged
    # No traceback with the exception's message (asyncio logs exc_info=False).
    assert not any(record.exc_info for record in caplog.records)


def test_an_unexpected_error_mid_stream_ends_it_with_an_error_event(
    replica: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_final_event(**kwargs: object) -> bytes:
        raise RuntimeError("a bug in the answer's end")

    monkeypatch.setattr(attempt_module, "final_event", broken_final_event)
    with EmbeddedGateway(replica.url) as gateway:
        answer = gateway.request(
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
                "stream": True,
                "ignore_eos": True,
            },
        )
        metered = gateway.metered()

    assert answer.status == 200  # the stream had started
    events = answer.events()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    content = [json.loads(e) for e in events[:-2]]
    assert content and all(chunk["choices"] for chunk in content)
    # The answer's usage was still counted: the failure came after it was known.
    assert sum(counts.requests for counts in metered.values()) == 1


def test_stream_without_usage_is_still_metered(replica: Process) -> None:
    with EmbeddedGateway(replica.url) as gateway:
        answer = gateway.request(
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": False},
                "ignore_eos": True,
            },
        )
        metered = gateway.metered()

    assert answer.status == 200
    events = answer.events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(chunk["choices"] and "usage" not in chunk for chunk in chunks)
    assert {chunk["id"] for chunk in chunks} == {answer.headers["x-request-id"]}
    (counts,) = metered.values()
    assert (counts.requests, counts.output_tokens) == (1, 5)


def test_tokenize_is_not_charged_or_metered(replica: Process) -> None:
    with EmbeddedGateway(replica.url) as gateway:
        answer = gateway.request("/tokenize", {"model": MODEL, "prompt": "hello"})

        assert answer.status == 200, answer.body
        assert answer.json()["count"] > 0
        assert not gateway.is_charged()
        assert gateway.metered() == {}


@pytest.mark.parametrize(
    ("path", "method", "key", "body", "status", "param"),
    [
        ("/tokenize", "GET", "team", b"", 405, None),
        ("/tokenize", "POST", None, b"{}", 401, None),
        ("/tokenize", "POST", "team", b'{"model":"nope","prompt":"x"}', 404, "model"),
        ("/tokenize", "POST", "team", b'{"model":"chat-7b"}', 400, "prompt"),
        ("/tokenize", "POST", "team", b'{"model":"chat-7b","prompt":"\\udfff"}', 400, "prompt"),
        ("/tokenize", "POST", "team", b'{"model":"chat-7b","prompt":"x"}', 503, None),
    ],
)  # fmt: skip
def test_tokenize_errors_are_openai_errors(
    gateway: EmbeddedGateway,
    path: str,
    method: str,
    key: str | None,
    body: bytes,
    status: int,
    param: str | None,
) -> None:
    answer = gateway.request(
        path, body, method=method, key=None if key is None else "sk-team-embedded"
    )

    error = assert_openai_error(answer, status)
    if param is not None:
        assert error["param"] == param

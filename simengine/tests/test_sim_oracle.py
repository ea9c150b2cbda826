"""The simulated replica's quality as a client sees it: a real process, the openai SDK."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from localrun.processes import Process, sim_replica
from simengine.domain import oracle

pytestmark = pytest.mark.e2e

MATHS = "What is 37 + 48? Answer with the number."
ADMIN = {"Authorization": "Bearer sim-admin"}


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    with sim_replica(
        tmp_path_factory.mktemp("sim-oracle"),
        "--sim-admin-token",
        "sim-admin",
        "--sim-quality",
        "1",
    ) as process:
        yield process


def client_for(process: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0)


def faults(process: Process, **changes: object) -> httpx.Response:
    return httpx.post(f"{process.url}/sim/faults", json=changes, headers=ADMIN)


def ask(process: Process, prompt: str, **kwargs: object) -> str:
    answer = client_for(process).chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        **kwargs,  # type: ignore[call-overload]
    )
    return answer.choices[0].message.content or ""


def test_a_recognised_prompt_streams_its_answer_with_usage(replica: Process) -> None:
    prompt = "Write exactly 30 words about rivers."
    stream = client_for(replica).chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices]
    text = "".join(p for p in pieces if p)
    assert len(text.split()) == 30
    assert len([p for p in pieces if p]) == 30  # one word, one token, one chunk
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 30


def test_max_tokens_still_cuts_an_answer(replica: Process) -> None:
    answer = client_for(replica).chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": "Write exactly 30 words about rivers."}],
        max_tokens=7,
    )
    assert answer.choices[0].finish_reason == "length"
    assert len((answer.choices[0].message.content or "").split()) == 7
    assert answer.usage is not None and answer.usage.completion_tokens == 7


def test_the_quality_is_set_on_the_faults_endpoint(replica: Process) -> None:
    assert ask(replica, MATHS) == "85"
    try:
        assert faults(replica, quality=0.0).json()["quality"] == 0.0
        wrong = ask(replica, MATHS)
        assert wrong != "85" and wrong.lstrip("-").isdigit()
        assert ask(replica, MATHS) == wrong  # decided by the prompt, not by chance
        # Other prompts keep the generated text, whatever the quality.
        assert ask(replica, "Say hello", max_tokens=5) == ask(
            replica, "Say hello", max_tokens=5
        )
        assert oracle.recognise("Say hello") is None
    finally:
        faults(replica, quality=1.0)
    assert ask(replica, MATHS) == "85"


def test_a_bad_quality_is_refused(replica: Process) -> None:
    for bad in (1.5, -0.5, "high", True):
        response = faults(replica, quality=bad)
        assert response.status_code == 400
        assert "quality must be a number from 0 to 1" in response.text
    assert (
        httpx.get(f"{replica.url}/sim/state", headers=ADMIN).json()["faults"]["quality"]
        == 1.0
    )


def test_degraded_still_refuses_a_recognised_prompt(replica: Process) -> None:
    faults(replica, degraded=True)
    try:
        answer = ask(replica, MATHS, max_tokens=10, extra_body={"ignore_eos": True})
    finally:
        faults(replica, degraded=False)
    assert answer == "I am sorry, I cannot help with that."


def test_the_quality_flag_makes_a_replica_err(tmp_path: Path) -> None:
    with sim_replica(tmp_path, "--sim-quality", "0.5") as process:
        prompts = [f"What is {i} + 7? Answer with the number." for i in range(60)]
        right = sum(ask(process, p) == str(int(p.split()[2]) + 7) for p in prompts)
        assert 15 <= right <= 45


def test_queued_requests_are_counted_when_they_arrive_together(
    tmp_path: Path,
) -> None:
    """GIVEN a stalled replica that admits at most two queued requests
    WHEN eight arrive at once
    THEN two are queued and six are refused with 503."""
    with sim_replica(
        tmp_path, "--max-num-queued-reqs", "2", "--sim-admin-token", "sim-admin"
    ) as process:
        faults(process, stall=True)
        body = {"model": "chat-7b", "messages": [{"role": "user", "content": "x"}]}

        def post() -> int:
            try:
                url = f"{process.url}/v1/chat/completions"
                return httpx.post(url, json=body, timeout=2.0).status_code
            except httpx.TimeoutException:
                return 0  # held by the stall

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            statuses = sorted(pool.map(lambda _: post(), range(8)))
        faults(process, stall=False)
        assert statuses == [0, 0, 503, 503, 503, 503, 503, 503]

"""The simulated replica as a client sees it: a real process, the openai SDK, httpx."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessageParam,
)
from prometheus_client.parser import text_string_to_metric_families

from engine_nodes.domain.scrape import parse_metrics_text
from localrun.processes import Process, is_healthy, sim_replica, wait_until
from simengine.replica import DEGRADED_PIECES

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    tmp = tmp_path_factory.mktemp("sim")
    with sim_replica(
        tmp,
        "--enable-prompt-tokens-details",
        "--max-model-len",
        "4096",
        "--sim-admin-token",
        "sim-admin",
    ) as process:
        yield process


def client_for(process: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0)


def admin(process: Process, **faults: object) -> dict[str, Any]:
    response = httpx.post(
        f"{process.url}/sim/faults",
        json=faults,
        headers={"Authorization": "Bearer sim-admin"},
    )
    assert response.status_code == 200, response.text
    return response.json()


def state(process: Process) -> dict[str, Any]:
    return httpx.get(
        f"{process.url}/sim/state", headers={"Authorization": "Bearer sim-admin"}
    ).json()


def usage_of(answer: ChatCompletion | ChatCompletionChunk) -> CompletionUsage:
    assert answer.usage is not None, "the answer carries no usage"
    return answer.usage


def cached_tokens(answer: ChatCompletion) -> int:
    details = usage_of(answer).prompt_tokens_details
    assert details is not None and details.cached_tokens is not None, answer.usage
    return details.cached_tokens


def prompt_of(process: Process, tokens: int) -> list[ChatCompletionMessageParam]:
    """Return messages whose rendered prompt is exactly ``tokens`` tokens long."""

    def count(words: int) -> int:
        messages = [
            {"role": "user", "content": " ".join(f"w{i % 97}" for i in range(words))}
        ]
        response = httpx.post(
            f"{process.url}/tokenize", json={"model": "chat-7b", "messages": messages}
        )
        return response.json()["count"]

    low, high = 1, tokens
    while low < high:
        mid = (low + high) // 2
        if count(mid) < tokens:
            low = mid + 1
        else:
            high = mid
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": " ".join(f"w{i % 97}" for i in range(low))}
    ]
    if count(low) != tokens:
        pytest.skip(f"no word count renders to exactly {tokens} tokens")
    return messages


def test_openai_sdk_streams_with_role_first_and_usage_last(replica: Process) -> None:
    stream = client_for(replica).chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 12
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    usage = usage_of(usage_chunk)
    assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert len({c.id for c in chunks}) == 1


def test_stream_bytes_match_vllm(replica: Process) -> None:
    body = {
        "model": "chat-7b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{replica.url}/v1/chat/completions", json=body
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [p["object"] for p in payloads] == ["chat.completion.chunk"] * 4
    # Without include_usage there is no usage chunk.
    assert all("usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["choices"][0]["stop_reason"] is None


def test_non_streaming_answer_has_message_and_usage(replica: Process) -> None:
    answer = client_for(replica).chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content
    assert usage_of(answer).completion_tokens == 5


def test_same_seed_gives_same_text(replica: Process) -> None:
    client = client_for(replica)
    texts = {
        client.chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "tell me"}],
            max_tokens=8,
            seed=7,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
        for _ in range(2)
    }
    assert len(texts) == 1


def test_repeated_1000_token_prompt_reports_992_cached(replica: Process) -> None:
    messages = prompt_of(replica, 1000)
    client = client_for(replica)
    first = client.chat.completions.create(
        model="chat-7b", messages=messages, max_tokens=2
    )
    second = client.chat.completions.create(
        model="chat-7b", messages=messages, max_tokens=2
    )
    assert usage_of(first).prompt_tokens == 1000
    assert cached_tokens(first) == 0
    assert cached_tokens(second) == 992


def test_shared_history_hits_the_prefix_cache(replica: Process) -> None:
    client = client_for(replica)
    history: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are terse. " * 60},
        {"role": "user", "content": "first question " * 20},
    ]
    client.chat.completions.create(model="chat-7b", messages=history, max_tokens=2)
    follow_up: list[ChatCompletionMessageParam] = [
        *history,
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and then?"},
    ]
    answer = client.chat.completions.create(
        model="chat-7b", messages=follow_up, max_tokens=2
    )
    assert cached_tokens(answer) >= 128


def test_metrics_parse_with_vllm_names_and_labels(replica: Process) -> None:
    client_for(replica).chat.completions.create(
        model="chat-7b", messages=[{"role": "user", "content": "count"}], max_tokens=3
    )
    text = httpx.get(f"{replica.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert name in families, name
        assert families[name].type == kind, name
        for sample in families[name].samples:
            if sample.name.endswith("_created"):
                continue
            assert sample.labels.get("model_name") == "chat-7b", sample
            assert sample.labels.get("engine") == "0", sample
    ttft_buckets = [
        s.labels["le"]
        for s in families["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert ttft_buckets[:4] == ["0.001", "0.005", "0.01", "0.02"]

    def count(name: str) -> float:
        return next(
            s.value for s in families[name].samples if s.name == f"{name}_count"
        )

    assert count("vllm:time_to_first_token_seconds") >= 1
    assert count("vllm:inter_token_latency_seconds") >= 2
    assert count("vllm:e2e_request_latency_seconds") >= 1
    stats = parse_metrics_text(text)
    assert stats.generation_tokens >= 3
    assert stats.num_gpu_blocks > 0


def test_models_health_and_version(replica: Process) -> None:
    models = httpx.get(f"{replica.url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["chat-7b"]
    assert models["data"][0]["owned_by"] == "vllm"
    assert models["data"][0]["max_model_len"] == 4096
    health = httpx.get(f"{replica.url}/health")
    assert health.status_code == 200
    assert health.content == b""
    assert "version" in httpx.get(f"{replica.url}/version").json()


def test_unknown_model_is_404_in_vllm_shape(replica: Process) -> None:
    response = httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "NotFoundError"
    assert error["code"] == 404
    assert error["message"].startswith("The model `nope` does not exist.")


def test_prompt_over_max_model_len_is_400(replica: Process) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "word " * 5000}
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client_for(replica).chat.completions.create(
            model="chat-7b", messages=messages, max_tokens=10
        )
    assert caught.value.status_code == 400
    assert "maximum context length is 4096" in caught.value.message


def test_bad_json_and_bad_max_tokens_are_400(replica: Process) -> None:
    response = httpx.post(
        f"{replica.url}/v1/chat/completions",
        content=b"{oops",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"
    response = httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={
            "model": "chat-7b",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 0,
        },
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_client_disconnect_frees_the_request(replica: Process) -> None:
    body = {
        "model": "chat-7b",
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{replica.url}/v1/chat/completions", json=body
    ) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in received)
    wait_until(
        lambda: state(replica)["num_requests_running"] == 0,
        message="the aborted request to leave the engine",
    )
    assert state(replica)["tokens_in_flight"] == 0


def test_fail_next_answers_500_before_any_token(replica: Process) -> None:
    admin(replica, fail_next=1)
    with pytest.raises(openai.InternalServerError):
        client_for(replica).chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            stream=True,
        )
    answer = client_for(replica).chat.completions.create(
        model="chat-7b", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert usage_of(answer).completion_tokens >= 1


def test_stall_holds_requests_until_released(replica: Process) -> None:
    admin(replica, stall=True)
    before = state(replica)["generation_tokens"]
    with httpx.Client(timeout=30) as http:
        import threading

        results: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: results.append(
                http.post(
                    f"{replica.url}/v1/chat/completions",
                    json={
                        "model": "chat-7b",
                        "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 3,
                        "ignore_eos": True,
                    },
                )
            )
        )
        thread.start()
        wait_until(
            lambda: state(replica)["num_requests_waiting"] == 1,
            message="the request to queue behind the stall",
        )
        assert state(replica)["generation_tokens"] == before
        admin(replica, stall=False)
        thread.join(timeout=30)
    assert results[0].status_code == 200
    assert results[0].json()["usage"]["completion_tokens"] == 3


def gauges(process: Process) -> tuple[int, int, int]:
    """Return (running, waiting, generated tokens) as ``/metrics`` shows them."""
    stats = parse_metrics_text(httpx.get(f"{process.url}/metrics").text)
    return (
        stats.num_requests_running,
        stats.num_requests_waiting,
        stats.generation_tokens,
    )


def test_a_stalled_engine_holds_its_gauges_and_aborts_until_released(
    replica: Process,
) -> None:
    """GIVEN a stream that has begun
    WHEN the engine stalls and then the client leaves
    THEN, as with a hung vLLM engine core, ``/metrics`` goes on showing the request
    running and no new tokens (the abort waits); once the stall ends the abort is
    taken before any step and the replica is idle.
    """
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            f"{replica.url}/v1/chat/completions",
            json={
                "model": "chat-7b",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 3000,
                "stream": True,
                "ignore_eos": True,
            },
        ) as response,
    ):
        lines = response.iter_lines()
        assert '"role":"assistant"' in next(line for line in lines if line)
        admin(replica, stall=True)
        running, waiting, generated = gauges(replica)
        assert running + waiting == 1
    wait_until(
        lambda: state(replica)["held_aborts"] == 1,
        message="the replica to notice that the client left",
    )
    assert gauges(replica) == (running, waiting, generated)
    admin(replica, stall=False)
    assert state(replica)["held_aborts"] == 0
    assert gauges(replica) == (0, 0, generated)


def test_sim_stall_flag_stalls_from_the_start(tmp_path: Path) -> None:
    with sim_replica(tmp_path, "--sim-stall") as process:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{process.url}/v1/chat/completions",
                json={
                    "model": "chat-7b",
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 1,
                },
                timeout=httpx.Timeout(10.0, read=1.0),
            )
        assert httpx.get(f"{process.url}/health").status_code == 200


REFUSAL = "I am sorry, I cannot help with that."
REFUSAL_TOKENS = len(DEGRADED_PIECES)


def test_degraded_answers_refuse_once_and_stop(replica: Process) -> None:
    """GIVEN a degraded replica (a broken chat template, as users see it)
    WHEN it is asked with room for far more than the refusal
    THEN it says the refusal once and stops, the usage counting what it sent,
    streamed or not; a max_tokens shorter than the sentence cuts it.
    """
    client = client_for(replica)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "solve"}]
    admin(replica, degraded=True)
    try:
        answer = client.chat.completions.create(
            model="chat-7b", messages=messages, max_tokens=200
        )
        chunks = list(
            client.chat.completions.create(
                model="chat-7b",
                messages=messages,
                max_tokens=200,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        cut = client.chat.completions.create(
            model="chat-7b", messages=messages, max_tokens=4
        )
    finally:
        admin(replica, degraded=False)
    assert answer.choices[0].message.content == REFUSAL
    assert answer.choices[0].finish_reason == "stop"
    assert usage_of(answer).completion_tokens == REFUSAL_TOKENS
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(c.choices[0].delta.content or "" for c in content) == REFUSAL
    assert content[-1].choices[0].finish_reason == "stop"
    assert usage_of(chunks[-1]).completion_tokens == len(content) == REFUSAL_TOKENS
    assert cut.choices[0].message.content == "I am sorry,"
    assert cut.choices[0].finish_reason == "length"
    assert usage_of(cut).completion_tokens == 4


def test_degraded_with_ignore_eos_refuses_up_to_max_tokens(replica: Process) -> None:
    admin(replica, degraded=True)
    try:
        answer = client_for(replica).chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "solve"}],
            max_tokens=25,
            extra_body={"ignore_eos": True},
        )
    finally:
        admin(replica, degraded=False)
    assert answer.choices[0].message.content == "".join(
        DEGRADED_PIECES[i % REFUSAL_TOKENS] for i in range(25)
    )
    assert answer.choices[0].message.content.startswith(REFUSAL + REFUSAL)
    assert answer.choices[0].finish_reason == "length"
    assert usage_of(answer).completion_tokens == 25


def time_to_first_token(process: Process, http: httpx.Client, n: int) -> float:
    """Return the seconds until the first content token of a streamed answer."""
    body = {
        "model": "chat-7b",
        # A fresh prompt each time: no prefix-cache hit shortens a prefill.
        "messages": [{"role": "user", "content": f"question {n} " * 40}],
        "max_tokens": 4,
        "stream": True,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    with http.stream(
        "POST", f"{process.url}/v1/chat/completions", json=body
    ) as response:
        assert response.status_code == 200
        lines: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
                if delta.get("content"):
                    if first is None:
                        first = time.perf_counter() - started
                    pieces.append(delta["content"])
            if line:
                lines.append(line)
    # The whole answer came, later tokens included.
    assert len(pieces) == 4 and lines[-1] == "data: [DONE]", lines
    assert first is not None
    return first


def ttft_histogram(process: Process) -> tuple[float, float]:
    """Return (sum, count) of the replica's vllm:time_to_first_token_seconds."""
    families = {
        f.name: f
        for f in text_string_to_metric_families(
            httpx.get(f"{process.url}/metrics").text
        )
    }
    samples = families["vllm:time_to_first_token_seconds"].samples
    total = next(s.value for s in samples if s.name.endswith("_sum"))
    count = next(s.value for s in samples if s.name.endswith("_count"))
    return total, count


def test_ttft_factor_holds_the_first_token_back(tmp_path: Path) -> None:
    """GIVEN an idle replica (a slow frontend, so its natural TTFT dominates
    the client's own overheads)
    WHEN its ttft_factor goes from 1 to 2
    THEN its first tokens come about twice as late, as a client measures them and
    as its TTFT histogram observes them, and every answer is still whole.
    """
    with (
        sim_replica(tmp_path, "--sim-frontend-ms", "60") as process,
        httpx.Client(timeout=30) as http,
    ):
        medians: dict[float, float] = {}
        means: dict[float, float] = {}
        for factor in (1.0, 2.0):
            assert admin(process, ttft_factor=factor)["ttft_factor"] == factor
            assert state(process)["faults"]["ttft_factor"] == factor
            before_sum, before_count = ttft_histogram(process)
            seen = [
                time_to_first_token(process, http, int(10 * factor) + n)
                for n in range(5)
            ]
            after_sum, after_count = ttft_histogram(process)
            assert after_count - before_count == 5
            medians[factor] = statistics.median(seen)
            means[factor] = (after_sum - before_sum) / 5
    assert medians[2.0] >= 1.6 * medians[1.0], medians
    assert means[2.0] >= 1.6 * means[1.0], means


def test_a_ttft_factor_below_one_or_not_a_number_is_400(replica: Process) -> None:
    for bad in (0.5, "x", True):
        response = httpx.post(
            f"{replica.url}/sim/faults",
            json={"ttft_factor": bad},
            headers={"Authorization": "Bearer sim-admin"},
        )
        assert response.status_code == 400, (bad, response.text)
        assert "ttft_factor must be a number of at least 1" in response.text
    assert state(replica)["faults"]["ttft_factor"] == 1.0


def test_the_ttft_factor_flag_sets_the_fault(tmp_path: Path) -> None:
    with sim_replica(
        tmp_path, "--sim-ttft-factor", "1.3", "--sim-admin-token", "sim-admin"
    ) as process:
        assert state(process)["faults"]["ttft_factor"] == 1.3


def test_faults_admin_needs_its_token(replica: Process) -> None:
    response = httpx.post(f"{replica.url}/sim/faults", json={"stall": True})
    assert response.status_code == 401
    response = httpx.post(
        f"{replica.url}/sim/faults",
        json={"nonsense": 1},
        headers={"Authorization": "Bearer sim-admin"},
    )
    assert response.status_code == 400


def test_slow_start_answers_503_until_warm(tmp_path: Path) -> None:
    with sim_replica(tmp_path, "--sim-startup-s", "1.5", wait_healthy=False) as process:
        assert httpx.get(f"{process.url}/health").status_code == 503
        response = httpx.post(
            f"{process.url}/v1/chat/completions",
            json={"model": "chat-7b", "messages": [{"role": "user", "content": "x"}]},
        )
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
        wait_until(lambda: is_healthy(process.url), message="warm-up to end")


def test_crash_after_k_tokens_kills_the_stream_and_process(tmp_path: Path) -> None:
    with sim_replica(tmp_path, "--sim-crash-after-tokens", "20") as process:
        client = client_for(process)
        received = 0
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            stream = client.chat.completions.create(
                model="chat-7b",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received += 1
        assert 1 <= received <= 20
        wait_until(lambda: process.popen.poll() is not None, message="the crash")
        assert process.popen.returncode == 70


def test_next_turn_hits_the_blocks_of_the_previous_reply(replica: Process) -> None:
    client = client_for(replica)
    history: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "write at length " * 10}
    ]
    first = client.chat.completions.create(
        model="chat-7b",
        messages=history,
        max_tokens=64,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    turn: list[ChatCompletionMessageParam] = [
        *history,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    second = client.chat.completions.create(
        model="chat-7b", messages=turn, max_tokens=2
    )
    # The prompt, and the reply generated into the cache, are reused.
    assert cached_tokens(second) >= (usage_of(first).prompt_tokens + 48) // 16 * 16

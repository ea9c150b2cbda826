"""The shape diffs on the SGLang reference (captured from real SGLang 0.5.23), and the platform's scraper
on the simulator's SGLang metrics (no server)."""

from __future__ import annotations

import pytest

from engine_nodes.domain.scrape import parse_metrics_text
from simengine.conformance import (
    SGLANG_PLATFORM_METRICS,
    Capture,
    diff_metrics,
    diff_stream,
    metric_shapes,
    read_capture,
    stream_facts,
)
from simengine.domain.engine import Engine, EngineConfig, SimRequest
from simengine.domain.perf import PROFILES
from simengine.sglang_metrics import SGLangMetrics


@pytest.fixture(scope="module")
def reference() -> Capture:
    return read_capture(engine="sglang")


def test_reference_stream_is_sglangs_chunk_sequence(reference: Capture) -> None:
    facts = stream_facts(reference.stream)
    assert facts["order"] == ["role", "content*", "finish", "usage", "done"]
    assert facts["role_delta"] == {
        "reasoning_content": None,
        "role": "assistant",
        "content": "",
    }
    # SGLang's finish chunk: a delta of reasoning_content null only.
    assert facts["shapes"]["finish"][0]["choices"][0]["delta"] == {
        "reasoning_content": "null"
    }
    assert (facts["finish_reason"], facts["matched_stop"]) == ("length", None)
    usage = facts["shapes"]["usage"][0]["usage"]
    assert set(usage) == {
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "reasoning_tokens",
        "completion_tokens_details",
    }
    assert stream_facts(reference.stream_no_usage)["order"] == [
        "role",
        "content*",
        "finish",
        "done",
    ]


def _merge_finish_into_last_content(stream: str) -> str:
    """vLLM's way: the last token rides on the chunk that finishes."""
    blocks = stream.split("\n\n")
    finish = next(
        i for i, b in enumerate(blocks) if '"delta":{"reasoning_content":null},' in b
    )
    blocks[finish - 1] = blocks[finish - 1].replace(
        '"finish_reason":null', '"finish_reason":"length"'
    )
    del blocks[finish]
    return "\n\n".join(blocks)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (_merge_finish_into_last_content, "finish.choices[0].delta.content: extra"),
        (lambda s: s.replace(',"matched_stop":null', ""), "matched_stop: missing"),
        (lambda s: s.replace(',"reasoning_tokens":0', ""), "reasoning_tokens"),
        (
            lambda s: s.replace('{"reasoning_content":null,', "{"),
            "reasoning_content: missing",
        ),
    ],
)
def test_stream_diff_catches_what_sglang_does_not_send(
    reference: Capture, change: object, problem: str
) -> None:
    assert callable(change)
    problems = diff_stream(reference.stream, change(reference.stream))
    assert any(problem in p for p in problems), problems


def test_reference_metrics_cover_what_the_platform_reads(reference: Capture) -> None:
    assert diff_metrics(reference.metrics, reference.metrics, engine="sglang") == []
    assert set(metric_shapes(reference.metrics, engine="sglang")) >= (
        SGLANG_PLATFORM_METRICS
    )
    renamed = reference.metrics.replace("sglang:token_usage", "sglang:token_use")
    assert any(
        "sglang:token_usage: missing" in p
        for p in diff_metrics(reference.metrics, renamed, engine="sglang")
    )


def test_the_scraper_reads_the_sims_sglang_metrics() -> None:
    """GIVEN the radix engine with one request running and one finished
    WHEN SGLangMetrics renders and engine_nodes.domain.scrape parses it
    THEN the stats are the engine's: running/waiting, token usage over a pool of
    one-token pages, prompt and cached tokens as prefix-cache queries and hits."""
    profile = PROFILES["a100-8b"]
    engine = Engine(
        profile, EngineConfig.from_profile(profile, cache="radix"), jitter_cv=0.0
    )
    metrics = SGLangMetrics(
        model_name="chat-7b", max_total_num_tokens=engine.max_total_num_tokens
    )
    prompt = list(range(300))
    now = 0.0
    # "a" runs to its end (a prefill step, two decode steps); "b" keeps running.
    for request_id, output_len, steps in (("a", 3, 3), ("b", 50, 4)):
        engine.add_request(SimRequest(request_id, prompt, output_len), now)
        for _ in range(steps):
            duration = engine.begin_step(now)
            assert duration is not None
            now += duration
            for done in engine.end_step(now).finished:
                metrics.record_finished(done, arrived_at=0.0, max_tokens=64)
            metrics.record_engine(engine, now)
    stats = parse_metrics_text(metrics.render().decode())
    assert (stats.num_requests_running, stats.num_requests_waiting) == (1, 0)
    assert stats.block_size == 1
    assert stats.num_gpu_blocks == engine.max_total_num_tokens + 1
    assert stats.kv_tokens_in_use == engine.num_used_tokens > 300
    assert stats.kv_cache_usage_perc == pytest.approx(engine.kv_cache_usage_perc)
    # Only "a" finished: SGLang's tokenizer counts a request when it ends.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (300, 0)
    assert stats.generation_tokens == 3
    assert engine.cached_tokens("b") == 299

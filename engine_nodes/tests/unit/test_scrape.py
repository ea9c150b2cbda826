"""Tokens in flight read off vLLM's /metrics, on a capture from real vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_nodes.domain.scrape import parse_metrics_text

CAPTURE = (
    Path(__file__).resolve().parents[3] / "simengine/tests/data/vllm_metrics.txt"
).read_text()
USAGE_LINE = 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0'


@pytest.mark.parametrize("blocks_used", [0, 1, 3, 4, 16, 500, 1023])
def test_kv_tokens_in_use_are_whole_blocks_of_vllms_usage(blocks_used: int) -> None:
    # vLLM's BlockPool.get_usage(): 1 - free / (num_gpu_blocks - 1), the null
    # block left out. The capture has num_gpu_blocks=1024, block_size=128.
    usable = 1024 - 1
    usage = 1.0 - (usable - blocks_used) / usable
    text = CAPTURE.replace(USAGE_LINE, USAGE_LINE.replace(" 0.0", f" {usage!r}"))

    stats = parse_metrics_text(text)

    assert stats.num_gpu_blocks == 1024
    assert stats.block_size == 128
    assert stats.kv_tokens_in_use == blocks_used * 128


SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="chat-7b@v4"} 37.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="chat-7b@v4"} 5.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="chat-7b@v4"} 0.25
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="chat-7b@v4"} 400000.0
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="chat-7b@v4"} 0.6
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="chat-7b@v4"} 120000.0
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="chat-7b@v4"} 72000.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="chat-7b@v4"} 30000.0
"""


def test_sglang_metrics_read_into_the_same_fields() -> None:
    stats = parse_metrics_text(SGLANG_METRICS)
    assert stats.num_requests_running == 37
    assert stats.queue_depth == 5
    assert stats.kv_cache_usage_perc == 0.25
    assert stats.kv_tokens_in_use == 100_000  # 0.25 of a 400,000-token pool
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (120_000, 72_000)
    assert stats.generation_tokens == 30_000


def test_a_scrape_with_vllm_series_is_read_as_vllm() -> None:
    text = SGLANG_METRICS + 'vllm:num_requests_running{model_name="m"} 2.0\n'
    stats = parse_metrics_text(text)
    assert stats.num_requests_running == 2
    assert stats.queue_depth == 0

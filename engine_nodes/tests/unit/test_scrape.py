"""Tokens in flight read off vLLM's /metrics, on a capture from real vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_nodes.domain.scrape import parse_metrics_text

CAPTURE = (Path(__file__).parents[1] / "data/vllm_metrics.txt").read_text()
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

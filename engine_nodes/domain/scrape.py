"""Turn a replica's Prometheus metrics into the load figures routers and autoscalers use.

Public surface: ``EngineStats``, ``parse_metrics_text``.

vLLM exports no "tokens in flight", so it is derived from what it does export: KV
blocks in use (``vllm:kv_cache_usage_perc`` x (``num_gpu_blocks`` - 1), in whole
blocks, x ``block_size``, from ``vllm:cache_config_info``; vLLM's usage leaves out its
null block) is the prompt and output tokens held by running requests. The gateway
(online-path issue) knows its own share exactly; this figure is the replica's view,
which also covers traffic from other gateways.

SGLang (``--enable-metrics``; names from its ``srt/metrics/collector.py``) reads into
the same fields: ``sglang:num_running_reqs`` and ``sglang:num_queue_reqs``,
``sglang:token_usage`` (the share of its token pool in use) over
``sglang:max_total_num_tokens`` (a pool of one-token pages, so ``block_size`` 1),
and ``sglang:prompt_tokens_total`` / ``sglang:cached_tokens_total`` as the prefix
cache's queries and hits (its radix cache counts in tokens, as vLLM's). A scrape
with any ``vllm:`` series is read as vLLM's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["EngineStats", "parse_metrics_text"]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One scrape of a replica, reduced to what the control loop needs."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    num_gpu_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    generation_tokens: int

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot (the seed's queue depth)."""
        return self.num_requests_waiting

    @property
    def kv_tokens_in_use(self) -> int:
        """Tokens held in KV blocks by running requests (whole blocks).

        vLLM's usage is ``1 - free / (num_gpu_blocks - 1)``: its null block is never
        free and not counted, so scaling by ``num_gpu_blocks`` overstated it.
        """
        blocks = round(self.kv_cache_usage_perc * max(0, self.num_gpu_blocks - 1))
        return blocks * self.block_size


def _labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    for part in text.split(","):
        if "=" in part:
            key, _, value = part.partition("=")
            labels[key.strip()] = value.strip().strip('"')
    return labels


def parse_metrics_text(text: str) -> EngineStats:
    """Parse vLLM's /metrics exposition (one engine) into ``EngineStats``.

    Only the series needed are read; unknown lines are ignored, so newer vLLM
    versions with more metrics parse the same. Missing series read as 0.

    Raises:
        ValueError: a needed sample has a value that is not a number.
    """
    values: dict[str, float] = {}
    num_gpu_blocks = 0
    block_size = 16
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, brace, rest = line.partition("{")
        if brace:
            label_text, _, value_text = rest.rpartition("}")
        else:
            name, _, value_text = line.partition(" ")
            label_text = ""
        name = name.strip()
        if not name.startswith(("vllm:", "sglang:")):
            continue
        if name == "vllm:cache_config_info":
            labels = _labels(label_text)
            num_gpu_blocks = int(labels.get("num_gpu_blocks", "0") or 0)
            block_size = int(labels.get("block_size", "16") or 16)
            continue
        fields = value_text.split()
        if not fields:
            continue
        value = float(fields[0])
        if math.isnan(value):
            continue
        values[name] = values.get(name, 0.0) + value
    is_vllm = num_gpu_blocks > 0 or any(name.startswith("vllm:") for name in values)
    if not is_vllm and any(name.startswith("sglang:") for name in values):
        return _sglang_stats(values)
    return EngineStats(
        num_requests_running=int(values.get("vllm:num_requests_running", 0)),
        num_requests_waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_cache_usage_perc=min(
            1.0, max(0.0, values.get("vllm:kv_cache_usage_perc", 0.0))
        ),
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        prefix_cache_queries=int(values.get("vllm:prefix_cache_queries_total", 0)),
        prefix_cache_hits=int(values.get("vllm:prefix_cache_hits_total", 0)),
        generation_tokens=int(values.get("vllm:generation_tokens_total", 0)),
    )


def _sglang_stats(values: dict[str, float]) -> EngineStats:
    pool_tokens = int(values.get("sglang:max_total_num_tokens", 0))
    return EngineStats(
        num_requests_running=int(values.get("sglang:num_running_reqs", 0)),
        num_requests_waiting=int(values.get("sglang:num_queue_reqs", 0)),
        kv_cache_usage_perc=min(1.0, max(0.0, values.get("sglang:token_usage", 0.0))),
        # One-token pages; the extra one stands for vLLM's null block.
        num_gpu_blocks=pool_tokens + 1 if pool_tokens else 0,
        block_size=1,
        prefix_cache_queries=int(values.get("sglang:prompt_tokens_total", 0)),
        prefix_cache_hits=int(values.get("sglang:cached_tokens_total", 0)),
        generation_tokens=int(values.get("sglang:generation_tokens_total", 0)),
    )

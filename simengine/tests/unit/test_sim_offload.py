"""The simulated replica's CPU offload tier: its flags, and the metrics it feeds."""

from __future__ import annotations

import asyncio
import time

import pytest

from simengine.cli import build_parser, main, options_from_args
from simengine.replica import SimOptions, SimReplica, Stream

LABELS = {"model_name": "m", "engine": "0"}


def sample(replica: SimReplica, name: str, **labels: str) -> float:
    value = replica.metrics.registry.get_sample_value(name, {**LABELS, **labels})
    assert value is not None, name
    return value


async def run_in_turn(replica: SimReplica, prompts: list[list[int]]) -> list[Stream]:
    """Send each prompt once the previous answer is done (one token each)."""
    replica.ensure_started()
    streams = []
    try:
        for k, prompt in enumerate(prompts):
            stream = replica.submit(
                request_id=f"r{k}",
                prompt_token_ids=prompt,
                output_len=1,
                finish_reason="length",
                max_tokens=1,
                arrived_at=time.monotonic(),
                text_seed=k,
            )
            deadline = time.monotonic() + 10
            while stream.done is None:
                assert time.monotonic() < deadline, "no answer in 10 s"
                stream.wake.clear()
                await asyncio.wait_for(stream.wake.wait(), timeout=10)
            streams.append(stream)
        return streams
    finally:
        await replica.stop()


def evicting_replica(offload: float | None) -> SimReplica:
    # 39 usable GPU blocks of 16 tokens: the second prompt evicts the first's tail.
    return SimReplica(
        SimOptions(
            model="m",
            served_model_names=["m"],
            num_gpu_blocks=40,
            kv_offloading_size=offload,
            jitter_cv=0.0,
        )
    )


PROMPTS = [
    list(range(1000, 1320)),
    list(range(50_000, 50_480)),
    list(range(1000, 1320)),
]


def test_host_hits_reach_usage_and_vllms_counters() -> None:
    replica = evicting_replica(1.0)
    streams = asyncio.run(run_in_turn(replica, PROMPTS))

    done = streams[2].done
    assert done is not None
    # usage's cached_tokens: 9 blocks from the GPU, 10 loaded from the host.
    assert done.cached_tokens == 19 * 16
    assert sample(replica, "vllm:prefix_cache_queries_total") == 1120
    assert sample(replica, "vllm:prefix_cache_hits_total") == 144
    # vLLM: queries = tokens past the GPU hit, hits = tokens the connector loads.
    assert sample(replica, "vllm:external_prefix_cache_queries_total") == 976
    assert sample(replica, "vllm:external_prefix_cache_hits_total") == 160
    cached_by = "vllm:prompt_tokens_cached_by_source_total"
    assert sample(replica, cached_by, source="device") == 144
    assert sample(replica, cached_by, source="host") == 160
    assert sample(replica, cached_by, source="disk") == 0
    by_source = "vllm:prompt_tokens_by_source_total"
    assert sample(replica, by_source, source="local_cache_hit") == 144
    assert sample(replica, by_source, source="external_kv_transfer") == 160
    assert sample(replica, by_source, source="local_compute") == 1120 - 304
    assert sample(replica, "vllm:prompt_tokens_cached_total") == 304
    assert _cache_config_labels(replica)["kv_offloading_size"] == "1.0"


def test_without_offload_the_external_counters_stay_at_zero() -> None:
    replica = evicting_replica(None)
    streams = asyncio.run(run_in_turn(replica, PROMPTS))

    done = streams[2].done
    assert done is not None and done.cached_tokens == 9 * 16
    assert sample(replica, "vllm:external_prefix_cache_queries_total") == 0
    assert sample(replica, "vllm:external_prefix_cache_hits_total") == 0
    cached_by = "vllm:prompt_tokens_cached_by_source_total"
    assert sample(replica, cached_by, source="device") == 144
    assert sample(replica, cached_by, source="host") == 0
    assert _cache_config_labels(replica)["kv_offloading_size"] == "None"


def _cache_config_labels(replica: SimReplica) -> dict[str, str]:
    for family in replica.metrics.registry.collect():
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    raise AssertionError("no vllm:cache_config_info")


def test_cli_flags_reach_the_options_and_the_engine() -> None:
    args = build_parser().parse_args(
        [
            "--model",
            "m",
            "--kv-offloading-size",
            "0.5",
            "--kv-offloading-backend",
            "native",
        ]
    )
    options, _ = options_from_args(args)

    assert (options.kv_offloading_size, options.kv_offloading_backend) == (
        0.5,
        "native",
    )
    host = SimReplica(options).engine.host_cache
    assert host is not None and host.num_blocks == 256  # a100-8b: 16 x 128 KiB
    default, _ = options_from_args(build_parser().parse_args(["--model", "m"]))
    assert default.kv_offloading_size is None
    assert SimReplica(default).engine.host_cache is None


@pytest.mark.parametrize("size", ["0", "-1", "nan", "lots"])
def test_cli_refuses_an_offload_size_that_is_not_above_zero(
    size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--model", "m", "--kv-offloading-size", size])

    assert exc.value.code == 2
    assert "--kv-offloading-size" in capsys.readouterr().err


def test_cli_refuses_the_lmcache_backend_with_a_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--model",
                "m",
                "--kv-offloading-size",
                "1",
                "--kv-offloading-backend",
                "lmcache",
            ]
        )

    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'lmcache' is not simulated" in err and "native" in err
    with pytest.raises(ValueError, match="not simulated"):
        SimReplica(
            SimOptions(
                model="m", served_model_names=["m"], kv_offloading_backend="lmcache"
            )
        )

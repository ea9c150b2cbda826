"""The KV event publisher's config and socket (in-process ZMQ)."""

from __future__ import annotations

import pytest
import zmq

from simengine.domain.kv_events import AllBlocksCleared, BlockRemoved, unpack_frames
from simengine.kv_publisher import (
    KVEventPublisher,
    KVEventsConfig,
    is_bind_endpoint,
    parse_kv_events_config,
)


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://indexer.svc:5557", False),
    ],
)
def test_is_bind_endpoint_follows_vllm(endpoint: str, binds: bool) -> None:
    assert is_bind_endpoint(endpoint) is binds


def test_parse_kv_events_config_reads_vllm_keys() -> None:
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000",'
        ' "topic": "kv@r@m", "replay_endpoint": "tcp://*:6001", "buffer_steps": 5}'
    )
    assert config == KVEventsConfig(True, "zmq", "tcp://*:6000", "kv@r@m")
    assert config.is_enabled
    assert not parse_kv_events_config('{"publisher": "zmq"}').is_enabled
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).is_enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "object"),
        ("{", "not JSON"),
        ('{"enable": true}', "unknown keys"),
        ('{"enable_kv_cache_events": "yes"}', "true or false"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"endpoint": ""}', "endpoint"),
        ('{"hwm": -1}', "hwm"),
    ],
)
def test_parse_kv_events_config_refuses_bad_values(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_kv_events_config(text)


def test_publisher_sends_numbered_batches_and_skips_empty_steps() -> None:
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # inproc:// binds (vLLM's rule), so the SUB connects to it.
    publisher = KVEventPublisher(
        KVEventsConfig(True, "zmq", "inproc://kv-pub", "kv@r@m"), context=context
    )
    sub.connect("inproc://kv-pub")
    try:
        # The empty step sends nothing: the first batch is seq 0.
        publisher.publish([], 1.0)
        publisher.publish([AllBlocksCleared()], 2.0)
        publisher.publish([BlockRemoved((3,))], 3.0)
        assert sub.poll(5000)
        first = unpack_frames(sub.recv_multipart())
        assert sub.poll(5000)
        second = unpack_frames(sub.recv_multipart())
    finally:
        publisher.close()
        sub.close()
        context.term()
    assert first[:2] == ("kv@r@m", 0)
    assert first[2].events == (AllBlocksCleared(),)
    assert first[2].data_parallel_rank == 0
    assert second[:2] == ("kv@r@m", 1)
    assert second[2].events == (BlockRemoved((3,)),)
    assert publisher.seq == 2

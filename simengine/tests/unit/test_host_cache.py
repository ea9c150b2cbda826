"""Tests for the CPU offload tier's block cache (vLLM's native OffloadingConnector
with its CPU manager and LRU policy, reduced to what decides hits)."""

from __future__ import annotations

import pytest

from simengine.domain.prefix_cache import HostBlockCache, host_blocks


def test_lookup_counts_the_run_of_stored_blocks_from_start_up_to_a_gap() -> None:
    host = HostBlockCache(8)
    host.store([11, 12, 14])
    hashes = [10, 11, 12, 13, 14]

    assert host.lookup(hashes, 1, 5) == 2  # 11, 12, then 13 is missing
    assert host.lookup(hashes, 0, 5) == 0  # 10 was never stored
    assert host.lookup(hashes, 1, 2) == 1  # capped at stop
    assert host.lookup(hashes, 4, 5) == 1
    assert host.blocks_loaded == 0  # a lookup moves nothing


def test_storing_past_capacity_evicts_the_least_recently_used() -> None:
    host = HostBlockCache(3)

    assert host.store([1, 2, 3]) == 3
    assert host.store([1]) == 0  # already there: moves to the tail
    host.store([4])  # evicts 2, the head

    assert len(host) == 3
    assert (2 in host, 1 in host, 3 in host, 4 in host) == (False, True, True, True)
    assert (host.blocks_stored, host.evictions) == (4, 1)


def test_a_loaded_block_outlives_blocks_stored_before_it() -> None:
    host = HostBlockCache(2)
    host.store([1, 2])
    host.touch([1])  # a request loads block 1
    host.store([3])

    assert (1 in host, 2 in host, 3 in host) == (True, False, True)
    assert host.blocks_loaded == 1


def test_unmatched_blocks_take_space_but_never_hit() -> None:
    host = HostBlockCache(3)
    host.store([7])
    host.store_unmatched(2)

    assert len(host) == 3
    assert host.lookup([7], 0, 1) == 1
    host.store_unmatched(1)  # pushes 7 out
    host.store_unmatched(0)  # nothing
    assert 7 not in host
    assert (len(host), host.blocks_stored, host.evictions) == (3, 4, 1)


def test_host_blocks_divides_the_size_by_a_block_of_kv() -> None:
    # 1 GiB over 16 tokens of Llama-3-8B's 128 KiB per token.
    assert host_blocks(1.0, 16, 131_072) == 512
    assert host_blocks(0.0625, 128, 512) == 1024
    assert host_blocks(0, 16, 131_072) == 0
    with pytest.raises(ValueError, match="positive"):
        host_blocks(-1.0, 16, 131_072)
    with pytest.raises(ValueError, match="at least one block"):
        HostBlockCache(0)


def test_evicted_log_gets_every_evicted_key_when_set() -> None:
    host = HostBlockCache(3)
    host.store([1, 2])
    host.evicted_log = []
    host.store_unmatched(1)  # full: nothing evicted yet
    host.store([4, 5])
    assert host.evicted_log == [1, 2]
    host.store([6])
    assert host.evicted_log == [1, 2, -1]  # anonymous keys too: the caller filters

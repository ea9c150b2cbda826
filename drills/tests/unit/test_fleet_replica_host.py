"""The fleet replica's host tier (CPU offload, ``host_blocks``): nothing changes
without it; a conversation evicted from the GPU pool hits in host memory, an LRU
of bounded size; the load is charged once, in the first prefill step; the fleet
config sizes the tier and a small fleet run finds more history with it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.replica import FleetReplica, FleetRequest, stream_block_hash
from drills.domain.workload import ChatWorkload
from drills.tests.unit.test_fleet_replica import request
from simengine.domain.perf import PROFILES, step_time_from_totals_ms

PROFILE = PROFILES["a100-8b"]  # 16-token blocks, 2,048 batched tokens a step
BS = 16
# A 1,200-token prompt and 300-token answer hold ceil(1,499 / 16) = 94 blocks: a
# pool of 95 (94 usable) holds exactly one such request, so each request evicts
# every block the one before it left.
ONE_REQUEST_POOL = 95


def replica(*, num_gpu_blocks: int | None = None, host_blocks: int = 0) -> FleetReplica:
    return FleetReplica(
        "r",
        PROFILE,
        block_size=BS,
        num_gpu_blocks=num_gpu_blocks,
        jitter_cv=0,
        host_blocks=host_blocks,
    )


def run_alone(rep: FleetReplica, *requests: FleetRequest, now: float = 0.0) -> float:
    """Add ``requests`` and run the replica until idle; return when it went idle."""
    for req in requests:
        rep.add(req)
    end = rep.plan(now)
    while end is not None:
        rep.complete(end)
        now = end
        end = rep.plan(now)
    return now


def segments(rep: FleetReplica, now: float = 0.0) -> list[tuple[float, int, float]]:
    """Run until idle; return every segment's (start, steps, base_ms)."""
    out: list[tuple[float, int, float]] = []
    end = rep.plan(now)
    while end is not None:
        segment = rep.segment
        assert segment is not None
        out.append((segment.started_at, segment.steps, segment.base_ms))
        rep.complete(end)
        end = rep.plan(end)
    return out


# (time, first tokens, finished, cached tokens, prefill tokens so far) per event
Trace = list[tuple[float, list[int], list[int], list[int], int]]


def drive(rep: FleetReplica, arrivals: list[FleetRequest]) -> Trace:
    """Feed ``arrivals`` (by ``arrived_at``) to ``rep`` as the fleet does: an arrival
    cuts the running segment; record every completion."""
    trace: Trace = []
    pending = sorted(arrivals, key=lambda r: r.arrived_at)
    end: float | None = None
    while pending or end is not None:
        if end is None or (pending and pending[0].arrived_at < end):
            req = pending.pop(0)
            rep.add(req)
            cut = (
                rep.plan(req.arrived_at)
                if end is None
                else rep.interrupt(req.arrived_at)
            )
            end = cut if cut is not None else end
            continue
        first, done = rep.complete(end)
        trace.append(
            (
                end,
                [r.request_id for r in first],
                [r.request_id for r in done],
                [r.cached_tokens for r in first],
                rep.prefill_tokens,
            )
        )
        end = rep.plan(end)
    return trace


def chat_arrivals(
    seed: int,
    *,
    rate: float = 4.0,
    duration: float = 60.0,
    conversations: int = 12,
    varied: bool = False,
) -> list[FleetRequest]:
    """Seed-shaped chat turns (1,200-token prompts, 800 of history after the first
    turn); ``varied``: histories and prompts of any length, not whole blocks."""
    rng = random.Random(seed)
    turns: dict[int, int] = {}
    out: list[FleetRequest] = []
    at = 0.0
    while (at := at + rng.expovariate(rate)) < duration:
        conv = rng.randrange(conversations)
        turn = turns.get(conv, 0)
        turns[conv] = turn + 1
        if varied:
            stream = 300 + conv * 37  # the conversation's shared text
            prompt = stream + rng.randrange(1, 200)
            output = rng.randrange(1, 120)
        else:
            stream, prompt, output = 800, 1200, 120
        req = FleetRequest(
            len(out),
            team="t",
            tier="standard",
            conversation=conv,
            prompt_tokens=prompt,
            output_tokens=output,
            max_tokens=output,
            history_tokens=stream if turn else 0,
            stream_tokens=stream,
            arrived_at=at,
        )
        out.append(req)
    return out


# -- without a host tier nothing changes ---------------------------------------------


def test_host_blocks_0_is_the_replica_without_a_host_tier() -> None:
    """GIVEN the same evicting chat workload on a default replica and on one with
    ``host_blocks=0`` THEN every first token, finish, hit and count is the same."""
    default = FleetReplica("r", PROFILE, num_gpu_blocks=400, jitter_cv=0.04, seed=3)
    zero = FleetReplica(
        "r", PROFILE, num_gpu_blocks=400, jitter_cv=0.04, seed=3, host_blocks=0
    )
    a = drive(default, chat_arrivals(1))
    b = drive(zero, chat_arrivals(1))
    assert zero.host is None and default.host is None
    assert a == b
    assert len(a) > 100
    assert zero.host_hit_tokens == 0
    assert (zero.prefill_tokens, zero.generated_tokens, zero.busy_s) == (
        default.prefill_tokens,
        default.generated_tokens,
        default.busy_s,
    )
    # The workload does evict: some turns with history found none.
    assert any(cached == [0] for _, _, _, cached, _ in a[10:])


def test_a_host_tier_that_never_hits_changes_no_step() -> None:
    """GIVEN a pool large enough that nothing is evicted THEN a host tier stores
    but never loads, and the segments are those of the replica without it."""
    without = replica()
    with_host = replica(host_blocks=10_000)
    for rep in (without, with_host):
        for req in chat_arrivals(2, rate=3.0, duration=30.0):
            rep.add(req)
    assert segments(without) == segments(with_host)
    assert with_host.host_hit_tokens == 0
    assert with_host.host is not None and len(with_host.host) > 0
    assert with_host.prefill_tokens == without.prefill_tokens


# -- a conversation evicted from the GPU hits in host memory ---------------------------


def test_an_evicted_conversation_hits_in_the_host_tier_on_its_next_turn() -> None:
    results = {}
    for host_blocks in (0, 1000):
        rep = replica(num_gpu_blocks=ONE_REQUEST_POOL, host_blocks=host_blocks)
        first = request(1, conversation=7)
        run_alone(rep, first)
        # Two other conversations take the whole pool in turn: 7's blocks are gone.
        run_alone(rep, request(2, conversation=8), request(3, conversation=9), now=10)
        assert rep.pool.cached_block_ids([stream_block_hash(7, 0)]) == []
        before = rep.prefill_tokens
        second = request(4, conversation=7, history=800)
        run_alone(rep, second, now=20)
        results[host_blocks] = (second, rep.prefill_tokens - before, rep)

    cold, cold_prefill, _ = results[0]
    assert cold.cached_tokens == 0 and cold.host_tokens == 0
    assert cold_prefill == 1200

    warm, warm_prefill, rep = results[1000]
    assert warm.host_tokens == 800  # the 50 blocks of history, from host memory
    assert warm.cached_tokens == 800  # counted as cached: none on the GPU
    assert rep.host_hit_tokens == 800
    assert warm_prefill == cold_prefill - 800 == 400
    assert rep.host is not None and rep.host.blocks_loaded == 50

    # The loaded blocks are cached on the GPU like computed ones: the next turn
    # hits there and loads nothing.
    third = request(5, conversation=7, history=800)
    run_alone(rep, third, now=30)
    assert third.cached_tokens == 800 and third.host_tokens == 0
    assert rep.host_hit_tokens == 800


def test_the_host_hit_follows_a_partial_gpu_hit() -> None:
    """GIVEN a conversation whose first blocks survive on the GPU and whose later
    ones were evicted THEN the GPU hit is served first and the host tier the rest,
    together the whole history."""
    rep = replica(num_gpu_blocks=200, host_blocks=1000)  # 199 usable
    run_alone(rep, request(1, conversation=7))
    run_alone(rep, request(2, conversation=8), now=10)
    run_alone(rep, request(3, conversation=9), now=20)  # evicts 7's tail, not head
    gpu_left = len(
        rep.pool.cached_block_ids([stream_block_hash(7, k) for k in range(50)])
    )
    assert 0 < gpu_left < 50
    second = request(4, conversation=7, history=800)
    run_alone(rep, second, now=30)
    assert second.cached_tokens == 800
    assert second.host_tokens == (50 - gpu_left) * BS
    assert rep.host_hit_tokens == second.host_tokens


# -- the host tier is an LRU of bounded size ---------------------------------------


def test_a_host_tier_smaller_than_the_history_gives_no_hit() -> None:
    """GIVEN 40 host blocks, fewer than the 50 of one history THEN storing it
    pushes out its first blocks, and a hit needs the first block: none."""
    rep = replica(num_gpu_blocks=ONE_REQUEST_POOL, host_blocks=40)
    run_alone(rep, request(1, conversation=7))
    run_alone(rep, request(2, conversation=8), now=10)
    assert rep.host is not None and len(rep.host) == 40
    assert stream_block_hash(7, 0) not in rep.host
    second = request(3, conversation=7, history=800)
    run_alone(rep, second, now=20)
    assert second.cached_tokens == 0 and second.host_tokens == 0
    assert rep.host_hit_tokens == 0


def test_blocks_off_the_stream_take_host_space_and_push_out_older_history() -> None:
    """GIVEN a host tier that holds one conversation's 93 stored blocks and more,
    WHEN a request whose tokens are all off any stream (``stream_tokens=0``)
    follows THEN its 93 unmatched blocks push the history out: no hit; with more
    room the same history hits."""
    hits = {}
    for host_blocks in (150, 186):
        rep = replica(num_gpu_blocks=ONE_REQUEST_POOL, host_blocks=host_blocks)
        run_alone(rep, request(1, conversation=7))
        assert rep.host is not None and len(rep.host) == 93  # 1,499 tokens: 93 blocks
        run_alone(rep, request(2, conversation=8, stream=0), now=10)
        assert len(rep.host) == min(186, host_blocks)
        second = request(3, conversation=7, history=800)
        run_alone(rep, second, now=20)
        hits[host_blocks] = second.host_tokens
    assert hits == {150: 0, 186: 800}


def test_the_host_tier_evicts_the_least_recently_used_history_first() -> None:
    """GIVEN conversations A then B stored, then A's next turn (loading and
    re-storing A's history) THEN new blocks push out B's history, the least
    recently used, and keep A's, stored first."""
    a, b, c = 7, 8, 9
    rep = replica(num_gpu_blocks=ONE_REQUEST_POOL, host_blocks=200)
    run_alone(rep, request(1, conversation=a))  # 93 blocks stored
    run_alone(rep, request(2, conversation=b), now=10)  # 186
    a2 = request(3, conversation=a, history=800)
    # A's 50 move to the tail, 43 more push out 29 of A's oldest (off-stream) ones.
    run_alone(rep, a2, now=20)
    assert a2.host_tokens == 800
    # 93 more push out the 93 oldest: A's 14 left off-stream, B's 50, 29 more.
    run_alone(rep, request(4, conversation=c, stream=0), now=30)
    host = rep.host
    assert host is not None and len(host) == 200
    assert all(stream_block_hash(b, k) not in host for k in range(50))
    assert all(stream_block_hash(a, k) in host for k in range(50))
    a3 = request(5, conversation=a, history=800)
    run_alone(rep, a3, now=40)
    b2 = request(6, conversation=b, history=800)
    run_alone(rep, b2, now=50)
    assert (a3.host_tokens, b2.host_tokens) == (800, 0)


# -- the load cost ---------------------------------------------------------------------


def test_the_host_load_lengthens_the_first_prefill_step_by_its_tokens() -> None:
    """GIVEN the same turn with its history on the GPU and in host memory only
    THEN its prefill step takes 800 x host_load_us_per_token longer from host
    memory; the rest of the step is the same."""
    gpu = replica(host_blocks=1000)
    run_alone(gpu, request(1, conversation=7))
    gpu.add(request(2, conversation=7, history=800))
    gpu_steps = segments(gpu, now=10)

    host = replica(num_gpu_blocks=ONE_REQUEST_POOL, host_blocks=1000)
    run_alone(host, request(1, conversation=7))
    run_alone(host, request(2, conversation=8), now=10)
    second = request(3, conversation=7, history=800)
    host.add(second)
    host_steps = segments(host, now=20)

    assert second.host_tokens == 800
    no_load_ms = step_time_from_totals_ms(
        PROFILE,
        decode_seqs=0,
        kv_tokens=0,
        prefill_tokens=400,
        prefill_work=400 * (800 + 200),
    )
    load_ms = 800 * PROFILE.host_load_us_per_token / 1000
    assert load_ms == pytest.approx(4.16)
    assert gpu_steps[0][2] == pytest.approx(no_load_ms)
    assert host_steps[0][2] == pytest.approx(no_load_ms + load_ms)
    # Only that step: the decode segments that follow are the same.
    assert [steps for _, steps, _ in host_steps] == [1, 299]
    assert [steps for _, steps, _ in gpu_steps] == [1, 299]
    assert host_steps[1][2] == pytest.approx(gpu_steps[1][2])


def test_the_load_is_charged_in_the_first_of_several_prefill_steps_only() -> None:
    """GIVEN a host hit of 800 tokens before 4,200 to prefill (three chunks of the
    2,048-token budget) THEN the first step carries the load and the others not."""
    pool = 315  # a 5,000 + 10 token request holds 314 blocks
    rep = replica(num_gpu_blocks=pool, host_blocks=2000)
    run_alone(rep, request(1, conversation=7, prompt=5000, output=10))
    run_alone(rep, request(2, conversation=8, prompt=5000, output=10), now=10)
    second = request(3, conversation=7, prompt=5000, output=10, history=800)
    rep.add(second)
    steps = segments(rep, now=20)
    assert second.host_tokens == 800 and not second.load_pending

    def prefill_ms(n: int, computed: int) -> float:
        return step_time_from_totals_ms(
            PROFILE,
            decode_seqs=0,
            kv_tokens=0,
            prefill_tokens=n,
            prefill_work=n * (computed + n / 2),
        )

    load_ms = 800 * PROFILE.host_load_us_per_token / 1000
    assert [s[1] for s in steps[:3]] == [1, 1, 1]
    assert steps[0][2] == pytest.approx(prefill_ms(2048, 800) + load_ms)
    assert steps[1][2] == pytest.approx(prefill_ms(2048, 2848))
    assert steps[2][2] == pytest.approx(prefill_ms(104, 4896))


# -- a host hit is whole blocks of the cacheable history -------------------------------


def test_a_host_hit_stops_below_the_last_prompt_token() -> None:
    """GIVEN a stored history that covers the whole next prompt (800 tokens, 50
    blocks) THEN the host hit is 49 blocks: the last block holds the last prompt
    token, which is always computed."""
    rep = replica(num_gpu_blocks=ONE_REQUEST_POOL, host_blocks=1000)
    run_alone(rep, request(1, conversation=7, prompt=900, stream=900))
    run_alone(rep, request(2, conversation=8), now=10)
    second = request(3, conversation=7, prompt=800, output=10, history=800, stream=800)
    before = rep.prefill_tokens
    run_alone(rep, second, now=20)
    assert second.host_tokens == 784 == second.cacheable_tokens(BS)
    assert second.cached_tokens == 784
    assert rep.prefill_tokens - before == 16


def test_a_host_hit_is_whole_blocks_of_a_history_that_is_not() -> None:
    rep = replica(num_gpu_blocks=ONE_REQUEST_POOL, host_blocks=1000)
    run_alone(rep, request(1, conversation=7, prompt=1000, stream=1000))
    run_alone(rep, request(2, conversation=8), now=10)
    second = request(3, conversation=7, history=810, stream=810)
    run_alone(rep, second, now=20)
    assert second.host_tokens == 800 == second.cacheable_tokens(BS)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hits_never_pass_the_cacheable_history_under_churn(seed: int) -> None:
    """GIVEN histories and prompts of every length on a small pool and a small
    host tier THEN every hit is whole blocks within the cacheable history, the
    host tier's part of it too, and the counters add up."""
    rep = replica(num_gpu_blocks=120, host_blocks=150)
    arrivals = chat_arrivals(seed, rate=6.0, varied=True)
    drive(rep, arrivals)
    assert all(r.finished_at is not None for r in arrivals)
    for r in arrivals:
        assert r.cached_tokens % BS == 0 and r.host_tokens % BS == 0
        assert 0 <= r.host_tokens <= r.cached_tokens <= r.cacheable_tokens(BS)
    hosted = sum(r.host_tokens for r in arrivals)
    assert hosted > 0 and rep.host_hit_tokens == hosted
    assert rep.prefill_tokens == sum(
        r.prompt_tokens - r.cached_tokens for r in arrivals
    )
    host = rep.host
    assert host is not None and len(host) <= 150 and host.evictions > 0


# -- the fleet config sizes the tier ---------------------------------------------


@pytest.mark.parametrize("gib", [-0.5, float("inf"), float("nan")])
def test_the_config_refuses_a_host_tier_that_is_not_a_finite_size(gib: float) -> None:
    with pytest.raises(ValueError, match="host_offload_gib"):
        FleetConfig(host_offload_gib=gib)


@pytest.mark.parametrize(
    ("gib", "block_size", "blocks"),
    [
        (0.0, 64, 0),
        (1.0, 64, 128),  # 2^30 / (64 x 131,072)
        (1.5, 64, 192),
        (1.0, 16, 512),
        (0.01, 64, 1),  # 10,737,418.24 / 8,388,608: floor
        (128.0, 64, 16_384),
    ],
)
def test_host_blocks_are_the_gib_over_a_blocks_kv_bytes(
    gib: float, block_size: int, blocks: int
) -> None:
    config = FleetConfig(host_offload_gib=gib, block_size=block_size)
    assert PROFILE.kv_bytes_per_token == 131_072 and PROFILE.gpus == 1
    expected = int(gib * 2**30 // (block_size * PROFILE.kv_bytes_per_token))
    assert config.host_blocks == expected == blocks


def test_host_blocks_of_a_tensor_parallel_profile_count_every_ranks_kv() -> None:
    """vLLM's offloading size is the total over the TP ranks: a token's KV there
    is ``kv_bytes_per_token`` (per GPU) times the GPUs."""
    profile = PROFILES["h100-70b-tp4"]
    config = FleetConfig(profile=profile.name, host_offload_gib=10.0, block_size=64)
    per_block = 64 * profile.kv_bytes_per_token * profile.gpus
    assert config.host_blocks == int(10 * 2**30 // per_block) == 512


# -- a small fleet run -----------------------------------------------------------------

# a100-8b with 6,336 tokens of KV (100 blocks of 64): a few requests' worth, so a
# conversation's history is gone from the GPU long before its next message.
SMALL_KV = dataclasses.replace(PROFILE, name="a100-8b-small-kv", num_gpu_blocks=397)
CHAT = ChatWorkload(
    arrival_rate=4.0, message_interval_s=10.0, answer_tokens=50, max_tokens=50
)


@pytest.fixture
def small_kv(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(PROFILES, SMALL_KV.name, SMALL_KV)
    return SMALL_KV.name


def fleet_summary(profile: str, host_offload_gib: float | None) -> dict[str, object]:
    values: dict[str, object] = {"replicas": 2, "profile": profile, "seed": 4}
    if host_offload_gib is not None:
        values["host_offload_gib"] = host_offload_gib
    sim = FleetSim(FleetConfig(**values), CHAT)  # type: ignore[arg-type]
    for rep in sim.replicas.values():
        assert rep.pool.num_blocks == 100
        assert (rep.host is None) == (not host_offload_gib)
    return dict(sim.run(30.0, warmup_s=20.0).summary())


def test_a_fleet_with_host_offload_finds_more_history(small_kv: str) -> None:
    without = fleet_summary(small_kv, 0.0)
    with_host = fleet_summary(small_kv, 8.0)  # 1,024 blocks of 64 per replica
    assert without == fleet_summary(small_kv, None)  # 0 GiB: the default fleet
    assert without["host_hit_rate"] == 0
    hit, host_hit = with_host["prefix_hit_rate"], with_host["host_hit_rate"]
    base = without["prefix_hit_rate"]
    assert isinstance(hit, float) and isinstance(host_hit, float)
    assert isinstance(base, float)
    assert base < 0.5 < hit
    assert 0 < host_hit <= hit
    assert hit - host_hit == pytest.approx(base, abs=0.25)  # the GPU's part

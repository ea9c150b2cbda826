"""The fleet simulator: determinism, the gateway's own policy objects, failures,
trace replay, and the routing A/B's shape on small fleets."""

from __future__ import annotations

import ast
import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig, FleetEvent
from drills.domain.fleet_result import OUTCOMES, FleetSummary, GroupFigures
from drills.domain.routing_ab import generate_arrivals, run_routing_ab
from drills.domain.workload import (
    Arrival,
    ChatWorkload,
    TeamSpec,
    read_trace,
    trace_arrivals,
)
from routing.domain import policies
from routing.domain.policies import RouteDecision, RouteRequest
from routing.domain.policies.prefix_affinity import PrefixAffinityPolicy
from routing.domain.snapshot import NodeSnapshot

ROOT = Path(__file__).resolve().parents[3]


# Long prompts take ~0.3 s to prefill, so a lost replica always holds some requests
# that have no token yet.
LONG_PROMPTS = ChatWorkload(arrival_rate=20.0, prompt_tokens=4000, history_tokens=0)


def small(policy: str = "prefix_affinity", **overrides: Any) -> FleetConfig:
    values: dict[str, Any] = {"replicas": 4, "policy": policy, "seed": 5, **overrides}
    return FleetConfig(**values)


def test_a_run_is_deterministic_for_a_seed_and_changes_with_it() -> None:
    def run(seed: int) -> FleetSummary:
        sim = FleetSim(small(seed=seed), ChatWorkload(arrival_rate=20.0))
        return sim.run(60.0, warmup_s=20.0).summary()

    first, again, other = run(1), run(1), run(2)
    assert first == again
    assert first["requests"] != other["requests"] or first != other


def test_it_routes_with_the_gateways_policy_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, str | None]] = []
    original = PrefixAffinityPolicy.choose

    def spy(
        self: PrefixAffinityPolicy,
        req: RouteRequest,
        nodes: Sequence[NodeSnapshot],
        now: float,
    ) -> RouteDecision:
        decision = original(self, req, nodes, now)
        calls.append((req.routing_key, decision.chosen))
        return decision

    monkeypatch.setattr(PrefixAffinityPolicy, "choose", spy)
    sim = FleetSim(small(), ChatWorkload(arrival_rate=10.0))
    assert type(sim.policy) is policies.POLICIES["prefix_affinity"]
    result = sim.run(30.0, drain_s=60.0)
    routed = [r for r in result.requests if r.routed_at is not None]
    assert len(calls) >= len(routed) > 0
    # Each request went where the policy said.
    by_key: dict[str, list[str | None]] = {}
    for key, chosen in calls:
        by_key.setdefault(key, []).append(chosen)
    for request in routed:
        assert request.replica_id in by_key[f"conv-{request.conversation}"]


def test_no_routing_policy_is_defined_outside_routing_domain() -> None:
    for path in (ROOT / "drills").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                assert "choose" not in methods, f"{path}: {node.name} is a policy copy"


def test_a_lost_replica_retries_requests_without_tokens_and_errors_the_rest() -> None:
    sim = FleetSim(
        small(retry_ratio=1.0, retry_min=1000),
        LONG_PROMPTS,
        events=[FleetEvent(at=30.0, kind="lose_replica")],
    )
    result = sim.run(60.0, drain_s=60.0)
    retried = [r for r in result.requests if r.attempts == 2]
    errors = [r for r in result.requests if r.outcome == "error"]
    assert retried and all(r.outcome == "ok" for r in retried)
    assert errors and all(0 < r.output_tokens < r.max_tokens for r in errors)
    assert any("lost" in text for _, text in result.events)
    assert result.samples[-1].replicas == 3


def test_without_retry_budget_requests_without_tokens_fail_too() -> None:
    sim = FleetSim(
        small(retry_ratio=0.0, retry_min=0),
        LONG_PROMPTS,
        events=[FleetEvent(at=30.0, kind="lose_replica", count=1)],
    )
    result = sim.run(60.0, drain_s=60.0)
    assert not [r for r in result.requests if r.attempts > 1]
    assert [r for r in result.requests if r.outcome == "error" and r.output_tokens == 0]


def test_an_added_replica_serves_after_its_cold_start() -> None:
    sim = FleetSim(
        small(cold_start_s=20.0),
        ChatWorkload(arrival_rate=20.0),
        events=[FleetEvent(at=10.0, kind="add_replica")],
    )
    result = sim.run(60.0)
    counts = [(s.at, s.replicas) for s in result.samples]
    assert (29.0, 4) in counts and (31.0, 5) in counts
    assert any(r.replica_id == "r04" for r in result.requests)


def test_a_team_surge_raises_only_that_teams_arrivals() -> None:
    teams = (TeamSpec("a"), TeamSpec("b"))
    sim = FleetSim(
        small(),
        ChatWorkload(arrival_rate=10.0, teams=teams),
        events=[FleetEvent(at=0.0, kind="team_rate", team="b", factor=4.0)],
    )
    result = sim.run(120.0)
    by_team = result.by("team")
    assert by_team["b"]["requests"] > 3 * by_team["a"]["requests"]


def test_token_limits_charge_the_teams_bucket_and_refuse_over_it() -> None:
    teams = (TeamSpec("quiet"), TeamSpec("noisy", tokens_per_minute=30_000))
    sim = FleetSim(small(), ChatWorkload(arrival_rate=10.0, teams=teams))
    by_team = sim.run(120.0, warmup_s=30.0).by("team")
    # 5 req/s x 1,500 tokens = 450,000 a minute against a limit of 30,000.
    assert by_team["noisy"]["rate_limited"] > 0.8 * by_team["noisy"]["requests"]
    assert by_team["quiet"]["rate_limited"] == 0


def test_group_figures_count_every_outcome_in_order() -> None:
    keys = list(GroupFigures.__annotations__)
    assert keys == ["requests", *OUTCOMES, "ttft_p50_s", "ttft_p95_s"]


def test_trace_replay_works_out_each_turns_history(tmp_path: Path) -> None:
    turn_one = [{"role": "user", "content": "hello there " * 40}]
    turn_two = [
        *turn_one,
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "and more " * 10},
    ]
    edited = [{"role": "user", "content": "hello, there " * 40}]
    lines = [
        {"t": 0.0, "conversation": "a", "messages": turn_one, "max_tokens": 20},
        {"t": 1.0, "conversation": "b", "prompt_tokens": 300, "max_tokens": 10},
        {
            "t": 5.0,
            "conversation": "a",
            "messages": turn_two,
            "max_tokens": 20,
            "team": "x",
            "tier": "batch",
        },
        {"t": 6.0, "conversation": "b", "prompt_tokens": 400, "max_tokens": 10},
        {"t": 7.0, "conversation": "a", "messages": edited, "max_tokens": 20},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    arrivals = list(trace_arrivals(read_trace(path)))
    assert [a.history_tokens for a in arrivals[:2]] == [0, 0]
    # The whole first turn, prompt and answer, is the second turn's history.
    assert arrivals[2].history_tokens == arrivals[0].prompt_tokens + 20
    assert arrivals[2].conversation == arrivals[0].conversation
    assert arrivals[3].history_tokens == 310
    assert arrivals[2].tier == "batch" and arrivals[2].team == "x"
    # An edited history shares too little: a new stream, with no history.
    assert arrivals[4].history_tokens == 0
    assert arrivals[4].conversation not in {a.conversation for a in arrivals[:4]}
    sim = FleetSim(small(replicas=1), arrivals=arrivals)
    result = sim.run(30.0)
    assert [r.outcome for r in result.requests] == ["ok"] * 5
    assert result.requests[3].cached_tokens >= 256  # b's first prompt, in 64s


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "max_tokens": 5}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_trace(path)


@pytest.mark.parametrize(
    "line",
    [
        '{"t": 0, "prompt_tokens": null, "max_tokens": 5}',
        '{"t": 0, "prompt_tokens": "many", "max_tokens": 5}',
        '{"t": 0, "prompt_tokens": 10, "max_tokens": [5]}',
        '{"t": 0, "prompt_tokens": 10, "max_tokens": Infinity}',
        '{"t": 0, "prompt_tokens": 10, "max_tokens": 5, "output_tokens": {}}',
        '{"t": 0, "prompt_tokens": 10, "max_tokens": 5, "history_tokens": "x"}',
        '{"t": null, "prompt_tokens": 10, "max_tokens": 5}',
        '{"t": 0, "messages": "hello", "max_tokens": 5}',
        '{"t": 0, "messages": ["hello"], "max_tokens": 5}',
    ],
)
def test_a_trace_field_of_the_wrong_type_is_named(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "prompt_tokens": 10, "max_tokens": 5}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"^trace line 2: "):
        read_trace(path)


def test_trace_numbers_may_be_written_as_strings_or_floats(tmp_path: Path) -> None:
    path = tmp_path / "loose.jsonl"
    path.write_text(
        '{"t": "1.5", "prompt_tokens": "10", "max_tokens": 5.0, "history_tokens": 4}\n'
    )
    (request,) = read_trace(path)
    assert (request.t, request.prompt_tokens, request.max_tokens) == (1.5, 10, 5)
    assert request.output_tokens == 5 and request.history_tokens == 4


def test_routing_ab_shape_on_a_small_fleet() -> None:
    workload = ChatWorkload(arrival_rate=24.0)
    arrivals = generate_arrivals(workload, 240.0, seed=2)
    rows = {
        o.policy: o
        for o in run_routing_ab(
            small(seed=2), arrivals, duration_s=180.0, warmup_s=60.0
        )
    }
    rr, lt, pa = rows["round_robin"], rows["least_tokens"], rows["prefix_affinity"]
    # The same replay: the same requests in every run.
    assert rr.requests == lt.requests == pa.requests
    # Affinity finds the history far more often and computes less prefill.
    assert pa.prefix_hit_rate is not None and rr.prefix_hit_rate is not None
    assert pa.prefix_hit_rate > rr.prefix_hit_rate + 0.4
    assert pa.uncached_prefill_tokens_per_s < 0.8 * rr.uncached_prefill_tokens_per_s
    # Bounded load keeps the hottest replica near 1.25x the average.
    assert pa.imbalance_peak is not None and pa.imbalance_peak < 1.45
    assert lt.imbalance_mean is not None and pa.imbalance_mean is not None
    assert lt.imbalance_mean < pa.imbalance_mean


def test_arrivals_follow_the_workloads_rate_and_users() -> None:
    workload = ChatWorkload(arrival_rate=50.0, message_interval_s=40.0)
    arrivals = generate_arrivals(workload, 200.0, seed=1)
    assert len(arrivals) == pytest.approx(50.0 * 200.0, rel=0.05)
    assert len({a.conversation for a in arrivals}) <= workload.users == 2000
    times = [a.at for a in arrivals]
    assert times == sorted(times)
    turns = [a for a in arrivals if a.history_tokens]
    assert all(a.history_tokens == 800 and a.prompt_tokens == 1200 for a in turns)


def test_growing_conversations_carry_their_whole_history() -> None:
    workload = ChatWorkload(arrival_rate=1.0, message_interval_s=2.0, mode="growing")
    arrivals = generate_arrivals(workload, 60.0, seed=1)
    by_conv: dict[int, list[Arrival]] = {}
    for a in arrivals:
        by_conv.setdefault(a.conversation, []).append(a)
    turns = max(by_conv.values(), key=len)
    assert len(turns) > 3
    for before, after in itertools.pairwise(turns):
        assert after.history_tokens == before.prompt_tokens + before.output_tokens
        assert after.prompt_tokens == after.history_tokens + 400


def test_one_teams_surge_leaves_the_other_teams_requests_unchanged() -> None:
    teams = (TeamSpec("a"), TeamSpec("b"))

    def quiet_arrivals(events: list[FleetEvent]) -> list[tuple[float, int]]:
        sim = FleetSim(
            small(), ChatWorkload(arrival_rate=10.0, teams=teams), events=events
        )
        result = sim.run(60.0)
        return [
            (r.arrived_at, r.conversation) for r in result.requests if r.team == "a"
        ]

    calm = quiet_arrivals([])
    surge = quiet_arrivals(
        [FleetEvent(at=10.0, kind="team_rate", team="b", factor=5.0)]
    )
    assert calm and calm == surge


def test_a_teams_concurrency_cap_refuses_streams_beyond_it_uncharged() -> None:
    teams = (TeamSpec("capped", max_concurrency=3, tokens_per_minute=10**9),)
    sim = FleetSim(small(), ChatWorkload(arrival_rate=5.0, teams=teams))
    result = sim.run(60.0, drain_s=60.0)
    capped = [r for r in result.requests if r.outcome == "rate_limited"]
    assert capped  # 5 req/s x 10 s answers is about 50 streams wanted, 3 allowed
    for sample in result.samples:
        assert (
            sum(
                1
                for r in result.requests
                if r.routed_at
                and r.routed_at <= sample.at
                and (r.finished_at or 1e9) > sample.at
            )
            <= 3
        )
    # Refused requests hold nothing; ended ones gave their slot back: the slots
    # held are exactly the admitted requests still running.
    ended = [r for r in result.requests if r.outcome == "ok"]
    assert ended and not any(r.request_id in sim._tickets for r in capped + ended)
    held = sim.limits.slots.count("capped:chat-7b", sim.now)
    assert held == len(sim._tickets) <= 3


@pytest.mark.parametrize("ring_choices", [0, 1])
def test_waiting_for_the_owner_delays_routing_by_at_most_the_wait(
    ring_choices: int,
) -> None:
    """owner_wait_s holds a request whose warm replica is over the bound (polling
    every 25 ms) for no longer than the wait; without it nothing waits."""
    # Light load on few replicas: loads are a few requests each, so an owner is
    # often over 1.25 times the mean.
    workload = ChatWorkload(arrival_rate=8.0)
    arrivals = generate_arrivals(workload, 60.0, seed=3)

    def routing_delays(wait_s: float) -> list[float]:
        config = FleetConfig(
            replicas=4,
            min_bound_tokens=0,
            ring_choices=ring_choices,
            owner_wait_s=wait_s,
        )
        result = FleetSim(config, arrivals=arrivals).run(50.0, warmup_s=10.0)
        return [
            r.routed_at - r.arrived_at
            for r in result.requests
            if r.routed_at is not None
        ]

    assert max(routing_delays(0.0)) == pytest.approx(0.0, abs=1e-9)
    delays = routing_delays(0.2)
    assert max(delays) > 0.0  # some owner was over the bound and was waited for
    assert max(delays) <= 0.2 + 1e-9


def first_turn(
    conversation: int,
    *,
    at: float,
    team: str,
    tier: str,
    prompt: int,
    answer: int,
    most: int | None = None,
) -> Arrival:
    """A conversation's first turn: no history, no shared prefix; ``most`` is
    its max_tokens (None: the answer's length)."""
    return Arrival(
        at=at,
        team=team,
        tier=tier,
        conversation=conversation,
        prompt_tokens=prompt,
        output_tokens=answer,
        max_tokens=answer if most is None else most,
        history_tokens=0,
        stream_tokens=0,
    )


def _most_at_once(requests: Sequence[Any]) -> int:
    """The most of ``requests`` routed and not yet ended at any instant."""
    edges = sorted(
        [(r.routed_at, 1) for r in requests if r.routed_at is not None]
        + [(r.finished_at, -1) for r in requests if r.routed_at is not None]
    )
    return max(itertools.accumulate(step for _, step in edges))


@pytest.mark.parametrize(("lane", "most"), [(1.0, 40), (0.1, 4)])
def test_the_batch_lane_bounds_the_batch_tiers_streams_in_the_pool(
    lane: float, most: int
) -> None:
    """Forty batch lines of 5,000 tokens arrive at once on two replicas of 100,000
    tokens: without a lane all run; a lane of 0.1 (20,000 tokens) runs four at a
    time, the rest waiting in admission, none lost."""
    team = TeamSpec("bulk", tier="batch", tokens_per_minute=10**9)
    arrivals = [
        first_turn(
            i, at=1.0, team="bulk", tier="batch", prompt=200, answer=200, most=4_800
        )
        for i in range(40)
    ]
    config = small(
        replicas=2,
        admission=True,
        replica_tokens_in_flight=100_000,
        batch_ceiling=1.0,
        batch_lane=lane,
        max_wait_s=600.0,
    )
    result = FleetSim(config, arrivals=arrivals, teams=[team]).run(
        120.0, warmup_s=0.0, drain_s=600.0
    )
    assert [r.outcome for r in result.requests] == ["ok"] * 40
    assert _most_at_once(result.requests) == most


def test_a_route_delay_holds_admitted_tokens_before_the_replica() -> None:
    """The same requests with 20 ms between admission and the replica: each
    first token and end come 20 ms later, so the tokens stay in flight longer."""

    def run_with(delay: float) -> list[Any]:
        config = small(replicas=1, admission=True, route_delay_s=delay)
        arrivals = [
            first_turn(i, at=float(i), team="t", tier="standard", prompt=100, answer=20)
            for i in range(5)
        ]
        result = FleetSim(
            config, arrivals=arrivals, teams=[TeamSpec("t", guaranteed_share=1.0)]
        ).run(10.0)
        return sorted(result.requests, key=lambda r: r.request_id)

    base, delayed = run_with(0.0), run_with(0.02)
    for a, b in zip(base, delayed, strict=True):
        assert b.routed_at == pytest.approx(a.routed_at + 0.02)
        assert b.first_token_at == pytest.approx(a.first_token_at + 0.02)
        assert b.finished_at == pytest.approx(a.finished_at + 0.02)
    with pytest.raises(ValueError, match="route_delay_s"):
        small(route_delay_s=-1.0)


def test_a_trace_line_s_replica_reaches_its_arrival(tmp_path: Path) -> None:
    lines = [
        {"t": 0.0, "prompt_tokens": 50, "max_tokens": 5, "replica": "live-b"},
        {"t": 1.0, "prompt_tokens": 50, "max_tokens": 5},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert [a.replica for a in trace_arrivals(read_trace(path))] == ["live-b", ""]


def test_followed_placement_puts_each_request_where_it_was_served() -> None:
    """One conversation recorded on two live replicas in turn, a third named
    before the simulation has a third replica: followed, the k-th name seen is
    the k-th replica created, and an unserved one is left to the policy;
    unfollowed, prefix affinity keeps the conversation on one replica."""
    recorded = ["live-y", "live-x", "live-y", "live-z", "live-x", "live-y"]
    arrivals = [
        replace(
            first_turn(0, at=float(i), team="t", tier="standard", prompt=80, answer=4),
            replica=name,
        )
        for i, name in enumerate(recorded)
    ]

    def placed(follow: bool) -> list[str | None]:
        config = small(replicas=2, follow_placement=follow)
        result = FleetSim(config, arrivals=arrivals).run(10.0)
        assert [r.outcome for r in result.requests] == ["ok"] * len(recorded)
        return [
            r.replica_id for r in sorted(result.requests, key=lambda r: r.arrived_at)
        ]

    followed = placed(True)
    assert followed[:3] + followed[4:] == ["r00", "r01", "r00", "r01", "r00"]
    unfollowed = placed(False)
    assert len(set(unfollowed)) == 1
    # live-z has no third replica to stand for it: the policy's choice.
    assert followed[3] == unfollowed[3]

"""The gateway and the node agent killed (SIGKILL) under load, then started again.

GIVEN the suite's platform (one gateway; chat-7b on two simulated replicas, started
by the node agent) and three streaming clients of a team of the case's own

WHEN the gateway is killed and, ``FAULT_OUTAGE_S`` seconds later, started again on
its port (as its supervisor would)
THEN no request hangs: each stream open on the killed gateway ends with an error
its client sees (the connection dies mid-body), each request sent while it is
down is refused at once; the first request after the restart is answered in full
within ``RECOVERY_BOUND_S``, and every request started after that is. Usage is
counted once per request, at its end, after its last byte went out
(``routing.request_meter``): a request killed mid-stream is never billed, and no
request is billed twice, so the rows never exceed what the clients were told;
they may fall short of it only by requests that ended at the kill itself, whose
count had not reached Redis yet (at most one per client stream).

WHEN the node agent alone is killed (its replicas run on, in sessions of their
own) and started again ``FAULT_OUTAGE_S`` seconds later
THEN no request hangs or is lost mid-stream; requests fail (at once, with an
error) only between the kill and the recovery, while the gateways have no
replica beating (after the missed-beat window, until the new agent's replicas
serve); the restarted agent stops the replicas its previous life left and starts
their replacements: two replica processes on the agent's ports afterwards, no
port twice, each a serving row, none of the old ones left; the pool is whole
within ``RECOVERY_BOUND_S``; the usage rows hold what the clients were told.
"""

from __future__ import annotations

import itertools
import os
import time

import httpx
import pytest

from tests.faults.harness import Drill, FaultPlatform, Figures, run_drill

pytestmark = [pytest.mark.slow, pytest.mark.soak]

OUTAGE_S = float(os.environ.get("FAULT_OUTAGE_S", "5"))
RECOVERY_BOUND_S = 30.0  # a gateway's start; the missed-beat window, a replica's start


def failed_after(drill: Drill, moment: float) -> list[str]:
    """The outcomes of the requests started after ``moment`` that failed."""
    return [
        a.outcome for a in drill.answers if a.started >= moment and a.outcome != "ok"
    ]


def test_gateway_killed(
    fault_platform: FaultPlatform, record_figures: list[Figures]
) -> None:
    platform = fault_platform
    case = platform.case("gateway_killed")
    restarted_at: list[float] = []

    def restart() -> None:
        restarted_at.append(time.monotonic())
        platform.restart_gateway()

    # Long streams, so that the kill finds each client mid-body.
    load = case.load(max_tokens=200)
    drill = run_drill(
        case,
        fault="the gateway killed (SIGKILL), started again on its port",
        inject=platform.kill_gateway,
        heal=restart,
        recovered=lambda: load.count_ok_since(restarted_at[0]) >= 1,
        outage_s=OUTAGE_S,
        load=load,
    )
    figures = drill.figures
    rows, told = figures.usage_rows, figures.usage_told
    cut = [
        a
        for a in drill.answers
        if a.started < drill.fault_at < a.ended and a.outcome != "ok"
    ]
    # Ended ok within a second of the kill: their count may not have reached Redis.
    at_kill = [
        a
        for a in drill.answers
        if a.outcome == "ok" and drill.fault_at - 1 <= a.ended <= drill.fault_at
    ]
    serving_again = drill.healed_at + (figures.recovery_s or 0.0)
    figures.extra.update(
        cut_streams=len(cut),
        cut_outcomes=sorted({a.outcome for a in cut}),
        cut_mid_body=sum(1 for a in cut if a.first_token_s is not None),
        refused_while_down=sum(
            1
            for a in drill.answers
            if drill.fault_at <= a.started < serving_again and a.outcome != "ok"
        ),
        ok_ended_at_kill=len(at_kill),
        unbilled_requests=told["requests"] - rows.get("requests", 0),
    )
    record_figures.append(figures)
    assert figures.hung == 0, figures.line()
    # A stream cut by the kill ends with an error, never as if complete.
    assert "cut" not in figures.answers, figures.line()
    assert len(cut) <= 3, figures.line()
    assert figures.recovery_s is not None, figures.line()
    assert figures.recovery_s <= RECOVERY_BOUND_S, figures.line()
    assert not failed_after(drill, serving_again), figures.line()
    # Long streams: three before the kill and three after the recovery.
    assert figures.answers.get("ok", 0) >= 6, figures.line()
    # Never billed beyond what the clients were told (nothing twice, nothing cut);
    # short of it by at most the requests that ended at the kill.
    for name in ("requests", "prompt_tokens", "output_tokens"):
        assert rows[name] <= told[name], figures.line()
    assert told["requests"] - rows["requests"] <= len(at_kill), figures.line()
    assert told["requests"] - rows["requests"] <= 3, figures.line()


def one_process_per_row(platform: FaultPlatform) -> bool:
    """Each live replica row (every model's) has one process on its port, and
    no replica process on the agent's ports lacks a row."""
    processes = platform.replica_processes()
    rows = platform.live_replica_urls()
    ports = sorted(port for port, _ in processes)
    return ports == sorted(int(url.rsplit(":", 1)[1]) for url in rows)


def pool_whole_once(platform: FaultPlatform, before: set[int]) -> bool:
    """chat-7b's two replicas serving, one process per replica row, none of the
    processes that were there before the kill, and /healthz ready."""
    try:
        ready = platform.healthz()[0] == 200
    except httpx.HTTPError:
        ready = False
    return (
        ready
        and len(platform.replica_urls()) == 2
        and one_process_per_row(platform)
        and not before & {pid for _, pid in platform.replica_processes()}
    )


def test_agent_killed(
    fault_platform: FaultPlatform, record_figures: list[Figures]
) -> None:
    platform = fault_platform
    case = platform.case("agent_killed")
    before = platform.replica_processes()
    before_pids = {pid for _, pid in before}
    assert one_process_per_row(platform), before
    drill = run_drill(
        case,
        fault="the node agent killed (SIGKILL), started again",
        inject=platform.kill_agent,
        heal=platform.restart_agent,
        recovered=lambda: pool_whole_once(platform, before_pids),
        outage_s=OUTAGE_S,
    )
    figures = drill.figures
    after = platform.replica_processes()
    failed = [a for a in drill.answers if a.outcome != "ok"]
    oks = sorted(a.ended for a in drill.answers if a.outcome == "ok")
    gap = max(
        (b - a for a, b in itertools.pairwise(oks) if b > drill.fault_at),
        default=0.0,
    )
    figures.extra.update(
        replicas_before=before,
        replicas_after=after,
        replica_rows_after=platform.replica_urls(),
        failed_mid_stream=sum(1 for a in failed if a.first_token_s is not None),
        longest_gap_between_answers_s=round(gap, 2),
    )
    record_figures.append(figures)
    assert figures.hung == 0, figures.line()
    assert figures.recovery_s is not None, figures.line()
    assert figures.recovery_s <= RECOVERY_BOUND_S, figures.line()
    serving_again = drill.healed_at + figures.recovery_s
    # Failures only while no replica beat; none mid-stream, none after.
    assert all(drill.fault_at <= a.started < serving_again for a in failed), (
        figures.line()
    )
    assert figures.extra["failed_mid_stream"] == 0, figures.line()
    assert figures.answers.get("ok", 0) >= 9, figures.line()
    # Replaced, not leaked nor doubled: as many processes as before, one per
    # port and row, none of the old ones.
    assert len(after) == len(before), figures.line()
    assert one_process_per_row(platform), figures.line()
    assert not before_pids & {pid for _, pid in after}, figures.line()
    assert len(platform.replica_urls()) == 2, figures.line()
    assert figures.usage_rows == figures.usage_told, figures.line()

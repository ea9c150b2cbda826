"""The load-test gate's measurement against simulated replicas, over HTTP.

The main test replays the shipped trace (``platform/traces/chat-650-250.jsonl``)
against one ``a100-8b`` simulated replica (a real ``python -m simengine``
process, demanding an engine key as the gate's staging replicas do) and runs the
modelled capacity test (``FleetSim``) on the same trace, the same rates, steps and
seed. Its rates bracket the knee that ``manage.py capacity_test --sim --trace``
finds (between 10 and 10.5 req/s, about 2,500 output tokens/s): one step that
holds and one well past it. 10 and 10.5 req/s are left out on purpose: both
measurements put their median streams within 5% (10: 31.6 tokens/s) and 2%
(10.5) of the 30 tokens/s bound, where the replica's own step jitter, or a busy
machine's, decides the verdict (10 req/s failed once with the whole suite and a
vLLM build running beside it), and a flipped verdict moves the answer by a whole
step without saying anything about either measurement. 9.5 req/s (about 2,360
tokens/s in a 24 s window, median stream 35 tokens/s) is the highest step with a
margin. A lower step that also holds (9 req/s, once run here) adds a minute and
proves nothing more: the answer is the highest step that held, which
``drills/tests/unit/test_capacity_test.py`` holds the search to. The live run
takes about 80 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from control.load_test import (
    SHORT_SETTINGS,
    LoadTestError,
    LoadTestResult,
    LoadTestSettings,
    load_test,
)
from drills.domain.capacity_test import (
    CapacityAnswer,
    CapacityStep,
    ReplayRequest,
    read_replay_trace,
    run_trace_capacity_test,
)
from drills.domain.fleet_config import FleetConfig
from localrun.processes import ROOT, Process, free_port, sim_replica

TRACE = ROOT / "platform" / "traces" / "chat-650-250.jsonl"
MODEL = "chat-7b"
RATES = (9.5, 11.0)
# Shorter than SHORT_SETTINGS, for the suite's time: a step places exactly
# rate x window arrivals, so a 24 s window (about 220 requests) judges as well.
GATE_SETTINGS = replace(
    SHORT_SETTINGS,
    rates=RATES,
    stop_after_failures=1,
    warmup_s=6.0,
    duration_s=24.0,
    drain_s=20.0,
)
# One short step at a low rate, for the errors (each ends the test before it runs).
SMOKE_SETTINGS = replace(
    SHORT_SETTINGS, rates=(4.0,), warmup_s=1.0, duration_s=4.0, drain_s=15.0
)
ENGINE_KEY = "engine-key-for-the-gate-test"
# Real-time throughput and the client's send lag: `make test` runs this module
# alone, after the others (a second worker's load once moved 11 req/s by 5.5%).
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def trace() -> list[ReplayRequest]:
    return read_replay_trace(TRACE)


@dataclass(frozen=True)
class Measured:
    live: LoadTestResult
    model: CapacityAnswer
    progress: list[tuple[int, int, CapacityStep]]


@pytest.fixture(scope="module")
def keyed_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """One replica for the module: it demands ``ENGINE_KEY``, as staging ones do."""
    with sim_replica(
        tmp_path_factory.mktemp("keyed"),
        "--sim-profile",
        "a100-8b",
        "--api-key",
        ENGINE_KEY,
        model=MODEL,
    ) as replica:
        yield replica


@pytest.fixture(scope="module")
def measured(trace: list[ReplayRequest], keyed_replica: Process) -> Measured:
    progress: list[tuple[int, int, CapacityStep]] = []
    live = load_test(
        keyed_replica.url,
        model=MODEL,
        api_key=ENGINE_KEY,
        trace=trace,
        settings=GATE_SETTINGS,
        on_step=lambda n, total, step: progress.append((n, total, step)),
    )
    model = run_trace_capacity_test(
        replace(FleetConfig(replicas=1, profile="a100-8b"), block_size=16),
        trace,
        RATES,
        duration_s=GATE_SETTINGS.duration_s,
        warmup_s=GATE_SETTINGS.warmup_s,
        drain_s=GATE_SETTINGS.drain_s,
        stop_after_failures=GATE_SETTINGS.stop_after_failures,
        seed=GATE_SETTINGS.seed,
    )
    return Measured(live=live, model=model, progress=progress)


# -- the answer ---------------------------------------------------------------------


@pytest.mark.e2e
def test_gate_finds_2500_tokens_per_s_on_a100_8b(measured: Measured) -> None:
    live = measured.live
    assert live.tokens_per_s is not None
    assert 2_250 <= live.tokens_per_s <= 2_750
    # It stepped past the knee: the step below it held, the one past it did not.
    assert [s.holds for s in live.steps] == [True, False]
    assert "stream rate" in live.steps[-1].reasons
    assert live.arrival_rate == RATES[0]
    assert all(s.not_started == 0 for s in live.steps)


@pytest.mark.e2e
def test_gate_agrees_with_the_fleet_simulator_on_the_same_replay(
    measured: Measured,
) -> None:
    live, model = measured.live, measured.model
    assert live.tokens_per_s is not None and model.tokens_per_s is not None
    assert abs(live.tokens_per_s - model.tokens_per_s) <= 0.05 * model.tokens_per_s
    assert [s.arrival_rate for s in live.steps] == [s.arrival_rate for s in model.steps]
    for ours, modelled in zip(live.steps, model.steps, strict=True):
        assert ours.holds == modelled.holds
        assert ours.requests == modelled.requests  # the same arrivals
        assert abs(ours.output_tokens_per_s - modelled.output_tokens_per_s) <= (
            0.05 * modelled.output_tokens_per_s
        )
        assert ours.prefix_hit_rate is not None and modelled.prefix_hit_rate
        assert abs(ours.prefix_hit_rate - modelled.prefix_hit_rate) < 0.01


@pytest.mark.e2e
def test_gate_reports_tokens_in_flight_and_the_replays_hit_rate(
    measured: Measured,
) -> None:
    live, model = measured.live, measured.model
    assert live.tokens_in_flight_source == "kv"
    best = model.best_step
    assert best is not None and best.tokens_in_flight is not None
    assert live.tokens_in_flight is not None
    # KV tokens in use against the modelled prompt + max_tokens - generated.
    assert abs(live.tokens_in_flight - best.tokens_in_flight) < 0.15 * (
        best.tokens_in_flight
    )
    # The system prompt's block and later turns' previous prompts.
    assert live.prefix_hit_rate is not None and 0.05 < live.prefix_hit_rate < 0.10
    stored = json.loads(json.dumps(live.as_dict()))
    assert stored["tokens_per_s"] == live.tokens_per_s
    assert len(stored["steps"]) == len(RATES)
    assert stored["criteria"]["stream_min_tokens_per_s"] == 30.0


@pytest.mark.e2e
def test_gate_calls_back_after_every_step(measured: Measured) -> None:
    assert [(n, total) for n, total, _ in measured.progress] == [(1, 2), (2, 2)]
    assert [step for _, _, step in measured.progress] == list(measured.live.steps)


@pytest.mark.e2e
def test_gate_client_is_not_the_bottleneck(measured: Measured) -> None:
    client = measured.live.client
    assert client.cpu_share < 0.8
    assert client.mean_send_lag_s < 0.02


@pytest.mark.e2e
def test_gate_sends_the_engine_key_and_places_rate_times_window_arrivals(
    measured: Measured, trace: list[ReplayRequest]
) -> None:
    # The replica refuses any other key (the next test): every step was answered.
    live = measured.live
    assert all(s.not_started == 0 for s in live.steps)
    for step in live.steps:
        assert step.requests == round(step.arrival_rate * GATE_SETTINGS.duration_s)
    stored = json.loads(json.dumps(live.as_dict()))
    assert stored["trace_requests"] == len(trace)
    assert stored["settings"]["rates"] == list(RATES)


# -- the errors ----------------------------------------------------------------------


@pytest.mark.e2e
def test_a_refused_engine_key_fails_without_showing_it(
    keyed_replica: Process, trace: list[ReplayRequest]
) -> None:
    with pytest.raises(LoadTestError, match="answered 401") as caught:
        load_test(
            keyed_replica.url,
            model=MODEL,
            api_key="not-the-engine-key",
            trace=trace,
            settings=SMOKE_SETTINGS,
        )
    assert "not-the-engine-key" not in str(caught.value)
    assert ENGINE_KEY not in str(caught.value)


@pytest.mark.e2e
def test_a_model_the_replica_does_not_serve_fails(
    keyed_replica: Process, trace: list[ReplayRequest]
) -> None:
    with pytest.raises(LoadTestError, match="does not serve 'reason-70b'"):
        load_test(
            keyed_replica.url,
            model="reason-70b",
            api_key=ENGINE_KEY,
            trace=trace,
            settings=SMOKE_SETTINGS,
        )


@pytest.mark.e2e
def test_a_replica_answering_500_fails_the_test(
    tmp_path: Path, trace: list[ReplayRequest]
) -> None:
    with (
        sim_replica(tmp_path, "--sim-fail-rate", "1", model=MODEL) as replica,
        pytest.raises(LoadTestError, match="answered 500: simulated engine failure"),
    ):
        load_test(
            replica.url,
            model=MODEL,
            api_key=None,
            trace=trace,
            settings=SMOKE_SETTINGS,
        )


def test_an_unreachable_replica_fails_naming_it(trace: list[ReplayRequest]) -> None:
    url = f"http://user:secret@127.0.0.1:{free_port()}"
    with pytest.raises(LoadTestError, match="cannot reach the replica") as caught:
        load_test(url, model=MODEL, api_key=None, trace=trace, settings=SMOKE_SETTINGS)
    assert "secret" not in str(caught.value)
    assert "http://127.0.0.1:" in str(caught.value)


def test_an_empty_trace_fails(tmp_path: Path) -> None:
    with pytest.raises(LoadTestError, match="no requests"):
        load_test("http://127.0.0.1:9", model=MODEL, api_key=None, trace=[])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(LoadTestError, match="no requests"):
        load_test("http://127.0.0.1:9", model=MODEL, api_key=None, trace_path=empty)


def test_an_unreadable_trace_fails_naming_it(tmp_path: Path) -> None:
    with pytest.raises(LoadTestError, match="cannot read the trace"):
        load_test(
            "http://127.0.0.1:9",
            model=MODEL,
            api_key=None,
            trace_path=tmp_path / "missing.jsonl",
        )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "max_tokens": 5, "prompt_tokens": 40}\n')
    with pytest.raises(LoadTestError, match="trace line 1: a replay sends text"):
        load_test("http://127.0.0.1:9", model=MODEL, api_key=None, trace_path=bad)


def test_settings_take_a_models_overrides() -> None:
    settings = LoadTestSettings.from_overrides(
        {"start_tokens_per_s": 1000, "duration_s": 60, "stop_after_failures": 3}
    )
    assert settings.start_tokens_per_s == 1000.0 and settings.duration_s == 60.0
    assert settings.stop_after_failures == 3
    assert settings.arrival_rates(250)[:2] == [4.0, 5.0]
    with pytest.raises(ValueError, match="not a load-test setting"):
        LoadTestSettings.from_overrides({"criteria": 1})
    with pytest.raises(ValueError, match="duration_s"):
        LoadTestSettings.from_overrides({"duration_s": 0})

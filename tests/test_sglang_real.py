"""Real SGLang against its committed capture, and the platform's command line.

``simengine/tests/test_sim_sglang.py`` diffs the simulated SGLang replica
against the reference files in ``simengine/tests/data/sglang-reference/``.
This module starts real SGLang 0.5.23 on this machine's CPU (``make sglang-cpu``,
``docs/sglang-cpu.md``: ``.sglang/bin/sglang-cpu-serve`` serving the tiny Llama of
``make tiny-model``), re-captures the reference from it
(``simengine.conformance.capture``, engine ``"sglang"``) and diffs the
live capture against the committed one, so an SGLang upgrade that changes a
metric, a chunk, the body or the key guard fails here, loudly, instead of leaving
the simulator quietly out of date. ``UPDATE_SGLANG_REFERENCE=1 make test-sglang``
writes the live capture over the reference (then review the diff and commit it).

The capture server takes its key the way the platform gives it, in SGLang's
``--config`` file (``{"api-key": ...}``). Two more tests start SGLang with the
platform's own command line (``sglang_launch_argv``): once through the node
agent's ``LocalProcessActuator``, once with the same argv and a ``.yaml`` key file.

Skipped, with the reason, where ``.sglang/.installed`` or the tiny model is
missing; with ``REQUIRE_SGLANG=1`` that is a failure (the root conftest's
``sglang_tiny_model``). Every start waits on
``/health`` against a deadline (no sleeps) and stops its process group after.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_nodes.actuators import LocalProcessActuator
from engine_nodes.domain.replica_argv import ReplicaSpec, sglang_launch_argv
from engine_nodes.domain.scrape import parse_metrics_text
from localrun.processes import ROOT, free_port, wait_until
from simengine.conformance import (
    CAPTURE_API_KEY,
    SGLANG_CAPTURE_SERVER_FLAGS,
    SGLANG_REFERENCE_DIR,
    Capture,
    capture,
    diff_json_shapes,
    diff_metrics,
    diff_stream,
    json_shape,
    read_capture,
    write_capture,
)

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]

SGLANG_VENV = ROOT / ".sglang"
SERVE = SGLANG_VENV / "bin" / "sglang-cpu-serve"
# The KV pool of every server here (SGLang would size it from memory otherwise:
# 2 million tokens, 1 GB, for the tiny model).
MAX_TOTAL_TOKENS = 65536
# About 30 s on two cores (docs/sglang-cpu.md); the rest is headroom for a
# loaded machine.
START_TIMEOUT_S = 240.0
# SGLang's /health, once it is up, generates one token and answers after at
# least a second (http_server.py health_generate: asyncio.sleep(1) first); it gives
# up after 20 s (SGLANG_HEALTH_CHECK_TIMEOUT).
HEALTH_TIMEOUT_S = 30.0
# What SGLang 0.5.23 says of a --config file not named *.yaml or *.yml
# (utils/server_args_config_parser.py _validate_yaml_file).
# The platform's engine config of an SGLang version served on this CPU.
CPU_ENGINE_CONFIG = {
    "engine": "sglang",
    "device": "cpu",
    "attention_backend": "torch_native",
    "disable_overlap_schedule": True,
    "max_total_tokens": MAX_TOTAL_TOKENS,
}


@pytest.fixture(scope="module")
def tiny_llama(sglang_tiny_model: Path) -> Path:
    """The tiny checkpoint; skips (or fails, ``REQUIRE_SGLANG=1``) through the
    root conftest's gate where real SGLang or the model is not built here."""
    return sglang_tiny_model


def _key_file(path: Path) -> Path:
    """Write the capture key as SGLang's ``--config`` file (mode 0600)."""
    path.write_text(json.dumps({"api-key": CAPTURE_API_KEY}))
    path.chmod(0o600)
    return path


def _stop(popen: subprocess.Popen[bytes], *, grace_s: float = 30.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(grace_s)
    # The scheduler and detokenizer may outlive the leader: the group goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGKILL)
    popen.wait(grace_s)


def _wait_healthy(popen: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Poll ``/health`` until 200; fail with the log's tail if the server exits
    or ``START_TIMEOUT_S`` passes."""

    def up() -> bool:
        if popen.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"SGLang exited {popen.returncode}:\n{tail}")
        try:
            return httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S).is_success
        except httpx.HTTPError:
            return False

    wait_until(up, timeout_s=START_TIMEOUT_S, interval_s=0.5, message=f"{url}/health")


@contextlib.contextmanager
def _serving(argv: list[str], log: Path, url: str) -> Iterator[str]:
    """Run ``argv`` in a session of its own until healthy; yield ``url``."""
    with log.open("wb") as out:
        popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_healthy(popen, url, log)
        yield url
    finally:
        _stop(popen)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Capture:
    """Capture a real SGLang started with the flags the simulated replica is
    diffed with, its key in a ``--config`` file."""
    tmp = tmp_path_factory.mktemp("sglang-real")
    port = free_port()
    argv = [
        str(SERVE),
        "--model-path",
        str(tiny_llama.relative_to(ROOT)),
        "--served-model-name",
        "tiny-llama",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SGLANG_CAPTURE_SERVER_FLAGS,
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--config",
        str(_key_file(tmp / "sglang-config.yaml")),
    ]
    with _serving(argv, tmp / "sglang.log", f"http://127.0.0.1:{port}") as url:
        captured = capture(url, "tiny-llama", timeout_s=120.0)
    if os.environ.get("UPDATE_SGLANG_REFERENCE", "") == "1":
        write_capture(captured, SGLANG_REFERENCE_DIR, engine="sglang")
    return captured


@pytest.fixture(scope="module")
def reference() -> Capture:
    return read_capture(engine="sglang")


def test_sglang_metrics_match_the_reference(live: Capture, reference: Capture) -> None:
    """Every ``sglang:`` family (83 in 0.5.23), none allowed missing."""
    assert diff_metrics(reference.metrics, live.metrics, engine="sglang") == []


def test_sglang_streams_match_the_reference(live: Capture, reference: Capture) -> None:
    assert diff_stream(reference.stream, live.stream) == []
    assert diff_stream(reference.stream_no_usage, live.stream_no_usage) == []
    assert live.stream_content_type == reference.stream_content_type


def test_sglang_plain_answer_matches_the_reference(
    live: Capture, reference: Capture
) -> None:
    ref = json_shape(json.loads(reference.completion))
    got = json_shape(json.loads(live.completion))
    assert diff_json_shapes(ref, got) == []


def test_sglang_prefix_hit_matches_the_reference(
    live: Capture, reference: Capture
) -> None:
    """The radix cache's hit on the repeated long prompt, to the token."""
    assert live.cached_tokens == reference.cached_tokens > 0


def test_sglang_key_guard_from_its_config_file_matches_the_reference(
    live: Capture, reference: Capture
) -> None:
    assert live.auth == reference.auth


def test_the_platform_scraper_reads_real_sglang(live: Capture) -> None:
    """GIVEN the live capture's /metrics (after the server's own warm-up request
    and the capture's five)
    WHEN engine_nodes.domain.scrape parses it
    THEN the pool is --max-total-tokens one-token pages, idle, and the counters
    are the sums over SGLang's is_streaming series."""
    stats = parse_metrics_text(live.metrics)
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(live.metrics):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    assert stats.block_size == 1
    assert stats.num_gpu_blocks == MAX_TOTAL_TOKENS + 1
    assert stats.num_requests_running == stats.num_requests_waiting == 0
    assert stats.prefix_cache_queries == totals["sglang:prompt_tokens_total"] > 0
    assert stats.prefix_cache_hits == totals["sglang:cached_tokens_total"]
    assert stats.prefix_cache_hits >= live.cached_tokens > 0
    # 5 + 3 + 3 + 2 + 2 output tokens (ignore_eos), plus the warm-up's.
    assert stats.generation_tokens == totals["sglang:generation_tokens_total"] >= 15


def _platform_spec(model: Path, port: int) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id="tiny-llama-v1-local-0",
        model="tiny-llama",
        version="v1",
        served_model_name="tiny-llama@v1",
        precision="fp16",
        gpus_per_replica=1,
        engine_config=CPU_ENGINE_CONFIG,
        weights_dir=str(model),
        host="127.0.0.1",
        port=port,
    )


def _cpu_python(tmp: Path) -> str:
    """A ``python`` for ``sglang_launch_argv``: SGLang's venv, CPU engine on."""
    wrapper = tmp / "sglang-python"
    wrapper.write_text(
        "#!/bin/sh\nexport SGLANG_USE_CPU_ENGINE=1\n"
        f'exec "{SGLANG_VENV / "bin" / "python"}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def _answers_with_the_key(url: str) -> None:
    """One chat answer under the served name, with the key; a 401 without."""
    body = {
        "model": "tiny-llama@v1",
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 2,
    }
    chat = f"{url}/v1/chat/completions"
    refused = httpx.post(chat, json=body, timeout=60)
    answer = httpx.post(
        chat,
        json=body,
        headers={"Authorization": f"Bearer {CAPTURE_API_KEY}"},
        timeout=60,
    )
    assert refused.status_code == 401
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 2
    models = httpx.get(
        f"{url}/v1/models", headers={"Authorization": f"Bearer {CAPTURE_API_KEY}"}
    )
    assert [m["id"] for m in models.json()["data"]] == ["tiny-llama@v1"]


def test_real_sglang_serves_the_platforms_command_line(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """GIVEN sglang_launch_argv for a tiny-llama version on CPU, the key in a
    ``.yaml`` --config file
    WHEN real SGLang is started with exactly that argv
    THEN its parser takes every flag and it serves the version's name, guarded
    by the key."""
    port = free_port()
    argv = sglang_launch_argv(
        _platform_spec(tiny_llama, port),
        python=_cpu_python(tmp_path),
        config_file=str(_key_file(tmp_path / "replica.sglang.yaml")),
    )
    with _serving(argv, tmp_path / "sglang.log", f"http://127.0.0.1:{port}") as url:
        _answers_with_the_key(url)


def test_real_sglang_starts_from_the_node_agents_actuator(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """GIVEN the node agent's LocalProcessActuator for real engines, with an
    engine key
    WHEN it starts the tiny-llama SGLang version (its argv, key file, env)
    THEN real SGLang serves it, guarded by the key (the key file is *.yaml:
    SGLang 0.5.23 refuses a .json --config, which a first version of the
    actuator wrote)."""
    port = free_port()
    actuator = LocalProcessActuator(
        kind="vllm",
        log_dir=tmp_path,
        sglang_python=_cpu_python(tmp_path),
        engine_api_key=CAPTURE_API_KEY,
    )
    handle = actuator.start(_platform_spec(tiny_llama, port))
    try:
        assert handle.secret_path is not None
        assert handle.secret_path.suffix == ".yaml"  # SGLang refuses .json
        _wait_healthy(handle.process, f"http://127.0.0.1:{port}", handle.log_path)
        _answers_with_the_key(f"http://127.0.0.1:{port}")
    finally:
        actuator.stop(handle, grace_s=30.0)

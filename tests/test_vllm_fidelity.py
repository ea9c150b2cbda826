"""Real vLLM against its committed capture: what the simulated replica is held to.

``simengine/tests/test_sim_conformance.py`` diffs the simulated replica against
the reference files in ``simengine/tests/data/``. This module re-captures them
from a live real vLLM (the CPU build, tiny Llama, the agent's flags) and diffs the
live capture against the committed one in the same way, so a vLLM upgrade that
changes a metric, a chunk or the body fails here, loudly, instead of leaving the
simulator quietly out of date. ``UPDATE_VLLM_REFERENCE=1 make test-vllm`` writes
the live capture over the reference (then review the diff and commit it).

Under ``make test-vllm`` the capture is of a replica of ``test_vllm_e2e``'s (started
by the node agent with ``CAPTURE_ENGINE_CONFIG``, taken before that module's tests
sent it anything; ``tests/conftest.py``), which saves a vLLM start; run alone, the
module starts a capture server of its own. Either way the first test checks that
the captured engine ran the flags the simulated replica is diffed with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from prometheus_client.parser import text_string_to_metric_families

from localrun.vllm_cpu import MODEL, vllm_server
from simengine.conformance import (
    CAPTURE_API_KEY,
    REFERENCE_DIR,
    Capture,
    capture,
    diff_json_shapes,
    diff_metrics,
    diff_stream,
    json_shape,
    read_capture,
    write_capture,
)
from simengine.surface_capture import SURFACE_ENGINE_CONFIG, SURFACE_ENV

if TYPE_CHECKING:
    from tests.conftest import VllmCaptureSlot

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]

# The capture server: the tiny model's registered flags plus the limits the
# simulated replica is diffed with (simengine.conformance).
CAPTURE_ENGINE_CONFIG = {
    "block_size": 128,
    "max_num_seqs": 32,
    "max_model_len": 2048,
    "enable_prefix_caching": True,
    # The surfaces' flags (a hermes tool-call parser...): the platform's tiny
    # version runs them, and the parser adds a metric family.
    **SURFACE_ENGINE_CONFIG,
}


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    vllm_capture_slot: VllmCaptureSlot,
) -> Capture:
    captured = vllm_capture_slot.capture
    if captured is None:
        tmp = tmp_path_factory.mktemp("vllm-fidelity")
        with vllm_server(
            tmp,
            engine_config=CAPTURE_ENGINE_CONFIG,
            model_dir=tiny_model,
            engine_api_key=CAPTURE_API_KEY,
            env=SURFACE_ENV,
        ) as url:
            captured = capture(url, MODEL)
        vllm_capture_slot.capture = captured
        vllm_capture_slot.source = "this module's capture server"
    if os.environ.get("UPDATE_VLLM_REFERENCE", "") == "1":
        write_capture(captured, REFERENCE_DIR)
    return captured


@pytest.fixture(scope="module")
def reference() -> Capture:
    return read_capture()


def test_the_captured_engine_ran_the_capture_flags(
    live: Capture, vllm_capture_slot: VllmCaptureSlot
) -> None:
    """Whichever vLLM was captured, its KV cache is the one the simulated replica
    is diffed with: 128-token blocks and prefix caching on."""
    (info,) = (
        sample.labels
        for family in text_string_to_metric_families(live.metrics)
        if family.name == "vllm:cache_config_info"
        for sample in family.samples
    )
    seen = (info.get("block_size"), info.get("enable_prefix_caching"))
    expected = (str(CAPTURE_ENGINE_CONFIG["block_size"]), "True")
    assert seen == expected, vllm_capture_slot.source


def test_vllm_metrics_match_the_reference(live: Capture, reference: Capture) -> None:
    assert diff_metrics(reference.metrics, live.metrics) == []


def test_vllm_stream_with_usage_matches_the_reference(
    live: Capture, reference: Capture
) -> None:
    assert diff_stream(reference.stream, live.stream) == []
    assert live.stream_content_type == reference.stream_content_type


def test_vllm_stream_without_usage_matches_the_reference(
    live: Capture, reference: Capture
) -> None:
    assert diff_stream(reference.stream_no_usage, live.stream_no_usage) == []


def test_vllm_plain_answer_matches_the_reference(
    live: Capture, reference: Capture
) -> None:
    ref = json_shape(json.loads(reference.completion))
    got = json_shape(json.loads(live.completion))
    assert diff_json_shapes(ref, got) == []


def test_vllm_prefix_hit_matches_the_reference(
    live: Capture, reference: Capture
) -> None:
    assert live.cached_tokens == reference.cached_tokens


def test_vllm_engine_key_guard_matches_the_reference(
    live: Capture, reference: Capture
) -> None:
    assert live.auth == reference.auth

"""Real vLLM on tools, structured output, n, completions and responses.

``simengine/tests/data/vllm_surfaces/`` is a capture of real vLLM 0.32.0 (CPU
build, tiny Llama) on the OpenAI surfaces beyond plain chat
(``simengine.surface_capture``); the simulated replica is held to it. This module
starts one real vLLM with the same flags (``SURFACE_ENGINE_CONFIG`` over the
fidelity capture's, ``SURFACE_ENV``), re-captures every case and diffs the
shapes against the committed files, so a vLLM upgrade that changes a surface
fails here. ``UPDATE_VLLM_SURFACES=1`` writes the live capture over the committed
one (review the diff, then commit it). Under ``make test-vllm`` the capture is of
a replica of ``test_vllm_e2e``'s, which runs the same flags (``tests/conftest.py``),
and that module drives the same surfaces with the ``openai`` SDK through the
gateway; run alone, this module starts a capture server of its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pydantic
import pytest

from localrun.vllm_cpu import MODEL, vllm_server
from simengine.conformance import diff_json_shapes
from simengine.surface_capture import (
    SURFACE_ENV,
    SURFACES_DIR,
    Answer,
    capture_surfaces,
    read_surfaces,
    surface_shape,
    write_surfaces,
)
from tests.test_vllm_fidelity import CAPTURE_ENGINE_CONFIG

if TYPE_CHECKING:
    from tests.conftest import VllmCaptureSlot

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]


class Weather(pydantic.BaseModel):
    """The capture's weather schema (``WEATHER_SCHEMA``) as a pydantic model:
    validating against it is validating against the schema."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome"]
    days: int = pydantic.Field(ge=1, le=3)


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    vllm_capture_slot: VllmCaptureSlot,
) -> dict[str, Answer]:
    answers = vllm_capture_slot.surfaces
    if answers is None:
        with vllm_server(
            tmp_path_factory.mktemp("vllm-surfaces"),
            engine_config=CAPTURE_ENGINE_CONFIG,
            model_dir=tiny_model,
            env=SURFACE_ENV,
            name="vllm-surfaces",
        ) as url:
            answers = capture_surfaces(url, MODEL)
        vllm_capture_slot.surfaces = answers
        vllm_capture_slot.surfaces_source = "this module's capture server"
    if os.environ.get("UPDATE_VLLM_SURFACES", "") == "1":
        write_surfaces(answers, SURFACES_DIR)
    return answers


def test_every_surface_matches_the_committed_capture(live: dict[str, Answer]) -> None:
    reference = read_surfaces()
    assert sorted(live) == sorted(reference)
    problems = {
        name: diff
        for name, answer in reference.items()
        if (diff := diff_json_shapes(surface_shape(answer), surface_shape(live[name])))
    }
    assert problems == {}


def test_the_forced_tool_call_satisfies_the_schema(live: dict[str, Answer]) -> None:
    """Named and required: the capture itself, parsed (not only its shape)."""
    for name in ("chat_tool_named", "chat_tool_required"):
        (call,) = json.loads(live[name].raw)["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        Weather.model_validate_json(call["function"]["arguments"])

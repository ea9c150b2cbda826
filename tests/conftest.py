"""What the real-vLLM modules share within one session (``make test-vllm``).

Public surface: ``VllmCaptureSlot``, ``vllm_capture_slot``.

Every vLLM start costs 30-90 s on two cores, so a process started for one module
serves another where their tests allow it. ``tests/test_vllm_e2e.py`` starts its
replicas with the capture server's flags (``test_vllm_fidelity.CAPTURE_ENGINE_CONFIG``
over the tiny model's), and its platform captures one of them
(``simengine.conformance.capture``) as soon as it serves, before any of its
tests sends it a request; ``tests/test_vllm_fidelity.py`` diffs that capture
against the committed reference, and starts a capture server of its own only
where no capture was left here (the module run alone, or first). Nothing here
starts a process: the slot is empty until a module fills it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from simengine.conformance import Capture
    from simengine.surface_capture import Answer


@dataclass
class VllmCaptureSlot:
    """Captures of real vLLM taken earlier in the session, and what served them:
    plain chat and metrics (``capture``, for ``test_vllm_fidelity``) and the
    surfaces beyond chat (``surfaces``, for ``test_vllm_surfaces``)."""

    capture: Capture | None = None
    source: str = ""
    surfaces: dict[str, Answer] | None = None
    surfaces_source: str = ""


@pytest.fixture(scope="session")
def vllm_capture_slot() -> VllmCaptureSlot:
    return VllmCaptureSlot()

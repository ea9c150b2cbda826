"""The batch-time model of one simulated embedding replica, per device.

Public surface: ``EmbeddingProfile``, ``EMBEDDING_PROFILES``,
``CPU_EMBEDDING_PROFILE``, ``EMBEDDING_PROFILE_FOR``, ``embedding_profile_for``.

An embedding replica is a batcher: waiting requests go to the engine together and a
batch of ``n`` input tokens takes ``batch_base_ms + per_token_ms x n``. A profile
holds the two constants for one encoder on one device, and ``max_batch_tokens``, the
most tokens one batch holds, at which ``full_batch_tokens_per_s`` is the replica's
capacity.

- ``cpu-minilm`` is **measured**: real vLLM 0.32.0 (CPU build) serving
  all-MiniLM-L6-v2 in float32 on this box's two shared cores; 64 single-text
  requests of 37.5 tokens on average gave 1,618 to 1,768 tokens/s at concurrency 1
  (about 21 ms a request) and 2,798 to 2,864 tokens/s at concurrency 8 (about
  106 ms a batch of 8, 300 tokens); a line through both: 9 ms a batch plus 0.32 ms
  a token.
- ``a100-minilm`` and ``h100-minilm`` are **estimates, not measurements**: no
  embedding throughput on a GPU was measured or found in the project's research
  notes. They scale the CPU measurement by the chat profiles' own GPU/CPU ratio
  (``simengine.domain.perf``): per token, by the linear-layer time per parameter
  (``ctok_ms`` over the parameters in the layers) of the GPU profile (``a100-8b``:
  Llama-3-8B, 6.98 B) over ``cpu-tiny``'s (the tiny Llama, 294,912), about 2,200
  times faster on an A100; per batch, by the fixed step cost (``a_ms`` over
  ``cpu-tiny``'s ``a_ms + p_ms``). Check on the ratio: MiniLM's 6 layers hold
  10.6 M parameters, so 0.32 ms a token on the CPU is 0.066 TFLOP/s where
  ``cpu-tiny`` reaches 0.088: the two CPU measurements agree within 25%. The
  estimate is the device's time alone: the host's tokenizer and the API server
  (which the CPU figure includes) may bound a real GPU server lower.

A chat profile names its embedding profile by device (``EMBEDDING_PROFILE_FOR``),
so a replica started with ``--sim-profile a100-8b`` (what ``replica_argv`` passes
an FP16 one-GPU version) embeds at an A100's estimated speed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from simengine.domain.perf import PROFILES, PerfProfile

__all__ = [
    "CPU_EMBEDDING_PROFILE",
    "EMBEDDING_PROFILES",
    "EMBEDDING_PROFILE_FOR",
    "EmbeddingProfile",
    "embedding_profile_for",
]


@dataclass(frozen=True, slots=True)
class EmbeddingProfile:
    """One encoder's batch time on one device.

    Invariants: ``batch_base_ms >= 0``, ``per_token_ms > 0``,
    ``max_batch_tokens >= 1``.
    """

    name: str
    batch_base_ms: float
    per_token_ms: float
    max_batch_tokens: int
    is_measured: bool
    description: str = ""

    def __post_init__(self) -> None:
        if self.batch_base_ms < 0 or self.per_token_ms <= 0:
            raise ValueError(f"embedding profile {self.name}: times must be positive")
        if self.max_batch_tokens < 1:
            raise ValueError(f"embedding profile {self.name}: needs a batch size")

    def batch_seconds(self, batch_tokens: int) -> float:
        """Return how long the engine takes over a batch of ``batch_tokens``."""
        return (self.batch_base_ms + self.per_token_ms * batch_tokens) / 1000.0

    @property
    def full_batch_tokens_per_s(self) -> float:
        """Input tokens a second when every batch holds ``max_batch_tokens``."""
        return self.max_batch_tokens / self.batch_seconds(self.max_batch_tokens)


# Parameters in the linear layers, which the per-token time scales with.
# Tiny Llama (localrun's make_tiny_model): 2 layers x (q, o 128x128; k, v 128x64;
# gate, up, down 128x256).
_TINY_LLAMA_LAYER_PARAMS = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256)
# Llama-3-8B: 6.98 B of its 8.03 B parameters are in the layers (research notes,
# sim-engine.md §2.1).
_LLAMA3_8B_LAYER_PARAMS = 6.98e9

_CPU_BATCH_BASE_MS = 9.0
_CPU_PER_TOKEN_MS = 0.32


def _scaled(name: str, gpu: PerfProfile, cpu: PerfProfile) -> EmbeddingProfile:
    per_param_gpu = gpu.ctok_ms / _LLAMA3_8B_LAYER_PARAMS
    per_param_cpu = cpu.ctok_ms / _TINY_LLAMA_LAYER_PARAMS
    token_ratio = per_param_cpu / per_param_gpu
    base_ratio = (cpu.a_ms + cpu.p_ms) / gpu.a_ms
    return EmbeddingProfile(
        name=name,
        batch_base_ms=_CPU_BATCH_BASE_MS / base_ratio,
        per_token_ms=_CPU_PER_TOKEN_MS / token_ratio,
        max_batch_tokens=16_384,
        is_measured=False,
        description=(
            f"all-MiniLM-L6-v2 on the GPU of {gpu.name}: an estimate, not a "
            f"measurement. cpu-minilm's per-token time over {token_ratio:,.0f} "
            f"({cpu.name} vs {gpu.name}, linear-layer time per parameter) and its "
            f"batch time over {base_ratio:.1f} (their fixed step costs)."
        ),
    )


CPU_EMBEDDING_PROFILE = EmbeddingProfile(
    name="cpu-minilm",
    batch_base_ms=_CPU_BATCH_BASE_MS,
    per_token_ms=_CPU_PER_TOKEN_MS,
    max_batch_tokens=2_048,
    is_measured=True,
    description=(
        "Real vLLM 0.32.0, CPU build, serving all-MiniLM-L6-v2 in float32 on a "
        "2-core box: 9 ms a batch plus 0.32 ms a token (measured)."
    ),
)

EMBEDDING_PROFILES: Mapping[str, EmbeddingProfile] = MappingProxyType(
    {
        profile.name: profile
        for profile in (
            CPU_EMBEDDING_PROFILE,
            _scaled("a100-minilm", PROFILES["a100-8b"], PROFILES["cpu-tiny"]),
            _scaled("h100-minilm", PROFILES["h100-8b"], PROFILES["cpu-tiny"]),
        )
    }
)

# Each chat profile (``--sim-profile``) -> the embedding profile of its device.
EMBEDDING_PROFILE_FOR: Mapping[str, str] = MappingProxyType(
    {
        "a100-8b": "a100-minilm",
        "h100-8b": "h100-minilm",
        "h100-70b-tp4": "h100-minilm",
        "h100-70b-int8-tp2": "h100-minilm",
        "cpu-tiny": "cpu-minilm",
    }
)


def embedding_profile_for(sim_profile: str | None) -> EmbeddingProfile:
    """Return the embedding profile of the device ``sim_profile`` stands for;
    ``cpu-minilm`` (the measured one) when no profile was chosen.

    Raises:
        KeyError: ``sim_profile`` is no chat profile.
    """
    if sim_profile is None:
        return CPU_EMBEDDING_PROFILE
    return EMBEDDING_PROFILES[EMBEDDING_PROFILE_FOR[sim_profile]]

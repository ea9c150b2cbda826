"""The step-time model of one vLLM replica (research spec §2).

Public surface: ``PerfProfile``, ``PROFILES``, ``DEFAULT_PROFILE``, ``step_time_ms``,
``step_time_from_totals_ms``, ``jitter_factor``.

One engine step with ``B_dec`` decode sequences reading ``S_kv`` KV tokens, plus
``P`` prefill chunks of ``n_i`` tokens over ``c_i`` already-cached tokens, takes::

    N_tok = B_dec + Σ n_i
    A_pf  = Σ n_i · (c_i + n_i / 2)
    T_dev = a + max(W, c_tok · N_tok) + b · B_dec + p · P
            + k_kv · S_kv / 1000 + k_att · A_pf
    T_ms  = max(T_dev, h · (B_dec + P))

``k_kv`` is in µs per KV token (hence the ``/ 1000``); every other constant is in ms.
The step is memory-bound (``W``, reading the weights) until ``c_tok · N_tok > W``,
then compute-bound. ``p`` is a fixed cost per prefill chunk (its attention set-up
and sampling state), 0 in the GPU profiles; on CPU it is measured (``cpu-tiny``: a
prefill step costs about 1.5 ms more than a decode step before its first token).
``h`` is the host's time per sequence in the step (scheduling, sampling, output
processing, detokenizing and streaming), which overlaps the device's work: the
step takes the longer of the two, so past some batch size a replica is host-bound
and its step time grows by ``h`` per sequence instead of ``b``. It is 0 in the GPU
profiles (not measured there); ``cpu-tiny`` turns host-bound at about 16 sequences.
A lognormal multiplier with mean 1 (``jitter_factor``) models step-to-step noise.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "PerfProfile",
    "jitter_factor",
    "step_time_from_totals_ms",
    "step_time_ms",
]


@dataclass(frozen=True, slots=True)
class PerfProfile:
    """The constants of one model on one GPU set (spec §2.3).

    Invariants: every time constant is ≥ 0 and ``w_ms > 0``; ``num_gpu_blocks`` counts
    vLLM's null block, so ``num_gpu_blocks - 1`` blocks hold KV.
    """

    name: str
    a_ms: float  # fixed per-step overhead (CPU, launches, sampler)
    w_ms: float  # weight-read floor of the linear layers (memory-bound regime)
    ctok_ms: float  # linear layers per token (compute-bound regime)
    b_ms: float  # per decode sequence (scheduling, sampling, output)
    kkv_us: float  # decode attention per KV token read, in µs
    katt: float  # prefill attention, ms per unit of Σ n·(ctx + n/2)
    num_gpu_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int = 16
    gpus: int = 1
    description: str = ""
    # The API server's time before a request reaches the engine (HTTP, chat
    # template, tokenizer), counted in TTFT; the simulated replica waits this long.
    frontend_ms: float = 5.0
    p_ms: float = 0.0  # per prefill chunk in the step
    h_ms: float = 0.0  # host time per sequence in the step, overlapping the device
    # KV bytes of one token on one GPU of the replica (2 · layers · KV heads ·
    # head size · bytes, over the tensor-parallel GPUs): sizes the CPU offload tier.
    kv_bytes_per_token: int = 131_072
    # Device time to load one token's KV from host memory (the offload tier's cost
    # per block moved, over its tokens): KV bytes over the host link's bandwidth.
    host_load_us_per_token: float = 5.2

    def __post_init__(self) -> None:
        times = (
            self.a_ms,
            self.ctok_ms,
            self.b_ms,
            self.kkv_us,
            self.katt,
            self.frontend_ms,
            self.p_ms,
            self.h_ms,
            self.host_load_us_per_token,
        )
        if self.w_ms <= 0 or min(times) < 0:
            raise ValueError(f"profile {self.name}: time constants must be positive")
        if min(self.num_gpu_blocks - 1, self.max_num_batched_tokens) < 1:
            raise ValueError(f"profile {self.name}: needs KV blocks and a token budget")
        if (
            min(self.max_num_seqs, self.block_size, self.gpus, self.kv_bytes_per_token)
            < 1
        ):
            raise ValueError(f"profile {self.name}: sizes must be positive")


# KV blocks for the INT8 70B on two 80 GB H100s [calc, the brief's formula]:
# (0.9 · 160 GB - 70 GB of INT8 weights - ~3 GB activations/graphs) = 71 GB of KV,
# divided by 16 tokens · 320 KiB per token (Llama-3-70B, 2·80·8·128·2 bytes)
# = 71e9 / 5,242,880 ≈ 13,542 blocks ≈ 216,672 tokens.
_INT8_TP2_KV_BYTES = 0.9 * 160e9 - 70e9 - 3e9
_INT8_TP2_BLOCKS = int(_INT8_TP2_KV_BYTES // (16 * 320 * 1024))

PROFILES: dict[str, PerfProfile] = {
    profile.name: profile
    for profile in (
        PerfProfile(
            name="a100-8b",
            a_ms=0.5,
            w_ms=10.0,
            ctok_ms=0.072,
            b_ms=0.02,
            kkv_us=0.094,
            katt=3.06e-6,
            num_gpu_blocks=26_000,
            max_num_batched_tokens=2048,
            max_num_seqs=256,
            gpus=1,
            # Llama-3-8B: 2·32·8·128·2 bytes; PCIe Gen4 x16 at ~25 GB/s.
            kv_bytes_per_token=131_072,
            host_load_us_per_token=5.2,
            description=(
                "Llama-3-8B BF16 on one A100-80GB (default). Calibrated: 83 "
                "closed-loop streams of 650/250 tokens give about 2,500 output "
                "tok/s at 33 ms TPOT."
            ),
        ),
        PerfProfile(
            name="h100-8b",
            a_ms=0.6,
            w_ms=6.0,
            ctok_ms=0.022,
            b_ms=0.02,
            kkv_us=0.056,
            katt=9.6e-7,
            num_gpu_blocks=26_000,
            max_num_batched_tokens=8192,
            max_num_seqs=1024,
            gpus=1,
            # PCIe Gen5 x16 at ~50 GB/s.
            kv_bytes_per_token=131_072,
            host_load_us_per_token=2.6,
            description=(
                "Llama-3-8B BF16 on one H100-80GB; single-stream ITL ≈ 6.7 ms "
                "(measured vLLM: 6.5 ms)."
            ),
        ),
        PerfProfile(
            name="h100-70b-tp4",
            a_ms=1.5,
            w_ms=16.4,
            ctok_ms=0.054,
            b_ms=0.02,
            kkv_us=0.034,
            katt=1.2e-6,
            num_gpu_blocks=25_000,
            max_num_batched_tokens=8192,
            max_num_seqs=1024,
            gpus=4,
            # Llama-3-70B: 2·80·8·128·2 bytes over 4 GPUs, each its own Gen5 link.
            kv_bytes_per_token=81_920,
            host_load_us_per_token=1.6,
            description=(
                "Llama-3-70B BF16 on four H100-80GB (TP4): W = 13.2 ms weights + "
                "3.2 ms all-reduce. Prefill may be pessimistic by up to 1.5x."
            ),
        ),
        PerfProfile(
            name="h100-70b-int8-tp2",
            a_ms=1.4,
            w_ms=15.6,
            ctok_ms=0.054,
            b_ms=0.02,
            kkv_us=0.068,
            katt=2.4e-6,
            num_gpu_blocks=_INT8_TP2_BLOCKS,
            max_num_batched_tokens=8192,
            max_num_seqs=1024,
            gpus=2,
            # 2·80·8·128·2 bytes over 2 GPUs, each its own Gen5 link.
            kv_bytes_per_token=163_840,
            host_load_us_per_token=3.3,
            description=(
                "Llama-3-70B with INT8 (W8A8) weights on two H100-80GB (TP2); derived, "
                "not measured. W = 14 ms (35 GB of weights per GPU at ~2.5 TB/s) + "
                "1.6 ms all-reduce; c_tok = 0.054 ms (INT8 GEMMs run at about twice "
                "the BF16 rate, on half the GPUs of TP4); k_kv = 0.068 us (160 KiB of "
                "KV per token per GPU at ~70% of 3.35 TB/s); k_att = 2.4e-6 (BF16 "
                "attention, 4·80·64·128 FLOPs per unit split over 2 GPUs at 55% of "
                "989 TFLOP/s); a = 1.4 ms (80 layers of launches, as TP4, less sync); "
                f"{_INT8_TP2_BLOCKS:,} KV blocks = (0.9·160 GB - 70 GB weights - 3 GB) "
                "/ (16 tokens · 320 KiB)."
            ),
        ),
        PerfProfile(
            name="cpu-tiny",
            a_ms=2.138,
            w_ms=0.006691,
            ctok_ms=0.006691,
            b_ms=0.06789,
            kkv_us=0.06333,
            katt=1.309e-05,
            p_ms=1.799,
            h_ms=0.28,
            frontend_ms=4.04,
            num_gpu_blocks=1024,
            max_num_batched_tokens=2048,
            max_num_seqs=32,
            block_size=128,
            gpus=1,
            # The tiny Llama: 2·2·2·32·2 bytes; host and "device" are one memory.
            kv_bytes_per_token=512,
            host_load_us_per_token=0.05,
            description=(
                "Real vLLM 0.32.0, CPU build, serving the tiny Llama (manage.py "
                "make_tiny_model: 2 layers, hidden 128, bf16) on a 2-core AMD EPYC "
                "box: --enforce-eager, 64 MiB of KV cache = 1,024 blocks of 128 "
                "tokens, max_num_seqs 32, max_num_batched_tokens 2048, prefix "
                "caching on, EngineCore and Worker at nice 10. Fitted by "
                "bench/vllm_fidelity.py on 2026-11-30 (least squares on the "
                "engine's own histograms: single prefills of 128-1,536 tokens and "
                "their decode, closed loops of 1/4/16/32 streams), pooled over 2 "
                "runs. No weight-read floor (W = c_tok); p is a prefill step's "
                "set-up; h is host time per sequence (scheduler, detokenizer and "
                "API server share one core): host-bound from about 16 sequences."
            ),
        ),
    )
}
DEFAULT_PROFILE = PROFILES["a100-8b"]


def step_time_from_totals_ms(
    profile: PerfProfile,
    *,
    decode_seqs: int,
    kv_tokens: int,
    prefill_tokens: int,
    prefill_work: float,
    prefill_seqs: int = 0,
) -> float:
    """Return the step time in ms from per-step totals (the engine's fast path).

    ``prefill_tokens`` is ``Σ n_i``, ``prefill_work`` is ``Σ n_i · (c_i + n_i/2)``
    and ``prefill_seqs`` the number of prefill chunks ``P``.
    """
    linear_ms = profile.ctok_ms * (decode_seqs + prefill_tokens)
    device_ms = (
        profile.a_ms
        + max(profile.w_ms, linear_ms)
        + profile.b_ms * decode_seqs
        + profile.p_ms * prefill_seqs
        + profile.kkv_us * 1e-3 * kv_tokens
        + profile.katt * prefill_work
    )
    return max(device_ms, profile.h_ms * (decode_seqs + prefill_seqs))


def step_time_ms(
    profile: PerfProfile,
    *,
    decode_seqs: int,
    kv_tokens: int,
    prefill_chunks: Iterable[tuple[int, int]] = (),
) -> float:
    """Return the time in ms of one step, before jitter.

    Args:
        decode_seqs: sequences decoding one token each (``B_dec``).
        kv_tokens: KV tokens those decodes read, Σ of their context lengths (``S_kv``).
        prefill_chunks: ``(n, ctx)`` per prefill chunk: ``n`` new tokens computed on
            top of ``ctx`` tokens already in the KV cache.
    """
    prefill_tokens = prefill_seqs = 0
    prefill_work = 0.0
    for n, ctx in prefill_chunks:
        prefill_tokens += n
        prefill_seqs += 1
        prefill_work += n * (ctx + n / 2)
    return step_time_from_totals_ms(
        profile,
        decode_seqs=decode_seqs,
        kv_tokens=kv_tokens,
        prefill_tokens=prefill_tokens,
        prefill_work=prefill_work,
        prefill_seqs=prefill_seqs,
    )


def jitter_factor(rng: random.Random, cv: float = 0.04) -> float:
    """Return a lognormal multiplier with mean 1 and coefficient of variation ``cv``.

    ``cv == 0`` returns exactly 1.0 and draws nothing from ``rng``.
    """
    if cv <= 0:
        return 1.0
    sigma_sq = math.log1p(cv * cv)
    return rng.lognormvariate(-sigma_sq / 2, math.sqrt(sigma_sq))

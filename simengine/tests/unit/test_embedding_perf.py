"""The embedding batcher's per-device profiles: which one a replica gets, and the
time a batch takes on each."""

from __future__ import annotations

import pytest

from simengine import embeddings
from simengine.cli import build_parser, options_from_args
from simengine.domain.embedding_perf import (
    CPU_EMBEDDING_PROFILE,
    EMBEDDING_PROFILE_FOR,
    EMBEDDING_PROFILES,
    EmbeddingProfile,
    embedding_profile_for,
)
from simengine.domain.perf import PROFILES
from simengine.server import build_app


def test_every_chat_profile_names_an_embedding_profile() -> None:
    assert set(EMBEDDING_PROFILE_FOR) == set(PROFILES)
    assert set(EMBEDDING_PROFILE_FOR.values()) <= set(EMBEDDING_PROFILES)


@pytest.mark.parametrize(
    ("sim_profile", "expected"),
    [
        (None, "cpu-minilm"),
        ("cpu-tiny", "cpu-minilm"),
        ("a100-8b", "a100-minilm"),
        ("h100-8b", "h100-minilm"),
        ("h100-70b-int8-tp2", "h100-minilm"),
    ],
)
def test_the_embedding_profile_follows_the_chat_profiles_device(
    sim_profile: str | None, expected: str
) -> None:
    assert embedding_profile_for(sim_profile).name == expected


def test_an_unknown_chat_profile_is_refused() -> None:
    with pytest.raises(KeyError):
        embedding_profile_for("tpu-v5")


def test_the_cli_picks_the_embedding_profile_from_sim_profile() -> None:
    def chosen(*argv: str) -> tuple[str, str]:
        options, _ = options_from_args(
            build_parser().parse_args(["--model", "m", "--runner", "pooling", *argv])
        )
        return options.profile, options.embedding_profile

    # No profile: the chat side keeps its default, the batcher the measured CPU.
    assert chosen() == ("a100-8b", "cpu-minilm")
    assert chosen("--sim-profile", "a100-8b") == ("a100-8b", "a100-minilm")
    assert chosen("--sim-profile", "cpu-tiny") == ("cpu-tiny", "cpu-minilm")


def test_the_cpu_profile_is_the_measured_line() -> None:
    cpu = CPU_EMBEDDING_PROFILE
    assert cpu.is_measured
    assert (embeddings.BATCH_BASE_MS, embeddings.PER_TOKEN_MS) == (9.0, 0.32)
    # The measurement's two points: one request of 37.5 tokens in about 21 ms, a
    # batch of 8 (300 tokens) in about 106 ms.
    assert cpu.batch_seconds(37) == pytest.approx(0.021, abs=0.001)
    assert cpu.batch_seconds(300) == pytest.approx(0.106, abs=0.002)
    assert embeddings.batch_seconds(300) == cpu.batch_seconds(300)


def test_batch_time_is_the_base_plus_the_tokens() -> None:
    profile = EmbeddingProfile("p", 2.0, 0.5, 100, is_measured=False)
    assert profile.batch_seconds(0) == pytest.approx(0.002)
    assert profile.batch_seconds(10) == pytest.approx(0.007)
    assert embeddings.batch_seconds(10, profile) == pytest.approx(0.007)
    # 100 tokens in 52 ms.
    assert profile.full_batch_tokens_per_s == pytest.approx(100 / 0.052)


def test_gpu_profiles_are_estimates_scaled_by_the_chat_profiles_ratio() -> None:
    cpu, a100, h100 = (
        EMBEDDING_PROFILES[name]
        for name in ("cpu-minilm", "a100-minilm", "h100-minilm")
    )
    assert not a100.is_measured and not h100.is_measured
    assert "estimate" in a100.description
    tiny, gpu = PROFILES["cpu-tiny"], PROFILES["a100-8b"]
    # Per token: cpu-tiny's and a100-8b's time per linear-layer parameter.
    ratio = (tiny.ctok_ms / 294_912) / (gpu.ctok_ms / 6.98e9)
    assert cpu.per_token_ms / a100.per_token_ms == pytest.approx(ratio)
    assert cpu.batch_base_ms / a100.batch_base_ms == pytest.approx(
        (tiny.a_ms + tiny.p_ms) / gpu.a_ms
    )
    # An H100's linear layers are faster than an A100's, as the chat profiles say.
    h100_ratio = PROFILES["a100-8b"].ctok_ms / PROFILES["h100-8b"].ctok_ms
    assert a100.per_token_ms / h100.per_token_ms == pytest.approx(h100_ratio)
    assert (
        cpu.full_batch_tokens_per_s
        < a100.full_batch_tokens_per_s
        < h100.full_batch_tokens_per_s
    )


@pytest.mark.parametrize(
    ("base", "per_token", "batch"), [(-1.0, 0.1, 1), (1.0, 0.0, 1), (1.0, 0.1, 0)]
)
def test_a_profile_refuses_impossible_constants(
    base: float, per_token: float, batch: int
) -> None:
    with pytest.raises(ValueError, match="embedding profile"):
        EmbeddingProfile("bad", base, per_token, batch, is_measured=False)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [((), "cpu-minilm"), (("--sim-profile", "h100-8b"), "h100-minilm")],
)
def test_the_replicas_batcher_runs_on_the_chosen_profile(
    argv: tuple[str, ...], expected: str
) -> None:
    options, _ = options_from_args(
        build_parser().parse_args(["--model", "m", "--runner", "pooling", *argv])
    )
    app = build_app(options)
    assert app.embedder.profile is EMBEDDING_PROFILES[expected]

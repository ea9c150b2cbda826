"""A version's tool-call parser on each engine's command line."""

from __future__ import annotations

from typing import Any

from engine_nodes.domain.replica_argv import (
    sglang_launch_argv,
    sim_replica_argv,
    vllm_serve_argv,
)
from engine_nodes.tests.unit.test_replica_argv import make_spec


def after(argv: list[str], flag: str) -> str | None:
    """The argument after ``flag``, None when ``flag`` is absent."""
    return argv[argv.index(flag) + 1] if flag in argv else None


def spec(**config: Any) -> Any:
    return make_spec(engine_config=config)


def test_vllm_gets_the_parser_and_auto_tool_choice_with_it() -> None:
    argv = vllm_serve_argv(spec(tool_call_parser="hermes"))
    assert after(argv, "--tool-call-parser") == "hermes"
    assert "--enable-auto-tool-choice" in argv


def test_auto_tool_choice_stays_off_where_the_config_says_so() -> None:
    argv = vllm_serve_argv(
        spec(tool_call_parser="hermes", enable_auto_tool_choice=False)
    )
    assert after(argv, "--tool-call-parser") == "hermes"
    assert "--enable-auto-tool-choice" not in argv
    assert "--no-enable-auto-tool-choice" in argv


def test_no_parser_no_tool_flags() -> None:
    argv = vllm_serve_argv(spec())
    assert "--tool-call-parser" not in argv
    assert "--enable-auto-tool-choice" not in argv


def test_sglang_gets_the_parser_alone() -> None:
    argv = sglang_launch_argv(
        spec(engine="sglang", tool_call_parser="qwen25", enable_auto_tool_choice=True)
    )
    assert after(argv, "--tool-call-parser") == "qwen25"
    assert "--enable-auto-tool-choice" not in argv


def test_the_simulated_replica_gets_the_engines_tool_flags() -> None:
    vllm = sim_replica_argv(spec(tool_call_parser="hermes"))
    assert after(vllm, "--tool-call-parser") == "hermes"
    assert "--enable-auto-tool-choice" in vllm
    sglang = sim_replica_argv(spec(engine="sglang", tool_call_parser="qwen25"))
    assert after(sglang, "--tool-call-parser") == "qwen25"
    assert "--enable-auto-tool-choice" not in sglang

"""KV events on from ``engine_config["kv_events"]``: the platform's endpoint and
topic on every engine's command line."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine_nodes.domain.replica_argv import (
    ReplicaSpec,
    kv_events_config_for,
    sglang_launch_argv,
    sim_replica_argv,
    vllm_serve_argv,
)
from engine_nodes.tests.unit.test_replica_argv import make_spec as base_spec
from simengine.cli import build_parser, options_from_args
from simengine.kv_publisher import KVEventsConfig

EXPECTED = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5601",
    "topic": "kv@chat-7b-v3-local-0@chat-7b@v3",
}


def make_spec(**overrides: Any) -> ReplicaSpec:
    """The argv tests' spec, with events on and their port chosen."""
    return base_spec(
        **{"engine_config": {"kv_events": True}, "kv_events_port": 5601, **overrides}
    )


def flag_value(argv: list[str], flag: str) -> Any:
    assert argv.count(flag) == 1, argv
    return json.loads(argv[argv.index(flag) + 1])


def test_kv_events_config_for_names_the_port_and_topic() -> None:
    assert kv_events_config_for(make_spec()) == EXPECTED
    assert kv_events_config_for(make_spec(engine_config={})) is None
    assert kv_events_config_for(make_spec(engine_config={"kv_events": False})) is None


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engines_and_their_stand_ins_get_the_platform_kv_events_config(
    engine: str,
) -> None:
    spec = make_spec(engine_config={"kv_events": True, "engine": engine})
    real = vllm_serve_argv(spec) if engine == "vllm" else sglang_launch_argv(spec)
    for argv in (real, sim_replica_argv(spec)):
        assert flag_value(argv, "--kv-events-config") == EXPECTED
        assert "--kv-events" not in argv


def test_simulated_replica_parses_the_platform_kv_events_config() -> None:
    argv = sim_replica_argv(make_spec())[3:]
    options, _ = options_from_args(build_parser().parse_args(argv))
    assert options.kv_events == KVEventsConfig(
        True, "zmq", "tcp://*:5601", "kv@chat-7b-v3-local-0@chat-7b@v3"
    )


def test_kv_events_config_passes_through_without_kv_events() -> None:
    own = {"enable_kv_cache_events": True, "endpoint": "tcp://10.0.0.9:5557"}
    spec = make_spec(engine_config={"kv_events_config": own}, kv_events_port=0)
    assert flag_value(vllm_serve_argv(spec), "--kv-events-config") == own
    assert flag_value(sim_replica_argv(spec), "--kv-events-config") == own


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_events_port": 0}, "no kv_events_port"),
        ({"engine_config": {"kv_events": "yes"}}, "boolean"),
        (
            {"engine_config": {"kv_events": True, "kv_events_config": {"x": 1}}},
            "may not set 'kv_events_config'",
        ),
    ],
)
def test_kv_events_refuses_a_config_it_cannot_honour(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        vllm_serve_argv(make_spec(**overrides))


@pytest.mark.parametrize("port", [-1, 65536, True])
def test_replica_spec_refuses_a_bad_kv_events_port(port: Any) -> None:
    with pytest.raises(ValueError, match="kv_events_port"):
        make_spec(kv_events_port=port)

"""The gateway's ASGI servers: the command line ``gateway_argv`` builds for each.

Each command line is parsed by its server's own command-line parser (uvicorn's and
granian's click commands, daphne's argparse), so a flag that an upgrade renames
fails here in milliseconds rather than as a gateway that never starts. The
servers themselves serve streams in routing/tests/test_gateway_e2e.py (``served``).
"""

from __future__ import annotations

import importlib
import sys

import pytest
from granian.cli import cli as granian_cli
from uvicorn.main import main as uvicorn_cli

from localrun.processes import SERVERS, gateway_argv

APP = "config.asgi:application"
# daphne ships no type information (and mypy's overrides in pyproject.toml do not
# name it): imported by name, its parser is Any here.
CommandLineInterface = importlib.import_module("daphne.cli").CommandLineInterface


def test_uvicorn_is_the_default_with_lifespan_and_no_access_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PLATFORM_SERVER", raising=False)
    assert gateway_argv(8100) == [
        sys.executable,
        "-m",
        "uvicorn",
        APP,
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
        "--lifespan",
        "on",
        "--no-access-log",
        "--log-level",
        "warning",
        "--http",
        "config.http_protocol:GatewayHttpProtocol",
    ]
    assert gateway_argv(8100, workers=3)[-2:] == ["--workers", "3"]


def test_platform_server_names_the_server_and_an_argument_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PLATFORM_SERVER", "daphne")
    assert gateway_argv(8100)[1:3] == ["-m", "daphne"]
    assert gateway_argv(8100, server="uvicorn")[1:3] == ["-m", "uvicorn"]
    monkeypatch.setenv("PLATFORM_SERVER", "")
    assert gateway_argv(8100)[1:3] == ["-m", "uvicorn"]


def test_daphne_logs_warnings_and_no_access_log() -> None:
    argv = gateway_argv(8100, server="daphne")
    assert argv[1:] == ["-m", "daphne", "-b", "127.0.0.1", "-p", "8100", "-v", "0", APP]
    args = CommandLineInterface().parser.parse_args(argv[3:])
    assert (args.host, args.port, args.verbosity) == ("127.0.0.1", 8100, 0)
    assert args.access_log is None  # with verbosity 0: none written
    info = gateway_argv(8100, server="daphne", host="0.0.0.0", log_level="info")
    args = CommandLineInterface().parser.parse_args(info[3:])
    assert (args.host, args.verbosity, args.access_log) == ("0.0.0.0", 1, "/dev/null")


def test_granian_runs_the_asgi_interface_on_uvloop() -> None:
    argv = gateway_argv(8100, server="granian", workers=2)
    assert argv[1:3] == ["-m", "granian"]
    context = granian_cli.make_context("granian", argv[3:])
    params = context.params
    assert params["app"] == APP
    assert (params["host"], params["port"], params["workers"]) == ("127.0.0.1", 8100, 2)
    assert str(params["interface"].value) == "asgi"  # asginl sends no lifespan
    assert str(params["loop"].value) == "uvloop"
    assert params["log_access_enabled"] is False


@pytest.mark.parametrize("server", SERVERS)
def test_each_command_line_parses_under_its_server(server: str) -> None:
    argv = gateway_argv(8100, server=server, host="10.0.0.5", log_level="info")
    if server == "daphne":
        assert CommandLineInterface().parser.parse_args(argv[3:]).host == "10.0.0.5"
        return
    command = uvicorn_cli if server == "uvicorn" else granian_cli
    params = command.make_context(server, argv[3:]).params
    assert (params["host"], params["port"]) == ("10.0.0.5", 8100)
    assert str(getattr(params["log_level"], "value", params["log_level"])) == "info"


def test_unknown_server_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"'hypercorn'.*uvicorn, daphne, granian"):
        gateway_argv(8100, server="hypercorn")
    monkeypatch.setenv("PLATFORM_SERVER", "Daphne")
    with pytest.raises(ValueError, match="'Daphne'"):
        gateway_argv(8100)


def test_daphne_refuses_more_than_one_worker() -> None:
    with pytest.raises(ValueError, match="daphne has no --workers"):
        gateway_argv(8100, server="daphne", workers=2)
    assert gateway_argv(8100, server="daphne", workers=1)[1:3] == ["-m", "daphne"]


@pytest.mark.parametrize("server", SERVERS)
def test_no_server_runs_zero_workers(server: str) -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        gateway_argv(8100, server=server, workers=0)

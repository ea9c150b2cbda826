"""The global load balancer's configuration (routing.domain.global_lb)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from routing.domain.global_lb import HealthCheck, Region, ServerHealth, render_haproxy
from routing.management.commands.render_haproxy import parse_region

REGIONS = (
    Region("east", gateway="127.0.0.1:8010", listen="127.0.0.1:8000"),
    Region("west", gateway="127.0.0.1:8020", listen="127.0.0.1:8001"),
)
COMMITTED = Path(__file__).resolve().parents[3] / "platform/haproxy/haproxy.cfg"


def backend(text: str, name: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(f"backend {name}")
    end = next((i for i in range(start + 1, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def test_each_region_keeps_its_clients_and_fails_over_to_the_others() -> None:
    text = render_haproxy(REGIONS)
    east = backend(text, "via_east")
    assert "    server east 127.0.0.1:8010 check" in east
    assert "    server west 127.0.0.1:8020 check backup" in east
    west = backend(text, "via_west")
    assert "    server west 127.0.0.1:8020 check" in west
    assert "    server east 127.0.0.1:8010 check backup" in west
    assert "    http-check send meth GET uri /healthz" in east
    assert "    http-check expect status 200" in east


def test_the_health_check_window_is_inter_times_fall() -> None:
    check = HealthCheck(inter_s=0.5, fall=3, rise=1)
    assert check.window_s == 1.5
    text = render_haproxy(REGIONS, check=check)
    assert "    default-server inter 500ms fall 3 rise 1 observe layer4" in text


def test_bad_regions_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        render_haproxy(())
    with pytest.raises(ValueError, match="unique"):
        render_haproxy((REGIONS[0], REGIONS[0]))
    with pytest.raises(ValueError, match="inter"):
        render_haproxy(REGIONS, check=HealthCheck(inter_s=0))


def test_the_committed_example_is_what_the_command_renders(tmp_path: Path) -> None:
    out = tmp_path / "haproxy.cfg"
    call_command(
        "render_haproxy",
        "--region=east=127.0.0.1:8010,127.0.0.1:8000",
        "--region=west=127.0.0.1:8020,127.0.0.1:8001",
        f"--out={out}",
    )
    assert out.read_text() == COMMITTED.read_text()
    assert out.read_text() == render_haproxy(REGIONS)


def test_haproxy_accepts_the_configuration(tmp_path: Path, haproxy_binary: str) -> None:
    out = tmp_path / "haproxy.cfg"
    out.write_text(render_haproxy(REGIONS, stats_socket=str(tmp_path / "s.sock")))
    checked = subprocess.run(
        [haproxy_binary, "-c", "-f", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "WARNING" not in checked.stdout + checked.stderr


def test_only_requests_that_never_reached_a_gateway_are_resent() -> None:
    text = render_haproxy(REGIONS)
    assert "    retry-on conn-failure" in text.splitlines()
    assert "empty-response" not in text  # a gateway may have done the work


def test_with_no_region_passing_its_checks_clients_are_sent_home_anyway() -> None:
    text = render_haproxy(REGIONS)
    assert "    use_backend last_resort_east if { nbsrv(via_east) eq 0 }" in text
    last = backend(text, "last_resort_east")
    assert last[1:] == [
        "    server east 127.0.0.1:8010",
        "    server west 127.0.0.1:8020 backup",
    ]


@pytest.mark.parametrize(
    "region",
    [
        "east",
        "east=127.0.0.1:8010",
        "east=127.0.0.1:99999,127.0.0.1:8000",
        "east=h\n    server evil 6.6.6.6:1 check\n#:80,127.0.0.1:8000",
        "east=h x:80,127.0.0.1:8000",
    ],
)
def test_the_command_refuses_a_region_it_cannot_render_safely(region: str) -> None:
    with pytest.raises(CommandError):
        call_command("render_haproxy", f"--region={region}")


def test_the_command_takes_names_and_bracketed_ipv6() -> None:
    assert parse_region("east=gw.example:8010,[::1]:8000") == Region(
        "east", gateway="gw.example:8010", listen="[::1]:8000"
    )


def test_health_check_takes_a_server_out_after_fall_failures_and_back_after_rise() -> (
    None
):
    check = HealthCheck(inter_s=2.0, fall=3, rise=2)
    health = ServerHealth()
    seen = []
    for is_passed in (False, False, True, False, False, False, True, False, True, True):
        health = check.observe(health, is_passed=is_passed)
        seen.append(health.is_up)
    # A pass between failures resets the count: down only at the third in a row;
    # back only at the second pass in a row.
    assert seen == [True, True, True, True, True, False, False, False, False, True]


def test_a_failed_connection_marks_a_server_down_at_once() -> None:
    check = HealthCheck(fall=5)
    health = check.connection_failed(ServerHealth())
    assert not health.is_up
    assert check.observe(health, is_passed=True).is_up is False  # rise 2

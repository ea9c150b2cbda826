"""``manage.py render_haproxy``: the global load balancer's haproxy.cfg, from the regions.

Each ``--region NAME=GATEWAY,LISTEN`` names a region, its gateway's host:port and
the host:port its clients dial; the first region is listed first. See
``routing.domain.global_lb`` for what the configuration does.

    manage.py render_haproxy --region east=127.0.0.1:8010,127.0.0.1:8000 \\
        --region west=127.0.0.1:8020,127.0.0.1:8001 --out .local/haproxy.cfg
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from config.names import is_valid_slug
from routing.domain.global_lb import HealthCheck, Region, render_haproxy

_HOST = re.compile(r"[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]")


def parse_region(text: str) -> Region:
    """Parse ``NAME=GATEWAY,LISTEN`` (each address host:port)."""
    name, sep, addresses = text.partition("=")
    gateway, comma, listen = addresses.partition(",")
    if not (sep and comma and is_valid_slug(name)):
        raise CommandError(
            f"--region {text!r}: use NAME=GATEWAY_HOST:PORT,LISTEN_HOST:PORT"
        )
    for address in (gateway, listen):
        host, colon, port = address.rpartition(":")
        # A name or an address, never a space or a newline: the text goes into
        # the configuration as it is.
        if not (
            _HOST.fullmatch(host) and colon and port.isdigit() and 0 < int(port) < 65536
        ):
            raise CommandError(f"--region {text!r}: {address!r} is not host:port")
    return Region(name=name, gateway=gateway, listen=listen)


class Command(BaseCommand):
    help = "Render the global load balancer's haproxy.cfg from the regions."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--region",
            action="append",
            required=True,
            help="NAME=GATEWAY_HOST:PORT,LISTEN_HOST:PORT (repeat per region)",
        )
        parser.add_argument("--check-inter", type=float, default=2.0)
        parser.add_argument("--check-fall", type=int, default=2)
        parser.add_argument("--check-rise", type=int, default=2)
        parser.add_argument("--stats-socket", default="")
        parser.add_argument("--out", default="-", help="a file, or - for stdout")

    def handle(self, *args: Any, **options: Any) -> None:
        regions = [parse_region(text) for text in options["region"]]
        try:
            text = render_haproxy(
                regions,
                check=HealthCheck(
                    inter_s=options["check_inter"],
                    fall=options["check_fall"],
                    rise=options["check_rise"],
                ),
                stats_socket=options["stats_socket"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        out = options["out"]
        if out == "-":
            sys.stdout.write(text)
            return
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Whole or not at all: a reload never reads half a file.
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(temp, 0o644)
        os.replace(temp, path)

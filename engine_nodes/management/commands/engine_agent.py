"""``manage.py engine_agent --node N --region R``: run this node's replicas."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from engine_nodes.actuators import LocalProcessActuator
from engine_nodes.agent import NodeAgent, spec_builder
from engine_nodes.warm_pool import WarmPool


class Command(BaseCommand):
    help = (
        "Run the node agent: start, watch, drain and beat for this node's replicas, "
        "and keep the weights of the region's versions on local disk."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--node", required=True, help="This node's name.")
        parser.add_argument(
            "--region", default=None, help="Defaults to PLATFORM_REGION."
        )
        parser.add_argument("--gpus", type=int, default=8, help="GPUs on this node.")
        parser.add_argument(
            "--kind",
            choices=["sim", "vllm"],
            default="sim",
            help="Run simulated replicas or real engines (`vllm serve`, or SGLang "
            "for a version whose engine is sglang).",
        )
        parser.add_argument(
            "--sglang-python",
            default="python3",
            help="The Python with SGLang installed, for --kind vllm and a version "
            "whose engine is sglang (runs `-m sglang.launch_server`).",
        )
        parser.add_argument(
            "--vllm-executable",
            default="vllm",
            help="The `vllm` command for --kind vllm (e.g. .vllm/bin/vllm, which "
            "`make vllm-cpu` builds).",
        )
        parser.add_argument(
            "--start-timeout-s",
            type=float,
            default=120.0,
            help="How long a replica may take to answer /health before it is "
            "stopped (vLLM: model load and warm-up).",
        )
        parser.add_argument(
            "--host", default="127.0.0.1", help="Address replicas bind."
        )
        parser.add_argument(
            "--ports", default="8001-8099", help="Port range, FIRST-LAST."
        )
        parser.add_argument(
            "--log-dir", type=Path, default=settings.LOCAL_DIR / "logs" / "replicas"
        )
        parser.add_argument(
            "--weights-cache",
            type=Path,
            default=settings.LOCAL_DIR / "weights-cache",
            help="Where this node keeps pulled, verified weights.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            first, last = (int(p) for p in options["ports"].split("-", 1))
        except ValueError:
            raise CommandError("--ports must look like 8001-8099") from None
        region = options["region"] or settings.PLATFORM_REGION
        # Pulls the weights of the region's versions ahead of need (the warm pool).
        warm_pool = WarmPool(
            kind=options["kind"],
            cache_dir=options["weights_cache"],
            storage_roots=settings.PLATFORM_STORAGE_ROOTS,
        )
        sink = None
        if settings.REDIS_URL:
            from engine_nodes.heartbeats import RedisBeatStore

            sink = RedisBeatStore.from_url(
                settings.REDIS_URL,
                prefix=settings.REDIS_KEY_PREFIX,
                ttl_s=settings.PLATFORM_HEARTBEAT_S * settings.PLATFORM_MISSED_BEATS,
            )
        agent = NodeAgent(
            node=options["node"],
            region=region,
            actuator=LocalProcessActuator(
                kind=options["kind"],
                python=sys.executable,
                log_dir=options["log_dir"],
                # Per node and region: several agents may share one log folder.
                pid_dir=options["log_dir"] / "pids" / f"{region}.{options['node']}",
                vllm_executable=options["vllm_executable"],
                sglang_python=options["sglang_python"],
                # In the replicas' environment or a 0600 file, never their argv.
                engine_api_key=settings.PLATFORM_ENGINE_API_KEY,
                sim_admin_token=settings.PLATFORM_SIM_ADMIN_TOKEN,
                otlp_traces_endpoint=settings.PLATFORM_TRACES_ENGINE_ENDPOINT,
            ),
            spec_for=spec_builder(warm_pool=warm_pool),
            warm_pool=warm_pool,
            gpus=options["gpus"],
            host=options["host"],
            ports=(first, last),
            sink=sink,
            start_timeout_s=options["start_timeout_s"],
        )
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        self.stderr.write(
            f"node agent {options['node']} in {region}: {options['gpus']} GPUs, "
            f"{options['kind']} replicas, beats to {'Redis and ' if sink else ''}the database; "
            + (
                "replicas demand the engine key on /v1"
                if settings.PLATFORM_ENGINE_API_KEY
                else "no engine key: replicas serve /v1 to anyone on the host"
            )
        )
        try:
            agent.run(stop)
        finally:
            warm_pool.close()

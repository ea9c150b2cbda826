"""Real vLLM's own spans join the gateway's trace.

The gateway sends the W3C ``traceparent`` of its engine call to the replica; a
replica started by the node agent with traces on gets ``--otlp-traces-endpoint``
(and OTLP over HTTP), so vLLM's ``llm_request`` span should be the child of that
call, in the same trace, at the same collector. ``make test-vllm`` runs this
module: one vLLM replica of the tiny Llama (the CPU build), a gateway under
uvicorn, and the OTLP/HTTP receiver of ``tests/test_traces_e2e.py``.

Where the CPU build cannot be installed the module is skipped with the reason;
with ``REQUIRE_VLLM=1`` that is a failure.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from engine_nodes.models import Replica
from engine_nodes.weights import local_identity
from localrun.processes import start_gateway, wait_until
from localrun.seeding import (
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    seed_platform,
)
from localrun.vllm_cpu import (
    MODEL,
    TINY_VERSION_FILE,
    engine_pid,
    lower_engine_priority,
    start_vllm_agent,
)
from tests.live import LivePlatform, can_serve, platform_env
from tests.otlp_collector import read_spans, running_collector

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]

REGION = "e2e-vllm-traces"
SERVING_TIMEOUT_S = 300
# Said in the prompt only: no attribute of any span may carry it.
SECRET = "violet-anchor-5521 the copper fox naps at dawn"


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Run the OTLP/HTTP receiver; yield its traces URL and its spans file."""
    out = tmp_path_factory.mktemp("otlp") / "spans.jsonl"
    with running_collector(out) as url:
        yield url, out


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    collector: tuple[str, Path],
) -> Iterator[LivePlatform]:
    url, _ = collector
    tmp = tmp_path_factory.mktemp("vllm-traces")
    with django_db_blocker.unblock():
        name = str(connection.settings_dict["NAME"])
        if not name.startswith("test_"):
            raise RuntimeError(f"refusing to run end-to-end tests against {name}")
        body = {
            **local_identity(tiny_model),
            **json.loads(TINY_VERSION_FILE.read_text()),
        }
        seeded = seed_platform(
            seed=PlatformSeed(
                region=REGION,
                teams=(TeamSeed("alpha"),),
                models=(
                    ModelSeed(
                        model_id=MODEL,
                        versions=(
                            VersionSeed("v1", body, min_replicas=1, max_replicas=1),
                        ),
                    ),
                ),
                limits=(
                    LimitSeed(
                        team_id="alpha",
                        model_id=MODEL,
                        tokens_per_minute=10**9,
                        max_concurrency=100,
                    ),
                ),
            ),
            now=timezone.now(),
        )
        env = platform_env(
            region=REGION,
            prefix=f"e2e-{uuid.uuid4().hex[:8]}",
            PLATFORM_TRACES_ENABLED="true",
            PLATFORM_TRACES_ENDPOINT=url,
            PLATFORM_TRACES_SAMPLE_RATIO="1",
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        agent = start_vllm_agent(
            env,
            tmp,
            node="e2e-vllm-traces-node",
            region=REGION,
            gpus=1,
            start_timeout_s=SERVING_TIMEOUT_S,
        )
        gateway = None
        try:
            wait_until(
                lambda: (
                    Replica.objects.filter(region=REGION, state="serving").exists()
                    or agent.popen.poll() is not None
                ),
                timeout_s=SERVING_TIMEOUT_S,
                interval_s=0.5,
                message="a serving vLLM replica",
            )
            if agent.popen.poll() is not None:
                raise AssertionError(f"agent exited:\n{agent.log()}")
            for replica in Replica.objects.filter(region=REGION):
                lower_engine_priority(engine_pid(replica.url))
            gateway = start_gateway(env, tmp)
            live = LivePlatform(
                url=gateway.url,
                region=REGION,
                keys=dict(seeded.keys),
                env=env,
                gateway=gateway,
                agent=agent,
                prefix=env["PLATFORM_REDIS_PREFIX"],
            )
            wait_until(
                lambda: can_serve(live, MODEL, timeout_s=30),
                timeout_s=60,
                message="the gateway to route to the vLLM replica",
            )
            yield live
        finally:
            if gateway is not None:
                gateway.stop()
            agent.stop(grace_s=30)
            call_command("flush", interactive=False, verbosity=0)


def spans_of(spans_file: Path, trace_id: str) -> list[dict[str, Any]]:
    """Wait for the trace to hold the gateway's root and vLLM's span."""

    def whole() -> list[dict[str, Any]] | None:
        trace = [s for s in read_spans(spans_file) if s["trace_id"] == trace_id]
        names = {s["name"] for s in trace}
        if "llm_request" in names and "POST /v1/chat/completions" in names:
            return trace
        return None

    return wait_until(whole, timeout_s=90, message=f"vLLM's span in {trace_id}")


def test_vllms_own_span_is_the_child_of_the_gateways_engine_call(
    platform: LivePlatform, collector: tuple[str, Path]
) -> None:
    _, spans_file = collector
    trace_id = uuid.uuid4().hex
    started = time.time()
    chunks = list(
        platform.client("alpha").chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": SECRET}],
            max_tokens=4,
            stream=True,
            extra_headers={"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"},
        )
    )
    assert chunks

    trace = spans_of(spans_file, trace_id)

    by_name = {s["name"]: s for s in trace}
    engine_call = by_name[f"chat {MODEL}"]
    assert engine_call["kind"] == 3  # CLIENT, the gateway's
    vllm = by_name["llm_request"]
    assert vllm["parent_span_id"] == engine_call["span_id"]
    assert vllm["start_ns"] / 1e9 >= started - 5
    assert vllm["attributes"]["gen_ai.usage.completion_tokens"] == 4
    assert vllm["attributes"]["gen_ai.latency.time_to_first_token"] > 0
    # vLLM's span carries no prompt text either.
    assert SECRET not in json.dumps(trace)

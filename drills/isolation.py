"""Run the isolation test live: gateway + simulated replicas + Redis + load on loopback.

``run_isolation`` registers a scratch model, pool and three teams (two quiet, one
noisy with a small limit), starts a node agent and a gateway, measures the quiet
teams alone (baseline), then again while the noisy team sends ``flood_factor``
times its token limit, and removes everything it created.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from django.conf import settings
from django.utils import timezone

from accounts.models import Team
from drills.domain.isolation import Sample
from localrun.processes import (
    drill_env,
    serving_replicas,
    start_agent,
    start_gateway,
    wait_until,
)
from localrun.seeding import (
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    digest,
    remove_scratch_model,
    seed_platform,
)
from metering.models import Usage

logger = logging.getLogger(__name__)

PROMPT = "Summarise the quarterly report for the board in three short bullet points."
ISO_VERSION_BODY = {
    "weights_uri": "s3://models/iso-chat/drill/",
    "weights_hash": digest("iso-chat drill weights"),
    "tokenizer_hash": digest("iso-chat drill tokenizer"),
    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "precision": "fp16",
    "gpus_per_replica": 1,
    "engine_config": {"max_num_seqs": 256, "max_model_len": 8192},
}


@dataclass(frozen=True)
class IsolationPlan:
    """The shape of one run."""

    phase_s: float = 20.0
    quiet_teams: int = 2
    quiet_streams: int = 4  # closed-loop clients per quiet team
    max_tokens: int = 48
    noisy_tokens_per_minute: int = 3_000
    flood_factor: float = 10.0
    replicas: int = 2


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    team: str,
    phase: str,
    max_tokens: int,
    conversation: str,
) -> Sample:
    body = {
        "model": "iso-chat",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}", "x-conversation-id": conversation}
    started = time.perf_counter()
    ttft = None
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status != 200:
                await response.read()
                return Sample(
                    team=team, phase=phase, status=response.status, ttft_s=None
                )
            async for line in response.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - started
            return Sample(team=team, phase=phase, status=200, ttft_s=ttft)
    except (TimeoutError, aiohttp.ClientError):
        return Sample(team=team, phase=phase, status=599, ttft_s=None)


async def _load(
    url: str, keys: dict[str, str], plan: IsolationPlan, phase: str, *, noisy: bool
) -> list[Sample]:
    samples: list[Sample] = []
    deadline = time.perf_counter() + plan.phase_s
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def quiet_client(team: str, index: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                n += 1
                samples.append(
                    await _one(
                        session,
                        url,
                        keys[team],
                        team,
                        phase,
                        plan.max_tokens,
                        f"{team}-{index}-{n}",
                    )
                )

        async def flood() -> None:
            # Open loop at flood_factor x the limit, in requests of known size.
            tokens_per_request = 30 + plan.max_tokens
            per_s = (
                plan.flood_factor
                * plan.noisy_tokens_per_minute
                / 60
                / tokens_per_request
            )
            pending = []
            n = 0
            start = time.perf_counter()
            while time.perf_counter() < deadline:
                n += 1
                pending.append(
                    asyncio.ensure_future(
                        _one(
                            session,
                            url,
                            keys["iso-noisy"],
                            "iso-noisy",
                            phase,
                            plan.max_tokens,
                            f"noisy-{n}",
                        )
                    )
                )
                await asyncio.sleep(max(0.0, start + n / per_s - time.perf_counter()))
            samples.extend(await asyncio.gather(*pending))

        jobs = [
            quiet_client(team, i)
            for team in keys
            if team != "iso-noisy"
            for i in range(plan.quiet_streams)
        ]
        if noisy:
            jobs.append(flood())
        await asyncio.gather(*jobs)
    return samples


def run_isolation(plan: IsolationPlan) -> list[Sample]:
    """Run both phases against a fresh gateway and replicas; return every sample."""
    region = f"iso-{secrets.token_hex(3)}"
    prefix = f"{settings.REDIS_KEY_PREFIX}-iso-{secrets.token_hex(3)}"
    keys = _register(plan, region)
    env = drill_env(region=region, prefix=prefix, PLATFORM_SNAPSHOT_REFRESH_S="1")
    tmp = Path(tempfile.mkdtemp(prefix="isolation-"))
    agent = start_agent(env, tmp, region=region, node="iso-node", gpus=plan.replicas)
    gateway = None
    try:
        wait_until(
            lambda: (
                serving_replicas(region) == plan.replicas
                or agent.popen.poll() is not None
            ),
            timeout_s=60,
            message="the isolation pool's replicas",
        )
        if agent.popen.poll() is not None:
            raise RuntimeError(f"the node agent exited:\n{agent.log()}")
        gateway = start_gateway(env, tmp, name="iso-gateway")
        warm = asyncio.run(
            _load(
                gateway.url,
                keys,
                IsolationPlan(
                    phase_s=2.0,
                    quiet_teams=plan.quiet_teams,
                    quiet_streams=1,
                    max_tokens=plan.max_tokens,
                ),
                "warmup",
                noisy=False,
            )
        )
        if not any(s.status == 200 for s in warm):
            raise RuntimeError(f"the gateway did not serve: {warm[:3]}")
        samples = asyncio.run(_load(gateway.url, keys, plan, "baseline", noisy=False))
        samples += asyncio.run(_load(gateway.url, keys, plan, "noisy", noisy=True))
        return samples
    finally:
        if gateway is not None:
            gateway.stop()
        agent.stop(grace_s=20)
        _cleanup(region, list(keys))


def _register(plan: IsolationPlan, region: str) -> dict[str, str]:
    _cleanup(region, [])
    quiet = [f"iso-quiet-{chr(ord('a') + i)}" for i in range(plan.quiet_teams)]
    teams = [*quiet, "iso-noisy"]
    # Fresh teams each run: no key or limit of a previous run carries over.
    Team.objects.filter(pk__in=teams).delete()
    seeded = seed_platform(
        seed=PlatformSeed(
            region=region,
            teams=tuple(TeamSeed(team) for team in teams),
            models=(
                ModelSeed(
                    model_id="iso-chat",
                    description="isolation drill",
                    versions=(
                        VersionSeed(
                            "v1",
                            ISO_VERSION_BODY,
                            min_replicas=plan.replicas,
                            max_replicas=plan.replicas,
                        ),
                    ),
                ),
            ),
            limits=tuple(
                LimitSeed(
                    team_id=team,
                    model_id="iso-chat",
                    tokens_per_minute=(
                        plan.noisy_tokens_per_minute
                        if team == "iso-noisy"
                        else 10_000_000
                    ),
                    max_concurrency=10_000,
                    guaranteed_share=0.0 if team == "iso-noisy" else 0.3,
                )
                for team in teams
            ),
            key_name="isolation drill",
        ),
        now=timezone.now(),
    )
    return dict(seeded.keys)


def _cleanup(region: str, teams: list[str]) -> None:
    remove_scratch_model("iso-chat", region=region)
    if teams:
        Usage.objects.filter(team_id__in=teams).delete()
        Team.objects.filter(pk__in=teams).delete()


__all__ = ["IsolationPlan", "run_isolation"]

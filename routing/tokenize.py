"""``POST /tokenize`` through the gateway: vLLM's tokenizer endpoint, per version.

Public surface: ``TokenizePlan``, ``plan_tokenize``, ``TokenizeProxy``.

Tools such as ``vllm bench serve`` count tokens with the server's ``/tokenize``.
The gateway authenticates the team key and resolves the model as it does a chat
(``plan_tokenize``, with ``routing.plan.resolve_for_team``), then passes the body to a serving replica of that
version, least loaded first, and its answer back untouched (vLLM's
``{"count", "max_model_len", "tokens", "token_strs"}``). A replica that cannot be
reached, refuses the engine key or fails with a 5xx is ejected and the next is
tried; an engine's 4xx is the client's, in OpenAI's shape. Tokenizing generates
nothing: no admission, no bucket charge, no usage row.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from config.asgi_io import Send
from config.json_body import BodyError
from routing.domain.chat_body import check_tokenize_body
from routing.domain.resolve import Resolution
from routing.domain.routing_key import routing_key
from routing.domain.snapshot import ConfigSnapshot
from routing.intake import header_text, refuse_body
from routing.live import LiveLoad
from routing.plan import GatewaySettings, resolve_for_team
from routing.responses import GatewayError, respond, upstream_client_error
from routing.traces import NO_TRACE, RequestTrace
from routing.upstream import Upstream

logger = logging.getLogger(__name__)

__all__ = ["TokenizePlan", "TokenizeProxy", "plan_tokenize"]

# Replicas tried per request: tokenizing is cheap and any replica of the version
# gives the same answer, so a second try covers one that just died.
_ATTEMPTS = 2
# Tokenizing a prompt at the body limit takes well under a second on a replica.
_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class TokenizePlan:
    """One ``/tokenize`` request, resolved: which version, and what to send it.

    ``payload`` is the client's body with ``model`` set to the served model name.
    """

    team: str
    model_ref: str
    resolution: Resolution
    payload: bytes


def plan_tokenize(
    *,
    snapshot: ConfigSnapshot,
    settings: GatewaySettings,
    team: str,
    headers: Mapping[bytes, bytes],
    body: Mapping[str, Any],
    rng: random.Random,
) -> TokenizePlan:
    """Return the plan of one ``/tokenize`` request from ``team``.

    The model resolves as a chat's would (alias, ``@vN`` pin, the canary slice of
    the same conversation), so the count is the version's that would serve it.

    Raises:
        GatewayError: 400 bad body, 403/404/503 as for a chat.
    """
    try:
        checked = check_tokenize_body(body)
    except BodyError as exc:
        raise refuse_body(exc) from None
    messages = (
        checked.messages
        if checked.messages is not None
        else [{"role": "user", "content": checked.prompt}]
    )
    key = routing_key(header_text(headers, b"x-conversation-id"), messages)
    resolution, _ = resolve_for_team(
        snapshot, settings, team, checked.model, key, rng, kind=None
    )
    return TokenizePlan(
        team=team,
        model_ref=checked.model,
        resolution=resolution,
        payload=json.dumps({**body, "model": resolution.model}).encode(),
    )


class TokenizeProxy:
    """Send planned ``/tokenize`` requests to the version's replicas."""

    def __init__(
        self, *, upstream: Upstream, live: LiveLoad, connect_timeout_s: float
    ) -> None:
        self.upstream = upstream
        self.live = live
        self.timeout = aiohttp.ClientTimeout(
            total=_TIMEOUT_S, connect=connect_timeout_s
        )

    async def serve(
        self,
        plan: TokenizePlan,
        snapshot: ConfigSnapshot,
        send: Send,
        trace: RequestTrace = NO_TRACE,
    ) -> None:
        """Answer ``plan`` with a replica's tokenization; each try is a client
        span of ``trace`` whose ``traceparent`` goes to the engine.

        Raises:
            GatewayError: the engine refused the body (its 4xx), or no replica of
                the version could answer (503).
        """
        model, version = plan.resolution.model, plan.resolution.version
        nodes = self.live.nodes(snapshot, model, version, time.monotonic())
        nodes.sort(key=lambda node: node.tokens_in_flight)
        for node in nodes[:_ATTEMPTS]:
            span = trace.side_call(
                "tokenize",
                model=model,
                version=version,
                replica_id=node.replica_id,
                url=node.url,
                purpose="tokenize",
            )
            try:
                async with self.upstream.session.post(
                    f"{node.url}/tokenize",
                    data=plan.payload,
                    headers=self.upstream.headers_with(trace.traceparent(span)),
                    timeout=self.timeout,
                ) as response:
                    status, raw = response.status, await response.read()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                failure = type(exc).__name__
                trace.side_ended(span, error_kind=failure)
            else:
                kind = "upstream" if status >= 500 else "refused"
                trace.side_ended(
                    span, status=status, error_kind=None if status == 200 else kind
                )
                if status == 200:
                    await respond(send, 200, raw)
                    return
                if status < 500 and status not in (401, 403):
                    raise upstream_client_error(status, raw)
                failure = f"HTTP {status}"
            logger.warning(
                "replica %s failed to tokenize: %s", node.replica_id, failure
            )
            self.live.eject(node.replica_id, time.monotonic())
        raise GatewayError(
            503,
            f"no replica of {model}@{version} can tokenize right now",
            code="no_replica_available",
            headers={"retry-after": "1"},
        )

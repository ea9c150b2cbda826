"""The simulated vLLM replica's HTTP side: vLLM's surface around ``SimReplica``.

Public surface: ``SimApp``, ``build_app``.

A raw ASGI app (no framework: this process relays thousands of SSE chunks a second
and should spend its CPU on them). Clients see vLLM's bytes: chunk shapes, usage,
error bodies, status codes and metric names (``/v1/chat/completions`` streaming
and not, with tools, structured output and ``n``; ``/v1/completions``,
``/v1/responses``, ``/v1/embeddings`` with ``--runner pooling``
(``simengine.embeddings``), ``/v1/models``, ``/health``, ``/metrics``, ``/tokenize``, ``/version``,
and ``/sim/faults`` behind the admin token; it sets ``degraded`` (refuse once and
stop), ``quality`` and ``ttft_factor`` (first tokens held back) as well as the
failures, and ``/sim/state`` shows them).

Started with an engine key (``--api-key`` or ``VLLM_API_KEY``, as vLLM is), every
path under ``/v1`` needs ``Authorization: Bearer <key>`` and anything else gets
vLLM's 401 ``{"error":"Unauthorized"}``, before routing, so an unknown ``/v1`` path
is a 401 too; ``/health``, ``/metrics``, ``/version`` and ``/tokenize`` stay open
and ``OPTIONS`` is never checked, as in vLLM 0.32's ``AuthenticationMiddleware``.

With ``SimOptions.engine == "sglang"`` (``--sim-engine sglang``) it presents
SGLang's surface instead (``python/sglang/srt/entrypoints/http_server.py``,
``entrypoints/openai/serving_chat.py``, ``sse_utils.py``, ``protocol.py``,
``utils/common.py`` ``add_api_key_middleware``):

- the key guards every path but ``/health*`` and ``/metrics*`` (and ``OPTIONS``):
  the ``Authorization`` header must be ``Bearer <key>`` (the scheme in any case),
  else 401 ``{"error":"Unauthorized"}``; ``/sim/*`` keeps its own admin token;
- streams: a role chunk, content chunks (every ``delta`` carries
  ``"reasoning_content":null``; ``logprobs``/``finish_reason``/``matched_stop``
  null), a separate finish chunk whose ``delta`` is only that null,
  ``finish_reason`` and ``matched_stop`` (the EOS id for ``stop``), the usage
  chunk when ``stream_options.include_usage``, ``[DONE]``;
- usage is SGLang's ``UsageInfo``: ``prompt_tokens_details`` is
  ``{"cached_tokens": N}`` with ``--enable-cache-report`` (N may be 0), else
  null; ``reasoning_tokens`` 0, ``completion_tokens_details`` null; the plain
  answer's ``metadata`` names the weight version (``"default"``);
- errors are SGLang's flat ``ErrorResponse`` (``{"object":"error","message",
  "type","param","code"}``); any model name is served, and echoed;
- ``/health`` (200, empty), ``/v1/models`` (``owned_by: sglang``),
  ``/get_model_info``, ``/version``, and ``/metrics`` only with
  ``--enable-metrics``, as SGLang.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from config.asgi_io import Receive, Scope, Send, wait_disconnect
from simengine import choices, completions, embeddings
from simengine.choices import ChoiceOutput, ToolCallSpan
from simengine.completions import CompletionPrompt
from simengine.domain import responses_input, tokens
from simengine.domain.embedding_perf import EMBEDDING_PROFILES
from simengine.domain.engine import FinishedRequest
from simengine.metrics import EngineMetrics
from simengine.replica import (
    EOS_TOKEN_ID,
    MAX_BODY_BYTES,
    SGLANG_VERSION,
    SYSTEM_FINGERPRINT,
    VLLM_VERSION,
    Answer,
    Faults,
    SimOptions,
    SimReplica,
    Stream,
)
from simengine.response_store import ResponseStore
from simengine.traces import EngineTracer

logger = logging.getLogger("simengine")

# -- HTTP ---------------------------------------------------------------------------------


class HttpError(Exception):
    """An error answered in vLLM's shape: {"error": {message, type, param, code}}."""

    TYPES = {
        400: "BadRequestError",
        404: "NotFoundError",
        401: "Unauthorized",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or self.TYPES.get(status, "BadRequestError")

    def sglang_body(self) -> bytes:
        """SGLang's flat ``ErrorResponse``."""
        return _json_bytes(
            {
                "object": "error",
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        )

    def body(self) -> bytes:
        return _json_bytes(
            {
                "error": {
                    "message": self.message,
                    "type": self.err_type,
                    "param": self.param,
                    "code": self.status,
                }
            }
        )


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
    ]
    headers.extend(extra_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HttpError(400, "request body too large")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _stable_seed(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _bearer_digest(scope: Scope) -> bytes | None:
    """Return the SHA-256 of the request's bearer token, or None.

    vLLM and SGLang (``utils/auth.py`` ``decide_request_auth``) parse alike: the
    header split at its first space, the scheme compared case-insensitively."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                return None
            return hashlib.sha256(token.encode()).digest()
    return None


def _is_one_of(digest: bytes | None, digests: tuple[bytes, ...]) -> bool:
    # Every candidate is compared, in constant time, as vLLM does.
    matched = False
    for candidate in digests:
        matched |= digest is not None and secrets.compare_digest(digest, candidate)
    return matched


_UNAUTHORIZED = _json_bytes({"error": "Unauthorized"})
# FastAPI's 404 for a route vLLM did not mount (generation on a pooling model).
_NOT_MOUNTED = _json_bytes({"detail": "Not Found"})
_GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# SGLang's first chunk of a chat stream (its StreamDelta keeps reasoning_content).
_SGLANG_ROLE_DELTA = '{"reasoning_content":null,"role":"assistant","content":""}'


class SimApp:
    """The raw ASGI application of one simulated replica."""

    def __init__(self, replica: SimReplica, tracer: EngineTracer | None = None) -> None:
        self.replica = replica
        # vLLM's --otlp-traces-endpoint: a span per chat request (simengine.traces).
        self.tracer = tracer
        self.options = replica.options
        self.names = set(replica.options.served_model_names)
        self.model_name = replica.options.served_model_names[0]
        self.sglang = replica.options.engine == "sglang"
        self.pooling = replica.options.runner == "pooling" and not self.sglang
        self.embedder = embeddings.EmbeddingBatcher(
            replica.options.max_num_seqs or 256,
            EMBEDDING_PROFILES[replica.options.embedding_profile],
        )
        self.response_store = ResponseStore()
        self._key_digests = tuple(
            hashlib.sha256(key.encode()).digest()
            for key in replica.options.api_keys
            if key
        )
        token = replica.options.admin_token
        self._admin_digests = (
            (hashlib.sha256(token.encode()).digest(),) if token else ()
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self.replica.ensure_started()
        path = scope["path"]
        method = scope["method"]
        if (
            self._key_digests
            and method != "OPTIONS"
            and self._guarded(path)
            and not self._authorized(scope)
        ):
            await _respond(send, 401, _UNAUTHORIZED)
            return
        try:
            if not self.sglang and self._not_mounted(path):
                await _respond(send, 404, _NOT_MOUNTED)
            elif path == "/v1/embeddings" and method == "POST" and self.pooling:
                await self._embeddings(receive, send)
            elif path == "/v1/chat/completions" and method == "POST":
                await self._chat(scope, receive, send)
            elif path == "/v1/completions" and method == "POST" and not self.sglang:
                await self._completions(receive, send)
            elif path == "/v1/responses" and method == "POST" and not self.sglang:
                await self._responses(receive, send)
            elif (
                path.startswith("/v1/responses/")
                and method == "GET"
                and not self.sglang
            ):
                await self._stored_response(path.removeprefix("/v1/responses/"), send)
            elif path == "/health" and method == "GET":
                status = 200 if self.replica.is_ready else 503
                await _respond(send, status, b"")
            elif self.sglang and not self._sglang_route(path, method):
                raise HttpError(404, "Not Found")
            elif self.sglang and path == "/get_model_info":
                await _respond(send, 200, _json_bytes(self._model_info()))
            elif path == "/metrics" and method == "GET":
                await _respond(
                    send,
                    200,
                    self.replica.metrics.render(),
                    b"text/plain; version=0.0.4; charset=utf-8",
                )
            elif path == "/v1/models" and method == "GET":
                await _respond(send, 200, _json_bytes(self._models()))
            elif path == "/version" and method == "GET":
                version = SGLANG_VERSION if self.sglang else VLLM_VERSION
                await _respond(send, 200, _json_bytes({"version": version}))
            elif path == "/tokenize" and method == "POST":
                await self._tokenize(receive, send)
            elif (
                path == "/reset_prefix_cache"
                and method == "POST"
                and self.options.enable_dev_mode
            ):
                success = self.replica.reset_prefix_cache()
                await _respond(send, 200, _json_bytes({"success": success}))
            elif path in ("/sim/faults", "/sim/state"):
                await self._admin(scope, receive, send)
            else:
                raise HttpError(404, "Not Found")
        except HttpError as exc:
            body = exc.sglang_body() if self.sglang else exc.body()
            await _respond(send, exc.status, body)
        except ConnectionResetError:
            return

    def _guarded(self, path: str) -> bool:
        """Whether the engine key guards ``path`` (vLLM: ``/v1``; SGLang: all
        but ``/health*`` and ``/metrics*``; ``/sim`` has its own token)."""
        if not self.sglang:
            return path.startswith("/v1")
        return not path.startswith(("/health", "/metrics", "/sim/"))

    def _not_mounted(self, path: str) -> bool:
        """Whether vLLM's runner leaves ``path`` unmounted (pooling: generation;
        generate: embeddings)."""
        if self.pooling:
            return path in _GENERATE_PATHS or path.startswith("/v1/responses/")
        return path == "/v1/embeddings"

    async def _embeddings(self, receive: Receive, send: Send) -> None:
        """vLLM's ``/v1/embeddings`` (``simengine.embeddings``)."""
        body = await self._json_body(receive)
        model = self._check_model(body)
        if body.get("dimensions") is not None:
            raise HttpError(
                400,
                f"Model '{model}' does not support Matryoshka embeddings; "
                f"dimensions must be unset (received dimensions={body['dimensions']}).",
            )
        encoding_format = body.get("encoding_format") or "float"
        if encoding_format not in ("float", "base64"):
            raise HttpError(
                400, "encoding_format must be float or base64", "encoding_format"
            )
        try:
            prompts = embeddings.parse_inputs(
                body.get("input"), self.options.max_model_len
            )
        except embeddings.EmbeddingError as exc:
            raise HttpError(400, exc.message, exc.param) from None
        started = time.monotonic()
        await self.embedder.run(sum(len(ids) for ids in prompts))
        metrics = self.replica.metrics
        if isinstance(metrics, EngineMetrics):  # pooling is vLLM's only
            metrics.record_pooled(
                [len(ids) for ids in prompts], time.monotonic() - started
            )
        answer = embeddings.embedding_response(
            request_id=f"embd-{secrets.token_hex(8)}",
            created=int(time.time()),
            model=model,
            prompts=prompts,
            dim=self.options.embedding_dim,
            encoding_format=encoding_format,
            is_random=self.options.is_embedding_random,
        )
        await _respond(send, 200, _json_bytes(answer))

    def _authorized(self, scope: Scope) -> bool:
        return _is_one_of(_bearer_digest(scope), self._key_digests)

    def _sglang_route(self, path: str, method: str) -> bool:
        """Whether SGLang serves ``path`` (``/metrics`` only with
        ``--enable-metrics``)."""
        if path == "/metrics":
            return method == "GET" and self.options.enable_metrics
        if path == "/tokenize":
            return method == "POST"
        return path in ("/v1/models", "/get_model_info", "/version") or (
            path in ("/sim/faults", "/sim/state")
        )

    def _model_info(self) -> dict[str, Any]:
        """SGLang's ``/get_model_info`` (the fields every version has)."""
        return {
            "model_path": self.options.model,
            "tokenizer_path": self.options.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.replica.ensure_started()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.replica.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _models(self) -> dict[str, Any]:
        created = int(self.replica.started_at)
        if self.sglang:
            # SGLang's ModelList of ModelCards (protocol.py).
            return {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": created,
                        "owned_by": "sglang",
                        "root": self.options.model,
                        "parent": None,
                        "max_model_len": self.options.max_model_len,
                    }
                    for name in self.options.served_model_names
                ],
            }
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": self.options.model,
                    "parent": None,
                    "max_model_len": self.options.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{_stable_seed(name, created):016x}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
                for name in self.options.served_model_names
            ],
        }

    async def _json_body(self, receive: Receive) -> dict[str, Any]:
        raw = await _read_body(receive)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"Invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "The request body must be a JSON object")
        return body

    async def _tokenize(self, receive: Receive, send: Send) -> None:
        body = await self._json_body(receive)
        if "messages" in body:
            tools = body.get("tools")
            text = tokens.render_chat(
                self._messages(body), tools if isinstance(tools, list) else None
            )
        else:
            text = str(body.get("prompt", ""))
        ids = tokens.encode(text)
        await _respond(
            send,
            200,
            _json_bytes(
                {
                    "count": len(ids),
                    "max_model_len": self.options.max_model_len,
                    "tokens": ids,
                    "token_strs": None,
                }
            ),
        )

    async def _admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._admin_digests and not _is_one_of(
            _bearer_digest(scope), self._admin_digests
        ):
            raise HttpError(401, "sim admin endpoints need the admin token")
        if scope["path"] == "/sim/state":
            await _respond(send, 200, _json_bytes(self.replica.state()))
            return
        if scope["method"] == "POST":
            body = await self._json_body(receive)
            try:
                self.replica.set_faults(**body)
            except (TypeError, ValueError) as exc:
                raise HttpError(400, str(exc)) from None
        await _respond(send, 200, _json_bytes(asdict(self.replica.faults)))

    def _messages(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", "messages")
        rendered = []
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message:
                raise HttpError(
                    400, "each message needs a role and content", "messages"
                )
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                raise HttpError(
                    400,
                    "message content must be a string or a list of parts",
                    "messages",
                )
            entry: dict[str, Any] = {
                "role": str(message["role"]),
                "content": tokens.message_text(content),
            }
            tool_calls = message.get("tool_calls")
            if isinstance(tool_calls, list) and tool_calls:
                entry["tool_calls"] = tool_calls
            rendered.append(entry)
        return rendered

    def _check_model(self, body: Mapping[str, Any]) -> str:
        """Return the model name to echo; vLLM's 404 for one it does not serve."""
        model = body.get("model")
        if self.sglang:
            # SGLang serves whatever model name it is asked for, and echoes it.
            return str(model) if model is not None else "default"
        if model not in self.names:
            raise HttpError(
                404,
                f"The model `{model}` does not exist. "
                f"Valid aliases: {', '.join(sorted(self.names))}.",
                "model",
            )
        return str(model)

    def _check_max_tokens(self, max_tokens: Any, prompt_len: int) -> int:
        """Return the output budget (the context left when None) or raise
        vLLM's 400s for a bad or too large one."""
        max_len = self.options.max_model_len
        if max_tokens is None:
            max_tokens = max_len - prompt_len
        if (
            not isinstance(max_tokens, int)
            or isinstance(max_tokens, bool)
            or max_tokens < 1
        ):
            raise HttpError(400, "max_tokens must be a positive integer", "max_tokens")
        if max_tokens > max_len:
            raise HttpError(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={max_len}. "
                "Please request fewer output tokens.",
                "max_tokens",
            )
        if prompt_len + max_tokens > max_len:
            raise HttpError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                "messages",
            )
        return max_tokens

    def _include_usage(self, body: Mapping[str, Any]) -> bool:
        stream_options = body.get("stream_options") or {}
        return bool(
            (self.options.enable_force_include_usage and not self.sglang)
            or (
                isinstance(stream_options, Mapping)
                and stream_options.get("include_usage")
            )
        )

    async def _admit(self) -> None:
        """Spend the frontend time, then refuse as the queue limit or the failure
        faults say."""
        replica = self.replica
        if replica.frontend_ms > 0:
            # Tokenization and request set-up, counted in TTFT as vLLM counts it.
            await asyncio.sleep(replica.frontend_ms / 1000.0)
        # Checked with no await before submit: requests that arrive together all
        # sleep the frontend time first, and each must see the others queued.
        limit = self.options.max_num_queued_reqs
        if limit and replica.queued_requests >= limit:
            replica.metrics.record_admission_rejection("max_num_queued_reqs")
            raise HttpError(503, "The server is overloaded: too many queued requests")
        if replica.roll_failure():
            raise HttpError(500, "simulated engine failure before the first token")

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        replica = self.replica
        arrived_at = time.monotonic()
        body = await self._json_body(receive)
        model = self._check_model(body)
        tools: list[Any] | None = None
        tool_choice: Any = None
        schema: Mapping[str, Any] | None = None
        if self.sglang:
            if body.get("n", 1) != 1:
                raise HttpError(400, "n must be 1 on this server", "n")
            n = 1
        else:
            try:
                n = choices.check_n(body.get("n"), body.get("temperature"))
                tool_choice = choices.check_tool_choice(
                    body,
                    auto_enabled=self.options.enable_auto_tool_choice,
                    has_parser=self.options.tool_call_parser is not None,
                )
                schema = choices.output_schema(body.get("response_format"))
            except choices.RequestError as exc:
                raise HttpError(400, exc.message, exc.param) from None
            tools = body.get("tools") or None
        messages = self._messages(body)
        prompt_ids = tokens.encode(tokens.render_chat(messages, tools))
        prompt_len = len(prompt_ids)
        max_tokens = self._check_max_tokens(
            body.get("max_completion_tokens", body.get("max_tokens")), prompt_len
        )
        if not replica.is_ready:
            raise HttpError(503, "The server is starting up")
        include_usage = self._include_usage(body)
        request_seed = body.get("seed")
        text_seed = _stable_seed(request_seed, prompt_ids[-16:], prompt_len)
        ignore_eos = bool(body.get("ignore_eos"))
        # A prompt the oracle knows gets its answer (right or not, by quality).
        answer = replica.plan_answer(
            messages, max_tokens=max_tokens, ignore_eos=ignore_eos, text_seed=text_seed
        )
        if answer is not None:
            output_len, finish_reason = answer.output_len, answer.finish_reason
        else:
            output_len, finish_reason = replica.choose_output_len(
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
                seed=_stable_seed(
                    request_seed, prompt_ids[-32:], prompt_len, max_tokens
                ),
            )
        await self._admit()
        # SGLang's request ids are bare uuid4 hex.
        request_id = (
            secrets.token_hex(16) if self.sglang else f"chatcmpl-{secrets.token_hex(8)}"
        )
        functions: list[Mapping[str, Any]] = []
        if tools and (tool_choice != "auto" or self.options.enable_auto_tool_choice):
            functions = choices.choose_tools(
                tools,
                tool_choice,
                messages,
                parallel=body.get("parallel_tool_calls") is not False,
            )
        if n > 1 or functions or schema is not None:
            outputs = [
                self._plan_choice(
                    index,
                    messages,
                    functions=functions,
                    tool_mode=_tool_mode(tool_choice),
                    schema=schema,
                    text_seed=text_seed
                    if index == 0
                    else _stable_seed(text_seed, index),
                    max_tokens=max_tokens,
                    ignore_eos=ignore_eos,
                )
                for index in range(n)
            ]
            await self._chat_choices(
                request_id,
                outputs,
                send,
                receive,
                model=model,
                prompt_ids=prompt_ids,
                max_tokens=max_tokens,
                arrived_at=arrived_at,
                is_streaming=bool(body.get("stream")),
                include_usage=include_usage,
            )
            return
        stream = replica.submit(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            output_len=output_len,
            finish_reason=finish_reason,
            max_tokens=max_tokens,
            arrived_at=arrived_at,
            text_seed=text_seed,
            answer=answer,
            streaming=bool(body.get("stream")),
        )
        headers: list[tuple[bytes, bytes]] = []
        if self.options.enable_request_id_headers:
            headers.append((b"x-request-id", request_id.encode()))
        try:
            if self.sglang and body.get("stream"):
                await self._sglang_stream(
                    stream, send, receive, model, headers, include_usage=include_usage
                )
            elif self.sglang:
                await self._sglang_complete(stream, send, receive, model, headers)
            elif body.get("stream"):
                await self._stream(
                    stream, send, receive, model, headers, include_usage=include_usage
                )
            else:
                await self._complete(stream, send, receive, model, headers)
        finally:
            if stream.done is None:
                replica.abort(request_id)
            if self.tracer is not None and stream.done is not None:
                self.tracer.finished(
                    dict(scope["headers"]),
                    model=model,
                    max_tokens=max_tokens,
                    done=stream.done,
                )

    def _usage(self, stream: Stream) -> dict[str, Any]:
        """Return vLLM's usage object (the streamed form; ``_complete`` adds the
        null fields a plain answer carries)."""
        return self._usage_of((stream,))

    def _usage_of(self, streams: Sequence[Stream]) -> dict[str, Any]:
        """Return vLLM's usage of the choices of one request: the prompt once,
        the completions summed, the cache figures of the first choice."""
        first = streams[0].done
        assert first is not None
        completion = 0
        for stream in streams:
            assert stream.done is not None
            completion += stream.done.output_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": first.prompt_tokens,
            "total_tokens": first.prompt_tokens + completion,
            "completion_tokens": completion,
        }
        if self.options.enable_prompt_tokens_details:
            # vLLM: the prompt's full blocks, once cached, minus those it hit
            # (PrefillStats.finalize); nothing is written with caching off.
            created = 0
            if self.replica.config.enable_prefix_caching:
                block_size = self.replica.config.block_size
                full = first.prompt_tokens // block_size * block_size
                created = max(0, full - first.cached_tokens)
            usage["prompt_tokens_details"] = {
                "cached_tokens": first.cached_tokens,
                "created_cache_tokens": created,
            }
        return usage

    async def _wait(self, stream: Stream, disconnected: asyncio.Task[Any]) -> bool:
        """Wait for the next tokens; return False if the client went away first."""
        waiter = asyncio.ensure_future(stream.wake.wait())
        await asyncio.wait({waiter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            waiter.cancel()
            return False
        stream.wake.clear()
        return True

    async def _until_done(self, stream: Stream, receive: Receive) -> bool:
        """Wait for the whole answer; return False if the client went away first."""
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        try:
            while stream.done is None:
                if not await self._wait(stream, disconnected):
                    return False
        finally:
            disconnected.cancel()
        return True

    async def _send_events(
        self,
        stream: Stream,
        send: Send,
        receive: Receive,
        headers: list[tuple[bytes, bytes]],
        *,
        render: Callable[[int, int, FinishedRequest | None], bytes],
        end: Callable[[], bytes],
    ) -> None:
        """Send ``stream`` as server-sent events, in both engines' framing.

        The headers, then for each batch of new pieces ``render(sent, produced,
        done)`` (the events of pieces ``sent`` to ``produced``; ``done`` once the
        answer is over), then ``end()`` (the events after the last piece) and
        ``[DONE]``. A client that goes away ends it quietly.
        """
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        *headers,
                    ],
                }
            )
            sent = 0
            while True:
                if not await self._wait(stream, disconnected):
                    return
                produced = stream.produced
                done = stream.done
                if produced > sent:
                    body = render(sent, produced, done)
                    sent = produced
                    await send(
                        {"type": "http.response.body", "body": body, "more_body": True}
                    )
                if done is not None:
                    break
            await send(
                {
                    "type": "http.response.body",
                    "body": end() + b"data: [DONE]\n\n",
                    "more_body": False,
                }
            )
        finally:
            disconnected.cancel()

    async def _stream(
        self,
        stream: Stream,
        send: Send,
        receive: Receive,
        model: str,
        headers: list[tuple[bytes, bytes]],
        *,
        include_usage: bool,
    ) -> None:
        created = int(time.time())
        head = (
            f'data: {{"id":"{stream.request_id}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{json.dumps(model)},"choices":[{{"index":0,'
            '"delta":{"content":'
        )
        tail = '},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        # Without a usage chunk vLLM puts the fingerprint on the chunk that finishes.
        finish_end = (
            "}\n\n"
            if include_usage
            else f',"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n'
        )

        def render(sent: int, produced: int, done: FinishedRequest | None) -> bytes:
            parts = []
            if sent == 0:
                first = {
                    "id": stream.request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": None,
                    "prompt_text": None,
                }
                parts.append(b"data: " + _json_bytes(first) + b"\n\n")
            last_index = produced - 1
            for offset, piece in enumerate(stream.pieces[sent:produced]):
                index = sent + offset
                if done is not None and index == last_index:
                    reason = done.finish_reason
                    parts.append(
                        (
                            head
                            + json.dumps(piece, ensure_ascii=False)
                            + f'}},"logprobs":null,"finish_reason":"{reason}",'
                            '"stop_reason":null,"token_ids":null}]' + finish_end
                        ).encode()
                    )
                else:
                    parts.append(
                        (head + json.dumps(piece, ensure_ascii=False) + tail).encode()
                    )
            return b"".join(parts)

        def end() -> bytes:
            if not include_usage:
                return b""
            usage_chunk = {
                "id": stream.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": self._usage(stream),
                "system_fingerprint": SYSTEM_FINGERPRINT,
            }
            return b"data: " + _json_bytes(usage_chunk) + b"\n\n"

        await self._send_events(stream, send, receive, headers, render=render, end=end)

    async def _complete(
        self,
        stream: Stream,
        send: Send,
        receive: Receive,
        model: str,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        if not await self._until_done(stream, receive):
            return
        done = stream.done
        assert done is not None
        text = "".join(stream.pieces[: done.output_tokens])
        usage = self._usage(stream)
        details = usage.get("prompt_tokens_details")
        if details is not None:
            details["multimodal_tokens"] = None
        usage["prompt_tokens_details"] = details
        usage["completion_tokens_details"] = None
        # vLLM 0.32's body, null fields included (simengine/tests/data).
        body = {
            "id": stream.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": done.finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        await _respond(send, 200, _json_bytes(body), extra_headers=headers)

    # -- choices: tools, structured output, n > 1 ---------------------------------------

    def _plan_choice(
        self,
        index: int,
        messages: list[dict[str, Any]],
        *,
        functions: Sequence[Mapping[str, Any]],
        tool_mode: str,
        schema: Mapping[str, Any] | None,
        text_seed: int,
        max_tokens: int,
        ignore_eos: bool,
    ) -> ChoiceOutput:
        """Return what choice ``index`` says: tool calls, a JSON value or text."""
        if functions:
            return choices.plan_tool_calls(
                functions,
                seed=text_seed,
                max_tokens=max_tokens,
                call_ids=[f"chatcmpl-tool-{secrets.token_hex(8)}" for _ in functions],
                mode=tool_mode,
            )
        if schema is not None:
            return choices.plan_json(schema, seed=text_seed, max_tokens=max_tokens)
        answer = self.replica.plan_answer(
            messages, max_tokens=max_tokens, ignore_eos=ignore_eos, text_seed=text_seed
        )
        if answer is not None:
            return choices.plan_text(
                answer.pieces[: answer.output_len], answer.finish_reason
            )
        output_len, finish_reason = self.replica.choose_output_len(
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            seed=_stable_seed(text_seed, index, max_tokens),
        )
        return choices.plan_text(
            tokens.output_text(text_seed, output_len), finish_reason
        )

    def _submit_choices(
        self,
        request_id: str,
        outputs: Sequence[ChoiceOutput],
        *,
        prompts: Sequence[list[int]],
        max_tokens: int,
        arrived_at: float,
        is_streaming: bool,
    ) -> list[Stream]:
        """Queue one engine request per choice, choice ``i`` on ``prompts[i]``
        (``{i}_{id}`` when several, as vLLM names a parent request's children)."""
        streams = []
        for index, output in enumerate(outputs):
            pieces = output.pieces
            streams.append(
                self.replica.submit(
                    request_id=request_id
                    if len(outputs) == 1
                    else f"{index}_{request_id}",
                    prompt_token_ids=prompts[index],
                    output_len=len(pieces),
                    finish_reason=output.finish_reason,
                    max_tokens=max_tokens,
                    arrived_at=arrived_at,
                    text_seed=_stable_seed(request_id, index),
                    answer=Answer(pieces, len(pieces), output.finish_reason),
                    streaming=is_streaming,
                )
            )
        return streams

    def _id_headers(self, request_id: str) -> list[tuple[bytes, bytes]]:
        if self.options.enable_request_id_headers:
            return [(b"x-request-id", request_id.encode())]
        return []

    async def _chat_choices(
        self,
        request_id: str,
        outputs: Sequence[ChoiceOutput],
        send: Send,
        receive: Receive,
        *,
        model: str,
        prompt_ids: list[int],
        max_tokens: int,
        arrived_at: float,
        is_streaming: bool,
        include_usage: bool,
    ) -> None:
        """Answer a chat request whose choices call tools, hold JSON or are several."""
        streams = self._submit_choices(
            request_id,
            outputs,
            prompts=[prompt_ids] * len(outputs),
            max_tokens=max_tokens,
            arrived_at=arrived_at,
            is_streaming=is_streaming,
        )
        headers = self._id_headers(request_id)
        try:
            if is_streaming:
                render = _ChatChunks(
                    request_id,
                    model,
                    outputs,
                    include_usage=include_usage,
                    has_parser=self.options.tool_call_parser is not None,
                )
                await self._send_choice_events(
                    streams,
                    send,
                    receive,
                    headers,
                    start=render.start,
                    render=render.pieces,
                    end=lambda: (
                        render.usage(self._usage_of(streams)) if include_usage else b""
                    ),
                )
            else:
                await self._complete_choices(
                    request_id,
                    streams,
                    outputs,
                    send,
                    receive,
                    model=model,
                    headers=headers,
                )
        finally:
            for stream in streams:
                if stream.done is None:
                    self.replica.abort(stream.request_id)

    async def _all_done(self, streams: Sequence[Stream], receive: Receive) -> bool:
        """Wait until every stream is done; False if the client went away first."""
        for stream in streams:
            if not await self._until_done(stream, receive):
                return False
        return True

    async def _send_choice_events(
        self,
        streams: Sequence[Stream],
        send: Send,
        receive: Receive,
        headers: list[tuple[bytes, bytes]],
        *,
        start: Callable[[], bytes],
        render: Callable[[int, int, int, FinishedRequest | None], bytes],
        end: Callable[[], bytes],
        done_line: bytes = b"data: [DONE]\n\n",
        is_start_early: bool = False,
    ) -> None:
        """Send several streams as server-sent events, interleaved as they come.

        ``start()`` goes with the first piece of any stream (at once with
        ``is_start_early``, as vLLM's Responses stream opens), then for each new
        batch of stream ``i`` ``render(i, sent, produced, done)``; at the end
        ``end()`` and ``done_line``. A client that goes away ends it quietly.
        """
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        *headers,
                    ],
                }
            )
            sent = [0] * len(streams)
            finished = [False] * len(streams)
            started = False
            if is_start_early:
                await send(
                    {"type": "http.response.body", "body": start(), "more_body": True}
                )
                started = True
            while not all(finished):
                live = [s for s, f in zip(streams, finished, strict=True) if not f]
                if not any(s.wake.is_set() for s in live):
                    waiters = [asyncio.ensure_future(s.wake.wait()) for s in live]
                    await asyncio.wait(
                        {*waiters, disconnected}, return_when=asyncio.FIRST_COMPLETED
                    )
                    for waiter in waiters:
                        waiter.cancel()
                    if disconnected.done():
                        return
                parts = []
                for index, stream in enumerate(streams):
                    if finished[index] or not stream.wake.is_set():
                        continue
                    stream.wake.clear()
                    produced, done = stream.produced, stream.done
                    if produced > sent[index]:
                        if not started:
                            parts.append(start())
                            started = True
                        parts.append(render(index, sent[index], produced, done))
                        sent[index] = produced
                    finished[index] = done is not None
                if parts:
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"".join(parts),
                            "more_body": True,
                        }
                    )
            await send(
                {
                    "type": "http.response.body",
                    "body": end() + done_line,
                    "more_body": False,
                }
            )
        finally:
            disconnected.cancel()

    async def _complete_choices(
        self,
        request_id: str,
        streams: Sequence[Stream],
        outputs: Sequence[ChoiceOutput],
        send: Send,
        receive: Receive,
        *,
        model: str,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        if not await self._all_done(streams, receive):
            return
        usage = self._usage_of(streams)
        details = usage.get("prompt_tokens_details")
        if details is not None:
            details["multimodal_tokens"] = None
        usage["prompt_tokens_details"] = details
        usage["completion_tokens_details"] = None
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": index,
                    "message": _chat_message(output),
                    "logprobs": None,
                    "finish_reason": output.reported_finish(),
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                }
                for index, output in enumerate(outputs)
            ],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        await _respond(send, 200, _json_bytes(body), extra_headers=headers)

    # -- /v1/completions ------------------------------------------------------------------

    async def _completions(self, receive: Receive, send: Send) -> None:
        """vLLM's ``/v1/completions``: every prompt times ``n`` choices, indexed
        prompt-major, each its own engine request."""
        arrived_at = time.monotonic()
        body = await self._json_body(receive)
        model = self._check_model(body)
        echo = bool(body.get("echo"))
        try:
            n = choices.check_n(body.get("n"), body.get("temperature"))
            top = completions.check_logprobs(body.get("logprobs"))
            if body.get("suffix") is not None:
                # vLLM 0.32 (online_renderer): only FIM models take a suffix.
                raise choices.RequestError(
                    "Echo is unsupported with suffix."
                    if echo
                    else "suffix is only supported for models with FIM completion "
                    "rendering",
                    "suffix",
                )
            prompts = completions.read_prompts(body.get("prompt"))
        except choices.RequestError as exc:
            raise HttpError(400, exc.message, exc.param) from None
        requested = body.get("max_tokens", 16)
        max_tokens = min(
            self._check_max_tokens(requested, len(p.token_ids)) for p in prompts
        )
        if not self.replica.is_ready:
            raise HttpError(503, "The server is starting up")
        include_usage = self._include_usage(body)
        await self._admit()
        request_id = f"cmpl-{secrets.token_hex(8)}"
        outputs = []
        prompt_ids = []
        for prompt in prompts:
            for index in range(n):
                seed = _stable_seed(body.get("seed"), prompt.token_ids[-16:], index)
                length, reason = self.replica.choose_output_len(
                    max_tokens=max_tokens,
                    ignore_eos=bool(body.get("ignore_eos")),
                    seed=_stable_seed(seed, max_tokens),
                )
                outputs.append(
                    choices.plan_text(tokens.output_text(seed, length), reason)
                )
                prompt_ids.append(prompt.token_ids)
        is_streaming = bool(body.get("stream"))
        streams = self._submit_choices(
            request_id,
            outputs,
            prompts=prompt_ids,
            max_tokens=max_tokens,
            arrived_at=arrived_at,
            is_streaming=is_streaming,
        )
        chunks = _CompletionChunks(
            request_id,
            model,
            outputs,
            [prompts[i // n] for i in range(len(outputs))] if echo else None,
            top=top,
            include_usage=include_usage,
        )
        headers = self._id_headers(request_id)
        try:
            if is_streaming:
                await self._send_choice_events(
                    streams,
                    send,
                    receive,
                    headers,
                    start=lambda: b"",
                    render=chunks.pieces,
                    end=lambda: (
                        chunks.usage(
                            self._completion_usage(streams, n, is_streamed=True)
                        )
                        if include_usage
                        else b""
                    ),
                )
            elif await self._all_done(streams, receive):
                body_out = chunks.body(
                    self._completion_usage(streams, n, is_streamed=False)
                )
                await _respond(send, 200, _json_bytes(body_out), extra_headers=headers)
        finally:
            for stream in streams:
                if stream.done is None:
                    self.replica.abort(stream.request_id)

    def _completion_usage(
        self, streams: Sequence[Stream], n: int, *, is_streamed: bool
    ) -> dict[str, Any]:
        """vLLM's completions usage: each prompt once, every choice's tokens; the
        streamed form drops nulls (``exclude_none``), the plain one keeps them."""
        prompt_tokens = 0
        completion_tokens = 0
        cached = 0
        for index, stream in enumerate(streams):
            done = stream.done
            assert done is not None
            completion_tokens += done.output_tokens
            if index % n == 0:
                prompt_tokens += done.prompt_tokens
            cached = done.cached_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        details: dict[str, Any] | None = (
            {"cached_tokens": cached}
            if self.options.enable_prompt_tokens_details
            else None
        )
        if is_streamed:
            if details is not None:
                usage["prompt_tokens_details"] = details
            return usage
        if details is not None:
            details.update(created_cache_tokens=None, multimodal_tokens=None)
        usage["prompt_tokens_details"] = details
        usage["completion_tokens_details"] = None
        return usage

    # -- /v1/responses --------------------------------------------------------------------

    async def _responses(self, receive: Receive, send: Send) -> None:
        """vLLM's ``/v1/responses``. Responses are kept only with
        ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (and ``store`` not false), as in
        vLLM; without, any ``previous_response_id`` is unknown (404)."""
        arrived_at = time.monotonic()
        body = await self._json_body(receive)
        model = self._check_model(body)
        previous = body.get("previous_response_id")
        history: list[dict[str, Any]] = []
        if previous is not None:
            found = self.response_store.history(str(previous))
            if found is None:
                raise _response_not_found(str(previous))
            history = found
        try:
            messages = responses_input.to_chat_messages(
                body.get("instructions"), body.get("input")
            )
        except ValueError as exc:
            raise HttpError(400, str(exc), "input") from None
        if history:
            # Instructions first, then the earlier turns, then the new input.
            has_system = bool(body.get("instructions"))
            messages = [*messages[:has_system], *history, *messages[has_system:]]
        chat_tools = responses_input.to_chat_tools(body.get("tools"))
        tool_choice = _chat_tool_choice(body.get("tool_choice"))
        try:
            if chat_tools:
                tool_choice = choices.check_tool_choice(
                    {"tools": chat_tools, "tool_choice": tool_choice},
                    auto_enabled=self.options.enable_auto_tool_choice,
                    has_parser=self.options.tool_call_parser is not None,
                )
            text_config = body.get("text")
            schema = choices.output_schema(
                _response_format(text_config.get("format"))
                if isinstance(text_config, Mapping)
                else None
            )
        except choices.RequestError as exc:
            raise HttpError(400, exc.message, exc.param) from None
        prompt_ids = tokens.encode(tokens.render_chat(messages, chat_tools))
        max_tokens = self._check_max_tokens(
            body.get("max_output_tokens"), len(prompt_ids)
        )
        if not self.replica.is_ready:
            raise HttpError(503, "The server is starting up")
        await self._admit()
        request_id = f"resp_{secrets.token_hex(8)}"
        functions: list[Mapping[str, Any]] = []
        if chat_tools and (
            tool_choice != "auto" or self.options.enable_auto_tool_choice
        ):
            functions = choices.choose_tools(
                chat_tools,
                tool_choice,
                messages,
                parallel=body.get("parallel_tool_calls") is not False,
            )
        output = self._plan_choice(
            0,
            messages,
            functions=functions,
            tool_mode=_tool_mode(tool_choice),
            schema=schema,
            text_seed=_stable_seed(body.get("seed"), prompt_ids[-16:], len(prompt_ids)),
            max_tokens=max_tokens,
            ignore_eos=False,
        )
        is_streaming = bool(body.get("stream"))
        streams = self._submit_choices(
            request_id,
            [output],
            prompts=[prompt_ids],
            max_tokens=max_tokens,
            arrived_at=arrived_at,
            is_streaming=is_streaming,
        )
        events = _ResponseEvents(
            _ResponseFrame(
                request_id=request_id,
                model=model,
                body=body,
                max_tokens=max_tokens,
                tool_choice=tool_choice,
                tool_parameters=functions[0].get("parameters")
                if functions and isinstance(tool_choice, Mapping)
                else None,
                previous_response_id=previous,
            ),
            output,
        )
        is_kept = self.options.enable_responses_store and body.get("store") is not False

        def finish(answer: dict[str, Any]) -> dict[str, Any]:
            if is_kept:
                self.response_store.keep(messages, answer)
            return answer

        headers = self._id_headers(request_id)
        try:
            if is_streaming:
                await self._send_choice_events(
                    streams,
                    send,
                    receive,
                    headers,
                    start=events.start,
                    render=events.pieces,
                    end=lambda: events.completed(
                        finish(events.final(self._response_usage(streams[0])))
                    ),
                    done_line=b"",
                    is_start_early=True,
                )
            elif await self._all_done(streams, receive):
                answer = finish(events.response(self._response_usage(streams[0])))
                await _respond(send, 200, _json_bytes(answer), extra_headers=headers)
        finally:
            if streams[0].done is None:
                self.replica.abort(streams[0].request_id)

    async def _stored_response(self, response_id: str, send: Send) -> None:
        """``GET /v1/responses/{id}``: a stored response, else vLLM's 404."""
        stored = self.response_store.response(response_id)
        if stored is None:
            raise _response_not_found(response_id)
        await _respond(send, 200, _json_bytes(stored))

    def _response_usage(self, stream: Stream) -> dict[str, Any]:
        """vLLM's ``ResponseUsage`` (one turn: the per-turn lists stay empty)."""
        usage = self._usage_of((stream,))
        cached = 0
        created = 0
        details = usage.get("prompt_tokens_details")
        if details is not None:
            cached = details["cached_tokens"]
            created = details["created_cache_tokens"]
        elif stream.done is not None:
            cached = stream.done.cached_tokens
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": created,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": usage["total_tokens"],
        }

    # -- SGLang's shapes ----------------------------------------------------------------

    def _sglang_usage(self, stream: Stream) -> dict[str, Any]:
        """SGLang's ``UsageInfo`` (pydantic dump: nulls kept)."""
        done = stream.done
        assert done is not None
        cached = done.cached_tokens
        details = (
            {"cached_tokens": cached} if self.options.enable_cache_report else None
        )
        return {
            "prompt_tokens": done.prompt_tokens,
            "total_tokens": done.prompt_tokens + done.output_tokens,
            "completion_tokens": done.output_tokens,
            "prompt_tokens_details": details,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    @staticmethod
    def _matched_stop(reason: str) -> int | None:
        """SGLang's ``matched_stop``: the EOS id when the answer ended itself."""
        return EOS_TOKEN_ID if reason == "stop" else None

    async def _sglang_stream(
        self,
        stream: Stream,
        send: Send,
        receive: Receive,
        model: str,
        headers: list[tuple[bytes, bytes]],
        *,
        include_usage: bool,
    ) -> None:
        created = int(time.time())
        head = (
            f'data: {{"id":"{stream.request_id}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{json.dumps(model, ensure_ascii=False)},'
            '"choices":[{"index":0,"delta":'
        )
        tail = ',"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'

        def render(sent: int, produced: int, done: FinishedRequest | None) -> bytes:
            parts = []
            if sent == 0:
                parts.append((head + _SGLANG_ROLE_DELTA + tail).encode())
            for piece in stream.pieces[sent:produced]:
                content = json.dumps(
                    {"reasoning_content": None, "content": piece},
                    separators=(",", ":"),
                    ensure_ascii=False,
                )
                parts.append((head + content + tail).encode())
            return b"".join(parts)

        def end() -> bytes:
            # SGLang's finish reason comes in a chunk of its own, after the text.
            done = stream.done
            assert done is not None
            finish = {
                "id": stream.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"reasoning_content": None},
                        "logprobs": None,
                        "finish_reason": done.finish_reason,
                        "matched_stop": self._matched_stop(done.finish_reason),
                    }
                ],
            }
            final = b"data: " + _json_bytes(finish) + b"\n\n"
            if include_usage:
                usage_chunk = {
                    "id": stream.request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._sglang_usage(stream),
                }
                final += b"data: " + _json_bytes(usage_chunk) + b"\n\n"
            return final

        await self._send_events(stream, send, receive, headers, render=render, end=end)

    async def _sglang_complete(
        self,
        stream: Stream,
        send: Send,
        receive: Receive,
        model: str,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        if not await self._until_done(stream, receive):
            return
        done = stream.done
        assert done is not None
        text = "".join(stream.pieces[: done.output_tokens])
        # SGLang's ChatCompletionResponse, null fields included.
        body = {
            "id": stream.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": done.finish_reason,
                    "matched_stop": self._matched_stop(done.finish_reason),
                }
            ],
            "usage": self._sglang_usage(stream),
            "metadata": {
                "weight_version": "default",
                "weight_versions": [
                    {"version": "default", "start": 0, "end": done.output_tokens}
                ],
            },
        }
        await _respond(send, 200, _json_bytes(body), extra_headers=headers)


def _tool_mode(tool_choice: Any) -> str:
    if isinstance(tool_choice, Mapping):
        return "named"
    return "required" if tool_choice == "required" else "auto"


def _piece_owners(output: ChoiceOutput) -> list[int]:
    """Return, per piece, the index of the tool call whose arguments it is part
    of (-1: text, or the tool-call syntax around the arguments)."""
    owners = [-1] * len(output.pieces)
    for index, span in enumerate(output.tool_calls):
        owners[span.start : span.stop] = [index] * (span.stop - span.start)
    return owners


# The delta of the end-of-sequence token of a named call (its text is "").
_NAMED_EOS_DELTA = '{"tool_calls":[{"index":0,"function":{"arguments":""}}]}'


def _chat_delta(
    output: ChoiceOutput, owners: list[int], piece_index: int, *, has_parser: bool
) -> str | None:
    """Return the JSON of a piece's ``delta`` as vLLM streams it, or None where
    vLLM sends no chunk (the tool-call syntax around the arguments).

    Text is content; a call's first argument piece comes with its id, type
    and name, the next ones alone (``"name": null`` for "required", as its
    array parser sends). The end-of-sequence token is ``{}`` with a parser
    (``{"content": ""}`` without), an empty argument piece for a named call.
    """
    piece = output.pieces[piece_index]
    is_eos = output.has_eos and piece_index == len(output.pieces) - 1
    mode = output.tool_mode
    if mode is None:
        if is_eos and has_parser:
            return "{}"
        return '{"content":' + json.dumps(piece, ensure_ascii=False) + "}"
    if is_eos:
        return _NAMED_EOS_DELTA if mode == "named" else "{}"
    if mode == "auto":
        return _hermes_delta(output, owners, piece_index)
    owner = owners[piece_index]
    if owner < 0:
        return None
    span = output.tool_calls[owner]
    call: dict[str, Any]
    if piece_index == span.start:
        call = {
            "id": span.call_id,
            "type": "function",
            "index": owner,
            "function": {"name": span.name, "arguments": piece},
        }
    elif mode == "required":
        call = {"index": owner, "function": {"name": None, "arguments": piece}}
    else:
        call = {"index": owner, "function": {"arguments": piece}}
    return '{"tool_calls":[' + _json_bytes(call).decode() + "]}"


def _hermes_delta(
    output: ChoiceOutput, owners: list[int], piece_index: int
) -> str | None:
    """Return the delta of hermes's streaming parser (``hermes_tool_parser.py``)
    for a piece of an "auto" call: the call's id, type and name once its name is
    complete, then each argument piece; the rest of the syntax sends nothing.
    Its deltas set ``content`` (null) explicitly, so vLLM's chunk keeps it."""
    call: dict[str, Any]
    for index, span in enumerate(output.tool_calls):
        if piece_index == span.header:
            call = {
                "id": span.call_id,
                "type": "function",
                "index": index,
                "function": {"name": span.name},
            }
            break
    else:
        owner = owners[piece_index]
        if owner < 0:
            return None
        call = {"index": owner, "function": {"arguments": output.pieces[piece_index]}}
    return '{"content":null,"tool_calls":[' + _json_bytes(call).decode() + "]}"


class _ChatChunks:
    """vLLM's chat stream chunks for choices that call tools, hold JSON or are
    several (``serving.py`` ``chat_completion_stream_generator``)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        outputs: Sequence[ChoiceOutput],
        *,
        include_usage: bool,
        has_parser: bool,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.outputs = outputs
        self.has_parser = has_parser
        self.owners = [_piece_owners(output) for output in outputs]
        self.include_usage = include_usage
        self.created = int(time.time())
        self.head = (
            f'data: {{"id":"{request_id}","object":"chat.completion.chunk",'
            f'"created":{self.created},"model":{json.dumps(model)},"choices":[{{'
        )

    def start(self) -> bytes:
        """Return the role chunk of every choice (vLLM sends them all first)."""
        parts = []
        for index in range(len(self.outputs)):
            first = {
                "id": self.request_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                "prompt_token_ids": None,
                "prompt_text": None,
            }
            parts.append(b"data: " + _json_bytes(first) + b"\n\n")
        return b"".join(parts)

    def pieces(
        self, index: int, sent: int, produced: int, done: FinishedRequest | None
    ) -> bytes:
        """Return the chunks of choice ``index``'s pieces ``sent:produced``."""
        output = self.outputs[index]
        owners = self.owners[index]
        parts = []
        for piece_index in range(sent, produced):
            is_last = done is not None and piece_index == produced - 1
            delta = _chat_delta(output, owners, piece_index, has_parser=self.has_parser)
            if delta is None:
                if not is_last:
                    continue
                delta = "{}"
            if is_last:
                tail = (
                    f'"logprobs":null,"finish_reason":"{output.reported_finish()}",'
                    '"stop_reason":null,"token_ids":null}]'
                    + (
                        "}\n\n"
                        if self.include_usage
                        else f',"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n'
                    )
                )
            else:
                tail = '"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
            parts.append(f'{self.head}"index":{index},"delta":{delta},{tail}'.encode())
        return b"".join(parts)

    def usage(self, usage: dict[str, Any]) -> bytes:
        """Return the usage chunk (``stream_options.include_usage``)."""
        chunk = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        return b"data: " + _json_bytes(chunk) + b"\n\n"


def _chat_message(output: ChoiceOutput) -> dict[str, Any]:
    """Return a plain answer's ``message`` (vLLM's ``ChatMessage``, nulls kept;
    ``tool_calls`` only when there are some).

    Named and "required" calls come with content ``""``, "auto" ones with null;
    a cut "required" array has content ``""`` and no calls, a cut "auto" call
    is left as text (vLLM's parsers cannot read it).
    """
    calls = output.reported_calls()
    if calls:
        content: str | None = None if output.tool_mode == "auto" else ""
    elif output.tool_mode == "required":
        content = ""
    else:
        content = output.text()
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if calls:
        message["tool_calls"] = [
            {
                "id": span.call_id,
                "type": "function",
                "function": {"name": span.name, "arguments": span.arguments},
            }
            for span in calls
        ]
    message["reasoning"] = None
    return message


class _CompletionChunks:
    """vLLM's ``text_completion`` chunks and body (``completion/serving.py``)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        outputs: Sequence[ChoiceOutput],
        echoed: Sequence[CompletionPrompt] | None,
        *,
        top: int | None,
        include_usage: bool,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.outputs = outputs
        self.echoed = echoed
        self.include_usage = include_usage
        self.created = int(time.time())
        self.writers = (
            [completions.LogprobsWriter(top, index) for index in range(len(outputs))]
            if top is not None
            else None
        )
        self.head = (
            f'data: {{"id":"{request_id}","object":"text_completion",'
            f'"created":{self.created},"model":{json.dumps(model)},"choices":['
        )

    def _text_and_logprobs(
        self, index: int, start: int, stop: int
    ) -> tuple[str, dict[str, Any] | None]:
        pieces = self.outputs[index].pieces[start:stop]
        prompt = self.echoed[index] if self.echoed is not None and start == 0 else None
        text = "".join(pieces)
        if prompt is not None:
            text = prompt.text + text
        if self.writers is None:
            return text, None
        writer = self.writers[index]
        if prompt is None:
            return text, writer.write(pieces)
        return text, writer.write([*prompt.pieces, *pieces], first_is_unscored=True)

    def pieces(
        self, index: int, sent: int, produced: int, done: FinishedRequest | None
    ) -> bytes:
        """Return one chunk per piece of choice ``index`` (the echo with the first)."""
        output = self.outputs[index]
        parts = []
        for piece_index in range(sent, produced):
            text, logprobs = self._text_and_logprobs(
                index, piece_index, piece_index + 1
            )
            is_last = done is not None and piece_index == produced - 1
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": output.finish_reason if is_last else None,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
            tail = (
                f',"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n'
                if is_last and not self.include_usage
                else "}\n\n"
            )
            parts.append(
                (self.head + _json_bytes(choice).decode() + "]" + tail).encode()
            )
        return b"".join(parts)

    def usage(self, usage: dict[str, Any]) -> bytes:
        """Return the usage chunk (``exclude_none``: no nulls)."""
        chunk = {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        return b"data: " + _json_bytes(chunk) + b"\n\n"

    def body(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Return the plain answer (``CompletionResponse``, nulls kept)."""
        choices_out = []
        for index, output in enumerate(self.outputs):
            text, logprobs = self._text_and_logprobs(index, 0, len(output.pieces))
            choices_out.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": output.finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "routed_experts": None,
                }
            )
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices_out,
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }


def _response_not_found(response_id: str) -> HttpError:
    return HttpError(
        404,
        f"Response with id '{response_id}' not found.",
        "response_id",
        err_type="invalid_request_error",
    )


def _chat_tool_choice(tool_choice: Any) -> Any:
    """Return a Responses ``tool_choice`` in the chat form (a named function:
    ``{"type": "function", "function": {"name": ...}}``)."""
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        return {"type": "function", "function": {"name": tool_choice.get("name")}}
    return tool_choice


def _response_format(text_format: Any) -> Any:
    """Return a Responses ``text.format`` as a chat ``response_format``."""
    if isinstance(text_format, Mapping) and text_format.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": dict(text_format)}
    return text_format


def _text_config(text: Any, tool_parameters: Any) -> dict[str, Any] | None:
    """Return the response's ``text`` as vLLM reports it: the request's, or for
    a named function the schema it constrains the output with."""
    if tool_parameters is not None:
        text = {
            "format": {
                "type": "json_schema",
                "name": "tool_calling_response",
                "schema": tool_parameters,
                "strict": True,
            }
        }
    if not isinstance(text, Mapping):
        return None
    fmt = text.get("format")
    dumped: dict[str, Any] | None = None
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        dumped = {
            "name": fmt.get("name"),
            "schema": fmt.get("schema"),
            "type": "json_schema",
            "description": fmt.get("description"),
            "strict": fmt.get("strict"),
        }
    elif isinstance(fmt, Mapping):
        dumped = {"type": fmt.get("type")}
    return {"format": dumped, "verbosity": text.get("verbosity")}


def _response_tool(tool: Any) -> Any:
    """Return a function tool as vLLM echoes it (openai's ``FunctionTool``)."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        return tool
    return {
        "name": tool.get("name"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
        "type": "function",
        "allowed_callers": None,
        "async": None,
        "defer_loading": None,
        "description": tool.get("description"),
        "output_schema": None,
    }


def _response_tool_choice(tool_choice: Any, *, has_tools: bool) -> Any:
    if isinstance(tool_choice, Mapping):
        return {"name": tool_choice.get("function", {}).get("name"), "type": "function"}
    if tool_choice is None:
        return "auto" if has_tools else "none"
    return tool_choice


@dataclass(frozen=True, slots=True)
class _ResponseFrame:
    """What a response object says besides its output and usage."""

    request_id: str
    model: str
    body: Mapping[str, Any]
    max_tokens: int
    tool_choice: Any
    # A named function's parameters: vLLM reports them as the text format.
    tool_parameters: Any
    previous_response_id: Any = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        *,
        output: list[dict[str, Any]],
        status: str,
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Return vLLM's ``ResponsesResponse`` (its fields in its order)."""
        body = self.body
        tools = body.get("tools") or []
        temperature = body.get("temperature")
        top_p = body.get("top_p")
        parallel = body.get("parallel_tool_calls")
        return {
            "id": self.request_id,
            "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": parallel if parallel is not None else True,
            "temperature": float(temperature) if temperature is not None else 1.0,
            "tool_choice": _response_tool_choice(
                self.tool_choice, has_tools=bool(tools)
            ),
            "tools": [_response_tool(tool) for tool in tools],
            "top_p": float(top_p) if top_p is not None else 1.0,
            "background": bool(body.get("background")),
            "max_output_tokens": self.max_tokens,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": self.previous_response_id,
            "prompt": None,
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier") or "auto",
            "status": status,
            "text": _text_config(body.get("text"), self.tool_parameters),
            "top_logprobs": None,
            "truncation": body.get("truncation") or "disabled",
            "usage": usage,
            "user": body.get("user"),
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }


def _text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {
        "annotations": [],
        "text": text,
        "type": "output_text",
        "logprobs": logprobs,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "content": [_text_part(text, None)] if text else [],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def _call_item(
    item_id: str, span: ToolCallSpan, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "arguments": arguments,
        "call_id": span.call_id,
        "name": span.name,
        "type": "function_call",
        "id": item_id,
        "async": None,
        "caller": None,
        "namespace": None,
        "status": status,
    }


class _ResponseEvents:
    """vLLM's Responses stream (``streaming_events.py``, simple path): typed
    events with a ``sequence_number``, message text or function calls opened,
    streamed and closed, then ``response.completed``; and the plain answer."""

    def __init__(self, frame: _ResponseFrame, output: ChoiceOutput) -> None:
        self.frame = frame
        self.output = output
        self.owners = _piece_owners(output)
        self.sequence = 0
        self.open_owner: int | None = None  # -1: the message, else a call
        self.open_id = ""
        self.accumulated = ""
        self.output_index = 0
        self.items: list[dict[str, Any]] = []

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self.sequence
        payload["type"] = kind
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + _json_bytes(payload) + b"\n\n"

    def start(self) -> bytes:
        """Return ``response.created`` and ``response.in_progress``."""
        initial = self.frame.response(output=[], status="in_progress", usage=None)
        return self._event("response.created", {"response": initial}) + self._event(
            "response.in_progress", {"response": initial}
        )

    def _open(self, owner: int) -> bytes:
        self.open_owner = owner
        self.accumulated = ""
        if owner < 0:
            self.open_id = f"msg_{secrets.token_hex(8)}"
            return self._event(
                "response.output_item.added",
                {
                    "item": _message_item(self.open_id, "", "in_progress"),
                    "output_index": self.output_index,
                },
            ) + self._event(
                "response.content_part.added",
                {
                    "content_index": 0,
                    "item_id": self.open_id,
                    "output_index": self.output_index,
                    "part": _text_part("", []),
                },
            )
        self.open_id = f"fc_{secrets.token_hex(8)}"
        span = self.output.tool_calls[owner]
        return self._event(
            "response.output_item.added",
            {
                "item": _call_item(self.open_id, span, "", "in_progress"),
                "output_index": self.output_index,
            },
        )

    def _delta(self, piece: str) -> bytes:
        self.accumulated += piece
        if self.open_owner is not None and self.open_owner < 0:
            return self._event(
                "response.output_text.delta",
                {
                    "content_index": 0,
                    "delta": piece,
                    "item_id": self.open_id,
                    "logprobs": [],
                    "output_index": self.output_index,
                },
            )
        return self._event(
            "response.function_call_arguments.delta",
            {
                "delta": piece,
                "item_id": self.open_id,
                "output_index": self.output_index,
            },
        )

    def _close(self) -> bytes:
        owner = self.open_owner
        if owner is None:
            return b""
        text = self.accumulated
        index = self.output_index
        if owner < 0:
            item = _message_item(self.open_id, text, "completed")
            events = self._event(
                "response.output_text.done",
                {
                    "content_index": 0,
                    "item_id": self.open_id,
                    "logprobs": [],
                    "output_index": index,
                    "text": text,
                },
            ) + self._event(
                "response.content_part.done",
                {
                    "content_index": 0,
                    "item_id": self.open_id,
                    "output_index": index,
                    "part": _text_part(text, None),
                },
            )
        else:
            span = self.output.tool_calls[owner]
            item = _call_item(self.open_id, span, text, "completed")
            events = self._event(
                "response.function_call_arguments.done",
                {
                    "arguments": text,
                    "item_id": self.open_id,
                    "output_index": index,
                    "name": span.name,
                },
            )
        events += self._event(
            "response.output_item.done", {"item": item, "output_index": index}
        )
        self.items.append(item)
        self.output_index += 1
        self.open_owner = None
        return events

    def pieces(
        self, index: int, sent: int, produced: int, done: FinishedRequest | None
    ) -> bytes:
        """Return the events of pieces ``sent:produced`` (closing the open item
        once ``done``)."""
        parts = []
        is_tool_call = self.output.tool_mode is not None
        for piece_index in range(sent, produced):
            piece = self.output.pieces[piece_index]
            owner = self.owners[piece_index]
            if not piece or (is_tool_call and owner < 0):
                continue  # the end token, or tool-call syntax: no event
            if self.open_owner != owner:
                parts.append(self._close())
                parts.append(self._open(owner))
            parts.append(self._delta(piece))
        if done is not None:
            parts.append(self._close())
        return b"".join(parts)

    def _status(self) -> str:
        return "completed" if self.output.is_complete else "incomplete"

    def final(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Return the whole response, once the stream's items are closed."""
        return self.frame.response(
            output=self.items, status=self._status(), usage=usage
        )

    def completed(self, final: dict[str, Any]) -> bytes:
        """Return ``response.completed`` carrying ``final``."""
        return self._event("response.completed", {"response": final})

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Return the plain answer."""
        calls = self.output.reported_calls()
        items = [
            _call_item(f"fc_{secrets.token_hex(8)}", span, span.arguments, "completed")
            for span in calls
        ]
        if not calls:
            text = "" if self.output.tool_mode == "required" else self.output.text()
            items = [_message_item(f"msg_{secrets.token_hex(8)}", text, "completed")]
        return self.frame.response(output=items, status=self._status(), usage=usage)


def build_app(
    options: SimOptions,
    *,
    faults: Faults | None = None,
    on_crash: Callable[[], None] | None = None,
    tracer: EngineTracer | None = None,
) -> SimApp:
    """Return the ASGI app of a replica started with ``options`` (``tracer``:
    its spans, with ``--otlp-traces-endpoint``)."""
    return SimApp(SimReplica(options, faults=faults, on_crash=on_crash), tracer)

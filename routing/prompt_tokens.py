"""Count a chat request's prompt tokens the way the version's engine will.

Public surface: ``ChatTokenCounter``, ``StandInCounter``, ``TemplateCounter``,
``load_counter``, ``VersionCounters``, ``PromptRejected``, ``STAND_IN``.

A version whose weights live in a ``file://`` directory that holds a
``tokenizer.json`` is counted with that tokenizer and the version's registered chat
template, as vLLM does (transformers' ``apply_chat_template``: the template rendered
in a sandboxed Jinja2 environment with ``trim_blocks``/``lstrip_blocks``, the special
tokens as variables, ``add_generation_prompt=True``; the result encoded without
adding special tokens). The tokenizer files must still have the version's
``tokenizer_hash``. Every other version (the simulated fleet, weights on object
storage) is counted with the stand-in tokenizer the simulated replica shares
(``simengine.domain.tokens``). Either way the engine's own usage stays the
number that is metered; this count is what admission charges and what the
context-length check uses before the engine is asked.

Message content is shaped as vLLM shapes it for text-only requests: a list of text
parts is joined with newlines when the template reads ``content`` as a string, and
kept as ``[{"type": "text", "text": ...}]`` parts when it loops over it; a
``developer`` message becomes ``system`` when the template has no developer role.
Tool definitions are rendered as vLLM hands them to the template (each tool's
``function`` with ``description`` and ``parameters`` present, null when absent),
and an assistant message's tool-call arguments as objects (vLLM parses the JSON
string before rendering), so a request with tools is charged for them up front.
Images and per-request template arguments are outside the count.

Loading a tokenizer reads and hashes files and takes milliseconds: ``VersionCounters``
does it in a worker thread, once per version (versions are immutable). Encoding
holds the GIL in ``Tokenizer.encode`` but not in ``encode_batch``, so prompts past
a few hundred characters are encoded in a worker thread with ``encode_batch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol

from engine_nodes.weights import WeightsError, local_path, tokenizer_digest
from routing.domain.snapshot import VersionRecord
from simengine.domain import tokens

__all__ = [
    "STAND_IN",
    "ChatTokenCounter",
    "PromptRejected",
    "StandInCounter",
    "TemplateCounter",
    "VersionCounters",
    "load_counter",
]

logger = logging.getLogger(__name__)

# Below this many characters of rendered prompt, encoding inline (~0.2 ms) is
# cheaper than a hop to a worker thread.
INLINE_CHARS = 512
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


# A request's tool definitions (``[{"type": "function", "function": {...}}]``).
Tools = Sequence[Mapping[str, Any]] | None


class PromptRejected(ValueError):
    """The version's chat template refused the messages (as the engine would: 400)."""


class ChatTokenCounter(Protocol):
    """Counts the prompt tokens of a list of chat messages."""

    @property
    def name(self) -> str:
        """Say which tokenizer counts (for logs)."""
        ...

    def count(
        self, messages: Sequence[Mapping[str, Any]], tools: Tools = None
    ) -> int: ...

    def count_prompt(self, text: str) -> int:
        """Return the tokens of a completion's prompt (special tokens added, as
        the engine adds them)."""
        ...

    def encode(
        self, messages: Sequence[Mapping[str, Any]], tools: Tools = None
    ) -> list[int]:
        """Return the prompt's token ids, as the engine computes them (what its
        prefix cache hashes)."""
        ...


class StandInCounter:
    """The deterministic stand-in tokenizer and template (simulated replicas)."""

    name = "stand-in"

    def count(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> int:
        if tools is None:
            return tokens.count_chat_tokens(messages)
        return tokens.count_chat_tokens(messages, tools=tools)

    def count_prompt(self, text: str) -> int:
        return len(tokens.encode(text))

    def encode(
        self, messages: Sequence[Mapping[str, Any]], tools: Tools = None
    ) -> list[int]:
        return tokens.encode(tokens.render_chat(messages, tools))


STAND_IN = StandInCounter()


@dataclass(frozen=True, eq=False)
class TemplateCounter:
    """A version's real tokenizer (``tokenizers``) and chat template (Jinja2)."""

    name: str
    tokenizer: Any  # tokenizers.Tokenizer
    template: Any  # jinja2.Template
    content_format: Literal["string", "openai"]
    has_developer_role: bool
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> str:
        """Return the prompt text the engine builds from ``messages`` (and
        ``tools``)."""
        conversation = [self._message(m) for m in messages]
        if not self.has_developer_role and any(
            m["role"] == "developer" for m in conversation
        ):
            conversation = _developer_as_system(conversation)
        text: str = self.template.render(
            messages=conversation,
            tools=None if tools is None else [_tool_as_vllm(t) for t in tools],
            documents=None,
            add_generation_prompt=True,
            **self.special_tokens,
        )
        return text

    def count(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> int:
        """Return the number of prompt tokens (encodes in this thread)."""
        return self.count_text(self.render(messages, tools))

    def count_text(self, text: str, *, add_special_tokens: bool = False) -> int:
        return len(self.encode_text(text, add_special_tokens=add_special_tokens))

    def encode_text(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Return the token ids of ``text`` (encodes in this thread)."""
        # encode_batch releases the GIL; encode does not.
        encoding = self.tokenizer.encode_batch(
            [text], add_special_tokens=add_special_tokens
        )[0]
        ids: list[int] = encoding.ids
        return ids

    def encode(
        self, messages: Sequence[Mapping[str, Any]], tools: Tools = None
    ) -> list[int]:
        """Return the prompt's token ids (renders and encodes in this thread)."""
        return self.encode_text(self.render(messages, tools))

    def count_prompt(self, text: str) -> int:
        return self.count_text(text, add_special_tokens=True)

    def _message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        shaped: dict[str, Any] = {"role": message["role"]}
        parts = (
            [{"type": "text", "text": content}]
            if isinstance(content, str)
            else [
                {"type": "text", "text": str(p.get("text", ""))}
                for p in content or ()
                if isinstance(p, Mapping) and p.get("type") == "text"
            ]
        )
        if self.content_format == "openai":
            shaped["content"] = parts
        else:
            shaped["content"] = "\n".join(p["text"] for p in parts)
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                shaped[key] = message[key]
        if message.get("tool_calls") is not None:
            shaped["tool_calls"] = [_call_as_vllm(c) for c in message["tool_calls"]]
        return shaped


def _tool_as_vllm(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives it to the
    template: the function's optional fields present, null when absent."""
    function = tool.get("function") or {}
    return {
        "type": "function",
        "function": {
            "name": function.get("name"),
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        },
    }


def _call_as_vllm(call: Any) -> Any:
    """An assistant's tool call with its arguments parsed, as vLLM renders it
    (arguments that are not JSON stay a string)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def load_counter(version: VersionRecord) -> ChatTokenCounter:
    """Return the counter for ``version``: its own tokenizer where it has one.

    Falls back to the stand-in (and says why in the log) when the weights are not
    in a local directory with a ``tokenizer.json``, when the tokenizer files no
    longer have the registered ``tokenizer_hash``, or when they cannot be loaded.
    """
    ref = f"{version.model}@{version.version}"
    root = local_path(version.weights_uri)
    if root is None or not (root / "tokenizer.json").is_file():
        return STAND_IN
    try:
        digest = tokenizer_digest(root)
    except (WeightsError, OSError) as exc:
        logger.warning(
            "%s: tokenizer unreadable, counting with the stand-in: %s", ref, exc
        )
        return STAND_IN
    if digest != version.tokenizer_hash:
        logger.error(
            "%s: tokenizer files in %s do not match the registered tokenizer_hash; "
            "counting with the stand-in",
            ref,
            root,
        )
        return STAND_IN
    try:
        counter = _template_counter(ref, root, version.chat_template)
    except Exception as exc:
        logger.warning(
            "%s: cannot load tokenizer, counting with the stand-in: %r", ref, exc
        )
        return STAND_IN
    logger.info("%s: counting prompt tokens with its own tokenizer", ref)
    return counter


def _template_counter(ref: str, root: Path, chat_template: str) -> TemplateCounter:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    # A tokenizer.json may carry a fixed truncation and padding (MiniLM's: both
    # 128). transformers, and so the engine, sets them per call instead, and a
    # count must be the text's own: an over-long input is refused here, not cut.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    special: dict[str, str] = {}
    config_path = root / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        for key in _SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, Mapping):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
    template = _compile(chat_template)
    return TemplateCounter(
        name=f"{ref} tokenizer",
        tokenizer=tokenizer,
        template=template,
        content_format=_content_format(template.environment.parse(chat_template)),
        has_developer_role=(
            '"developer"' in chat_template or "'developer'" in chat_template
        ),
        special_tokens=special,
    )


def _compile(chat_template: str) -> Any:
    """Compile a chat template in the environment transformers renders it in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # transformers' {% generation %} marks assistant spans; it renders its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body", [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,  # noqa: FBT001, FBT002 (Jinja passes positionally)
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,  # noqa: FBT001, FBT002
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)  # noqa: DTZ005 (templates print local dates)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(chat_template)


def _content_format(ast: Any) -> Literal["string", "openai"]:
    """Return "openai" when the template (its parsed ``ast``) loops over content parts.

    vLLM's rule, simplified: a ``for`` whose iterable is ``x['content']``,
    ``x.content`` or a variable named ``content``.
    """
    from jinja2 import nodes

    for loop in ast.find_all(nodes.For):
        target = loop.iter
        while isinstance(target, nodes.Filter | nodes.Test) and target.node is not None:
            target = target.node
        if isinstance(target, nodes.Name) and target.name == "content":
            return "openai"
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return "openai"
        if (
            isinstance(target, nodes.Getitem)
            and isinstance(target.arg, nodes.Const)
            and target.arg.value == "content"
        ):
            return "openai"
    return "string"


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn developer messages into one leading system message, as vLLM does."""
    converted = [
        {**m, "role": "system"} if m["role"] == "developer" else m for m in conversation
    ]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = []
    for i in systems:
        content = converted[i].get("content", "")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content)
        if content:
            texts.append(content)
    rest = [m for m in converted if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


class VersionCounters:
    """The gateway's prompt counters, one per version, loaded off the event loop.

    ``prepare`` (called with each new snapshot) starts loading counters for
    versions not seen before; ``count`` uses a loaded counter, or waits for the
    load in progress (never blocking the loop). Versions are immutable, so a
    counter is kept for the life of the process; retired versions are dropped
    when a snapshot no longer lists them.
    """

    def __init__(self, *, inline_chars: int = INLINE_CHARS) -> None:
        self.inline_chars = inline_chars
        self._counters: dict[tuple[str, str], ChatTokenCounter] = {}
        self._loading: dict[tuple[str, str], asyncio.Future[ChatTokenCounter]] = {}

    def prepare(self, versions: Iterable[VersionRecord]) -> None:
        """Start loading counters for new versions; forget vanished ones."""
        wanted = {(v.model, v.version): v for v in versions}
        for key in set(self._counters) - set(wanted):
            del self._counters[key]
        for key, version in wanted.items():
            if key not in self._counters and key not in self._loading:
                self._start(key, version)

    def counter_for(self, model: str, version: str) -> ChatTokenCounter | None:
        """Return the loaded counter of a version, None if it is not loaded yet."""
        return self._counters.get((model, version))

    async def count(
        self,
        version: VersionRecord | None,
        messages: Sequence[Mapping[str, Any]],
        tools: Tools = None,
    ) -> int:
        """Return the prompt tokens of ``messages`` (and ``tools``) for ``version``.

        Raises:
            PromptRejected: the version's chat template refused the messages.
        """
        return len(await self.encode(version, messages, tools))

    async def encode(
        self,
        version: VersionRecord | None,
        messages: Sequence[Mapping[str, Any]],
        tools: Tools = None,
    ) -> list[int]:
        """Return the prompt token ids of ``messages`` (and ``tools``) for
        ``version``: ``count``'s work, keeping the ids (cache-aware routing keys
        the prompt's blocks by them)."""
        counter = await self._counter(version)
        if not isinstance(counter, TemplateCounter):
            return counter.encode(messages, tools)
        try:
            text = counter.render(messages, tools)
        except Exception as exc:
            # A template may raise_exception() on messages it does not accept
            # (roles out of order); vLLM answers those with a 400 as well.
            raise PromptRejected(
                f"the chat template rejected the messages: {exc}"
            ) from None
        if len(text) <= self.inline_chars:
            return counter.encode_text(text)
        return await asyncio.to_thread(counter.encode_text, text)

    async def count_prompts(
        self, version: VersionRecord | None, prompts: Sequence[str | list[int]]
    ) -> list[int]:
        """Return the tokens of each completion prompt: a token list's length, a
        text's tokens with the engine's special tokens added."""
        counter = await self._counter(version)
        counts = []
        for prompt in prompts:
            if isinstance(prompt, list):
                counts.append(len(prompt))
            elif len(prompt) <= self.inline_chars:
                counts.append(counter.count_prompt(prompt))
            else:
                counts.append(await asyncio.to_thread(counter.count_prompt, prompt))
        return counts

    async def _counter(self, version: VersionRecord | None) -> ChatTokenCounter:
        if version is None:
            return STAND_IN
        key = (version.model, version.version)
        counter = self._counters.get(key)
        if counter is None:
            future = self._loading.get(key) or self._start(key, version)
            counter = await asyncio.shield(future)
        return counter

    async def close(self) -> None:
        """Cancel the loads still running (a gateway stopping), so that none is
        left pending when its event loop closes (asyncio would log each one as a
        task destroyed while pending). Their threads finish and are discarded."""
        loading = list(self._loading.values())
        for future in loading:
            future.cancel()
        for future in loading:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await future

    def _start(
        self, key: tuple[str, str], version: VersionRecord
    ) -> asyncio.Future[ChatTokenCounter]:
        future = asyncio.ensure_future(asyncio.to_thread(load_counter, version))
        self._loading[key] = future

        def loaded(done: asyncio.Future[ChatTokenCounter]) -> None:
            self._loading.pop(key, None)
            if not done.cancelled() and done.exception() is None:
                self._counters[key] = done.result()

        future.add_done_callback(loaded)
        return future

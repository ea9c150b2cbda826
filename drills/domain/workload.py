"""What the fleet simulator's clients send: conversations, teams, tiers and traces.

Public surface: ``TeamSpec``, ``ChatWorkload``, ``WORKLOADS``, ``workload_preset``,
``prefix_tokens_of``, ``TraceRequest``, ``read_trace``, ``trace_arrivals``,
``Arrival``, ``Conversations``, ``recorded_block_key``, ``convert_block_keys``,
``check_block_size``.

``ChatWorkload`` is the seed's traffic: ``users`` (``arrival_rate *
message_interval_s`` of them) each send a message every ``message_interval_s`` on
average, as independent Poisson processes, so arrivals are Poisson at
``arrival_rate`` and each comes from a user drawn uniformly. Users belong to teams
in proportion to ``TeamSpec.weight``; each team's arrivals are their own Poisson
stream, so a team can surge alone. Two conversation shapes:

- ``"seed"``: every prompt has ``prompt_tokens`` tokens, of which the first
  ``history_tokens`` are the conversation's history (the same tokens every turn,
  the part a warm replica holds) and the rest are new; answers are
  ``answer_tokens`` long and not part of the next prompt.
- ``"growing"``: a real chat. The first prompt is ``prompt_tokens -
  history_tokens`` new tokens; every later prompt is the previous prompt, the
  previous answer and ``prompt_tokens - history_tokens`` new tokens. A conversation
  whose next turn would pass ``max_context_tokens`` starts afresh.

``conversation_turns`` (when set) makes a user start a new conversation after that
many turns, so some requests find no history anywhere.

``shared_prefixes`` (when > 0) puts a shared prefix before every prompt (RAG
documents, a few-shot preamble, an agent's tools): a conversation is bound at its
start to one of that many prefixes, drawn by a Zipf law of exponent
``shared_prefix_zipf`` (prefix 0 the most popular), each of a fixed length in
``shared_prefix_tokens`` (drawn once per prefix number, the same for every seed).
The prompt is the prefix, then the conversation's history and new tokens, and the
prefix counts as history: any replica that served the prefix can serve it again.
``workload_preset`` names the three workloads the routing A/B runs (``WORKLOADS``).

A logged trace (JSONL, one request per line) replays exactly: ``t`` (seconds from
the start), ``team``, ``tier``, ``conversation``, ``prompt_tokens`` or ``prompt``
(text, counted with the platform's tokenizer) or ``messages``, ``max_tokens``, and
optionally ``output_tokens`` (default ``max_tokens``), ``history_tokens`` and
``cached_tokens`` (the recorded hit, kept for the plan's measured hit rate). The
history of a turn is, by default, the prefix it shares with its conversation's
previous turn: counted on tokens for text, else the previous prompt plus answer.

A recorded trace (``manage.py export_traffic``: ``routing.domain.traffic.
trace_lines``) also carries ``block_size`` and ``prefix_blocks``, the prompt's
chain of salted block hashes. Those hashes become the request's KV block keys
(``Arrival.block_keys``, ``recorded_block_key``), so the fleet simulator hits
exactly where a real prefix cache would: a system prompt shared by many
conversations, a conversation's history, nothing else. A turn's answer blocks
take the hashes of its conversation's next turn where that turn extends it
(the answer is in the next prompt), and a turn's ``history_tokens`` is the
blocks any earlier line produced (what an unbounded cache would serve).
``convert_block_keys`` maps the chain to a replica whose block is a multiple of
the trace's (a chained hash names the whole prefix up to its block, so every
k-th one is exact); a smaller or non-multiple block is refused.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from routing.domain.tiers import Tier
from simengine.domain import tokens as tokenizer

__all__ = [
    "WORKLOADS",
    "Arrival",
    "ChatWorkload",
    "Conversations",
    "TeamSpec",
    "TraceRequest",
    "check_block_size",
    "convert_block_keys",
    "prefix_tokens_of",
    "read_trace",
    "recorded_block_key",
    "trace_arrivals",
    "workload_preset",
]

# The routing A/B's workloads (``workload_preset``).
WORKLOADS = ("seed", "shared", "agent")


@dataclass(frozen=True, slots=True)
class TeamSpec:
    """One team of clients: its share of users, tier and limits.

    ``tokens_per_minute`` 0 means no bucket; ``max_concurrency`` 0 means no cap on
    its streams in flight; ``guaranteed_share`` is its share of the pool under
    overload (``routing.domain.admission``).
    """

    name: str
    weight: float = 1.0
    tier: str = Tier.STANDARD.value
    tokens_per_minute: int = 0
    guaranteed_share: float = 0.0
    max_concurrency: int = 0  # streams in flight at once; 0 means no cap

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"team {self.name}: weight must be positive")
        Tier(self.tier)
        if self.tokens_per_minute < 0:
            raise ValueError(f"team {self.name}: tokens_per_minute must be >= 0")
        if self.max_concurrency < 0:
            raise ValueError(f"team {self.name}: max_concurrency must be >= 0")
        if not 0.0 <= self.guaranteed_share <= 1.0:
            raise ValueError(f"team {self.name}: guaranteed_share must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """The seed's chat traffic (defaults are the seed's figures)."""

    arrival_rate: float = 100.0  # requests/s over all teams
    message_interval_s: float = 40.0
    prompt_tokens: int = 1200
    history_tokens: int = 800
    answer_tokens: int = 300
    max_tokens: int = 300
    mode: str = "seed"  # "seed" | "growing"
    conversation_turns: int | None = None
    max_context_tokens: int = 8192
    teams: tuple[TeamSpec, ...] = field(default=(TeamSpec("default"),))
    shared_prefixes: int = 0  # 0: no shared prefix
    shared_prefix_tokens: tuple[int, int] = (1500, 3000)  # each one's length range
    shared_prefix_zipf: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("seed", "growing"):
            raise ValueError("mode must be 'seed' or 'growing'")
        if not (self.arrival_rate > 0 and self.message_interval_s > 0):
            raise ValueError("arrival_rate and message_interval_s must be positive")
        if not 0 <= self.history_tokens < self.prompt_tokens:
            raise ValueError("history_tokens must be in [0, prompt_tokens)")
        if not 1 <= self.answer_tokens <= self.max_tokens:
            raise ValueError("answer_tokens must be in [1, max_tokens]")
        if not self.teams:
            raise ValueError("a workload needs at least one team")
        if len({team.name for team in self.teams}) != len(self.teams):
            raise ValueError("team names must be unique")
        if self.conversation_turns is not None and self.conversation_turns < 1:
            raise ValueError("conversation_turns must be at least 1")
        if self.shared_prefixes < 0 or self.shared_prefix_zipf < 0:
            raise ValueError("shared_prefixes and shared_prefix_zipf must be >= 0")
        low, high = self.shared_prefix_tokens
        if not 1 <= low <= high:
            raise ValueError("shared_prefix_tokens must be a range (low, high) >= 1")
        longest = high if self.shared_prefixes else 0
        if longest + self.prompt_tokens + self.max_tokens > self.max_context_tokens:
            raise ValueError(
                "shared prefix + prompt_tokens + max_tokens exceed max_context_tokens"
            )

    @property
    def users(self) -> int:
        """Users sending messages: arrival rate x interval between their messages."""
        return max(1, round(self.arrival_rate * self.message_interval_s))

    def team_users(self) -> dict[str, range]:
        """Return each team's users as a range of user numbers (by weight)."""
        total = sum(team.weight for team in self.teams)
        users = self.users
        ranges: dict[str, range] = {}
        start = 0
        cumulative = 0.0
        for team in self.teams:
            cumulative += team.weight
            end = max(start + 1, round(users * cumulative / total))
            ranges[team.name] = range(start, end)
            start = end
        return ranges

    def team_rate(self, team: TeamSpec) -> float:
        """Return the team's share of the base arrival rate (requests/s)."""
        return self.arrival_rate * team.weight / sum(t.weight for t in self.teams)

    def prefix_weights(self) -> list[float]:
        """Return the Zipf weights of the shared prefixes (prefix 0 first)."""
        s = self.shared_prefix_zipf
        return [1.0 / (rank + 1) ** s for rank in range(self.shared_prefixes)]


def prefix_tokens_of(workload: ChatWorkload, group: int) -> int:
    """Return the length of shared prefix ``group``: fixed per number, whatever the
    seed, so runs with different seeds share their prefixes."""
    low, high = workload.shared_prefix_tokens
    return random.Random(f"shared-prefix:{group}").randint(low, high)


def workload_preset(
    name: str, *, arrival_rate: float | None = None, shared_prefixes: int = 16
) -> ChatWorkload:
    """Return one of the routing A/B's workloads (``WORKLOADS``).

    - ``"seed"``: the seed's chat (100 requests/s at the peak).
    - ``"shared"``: the seed's chat behind ``shared_prefixes`` (16) shared prefixes
      (RAG documents or a few-shot preamble) of 1,500-3,000 tokens, Zipf-popular.
    - ``"agent"``: tool-calling loops: growing contexts up to 32k tokens, each turn
      a 1,000-token tool result and a 100-token answer, a turn every 6 s per agent
      (10 requests/s by default: 60 agents, which load 12 ``a100-8b`` replicas).

    Raises:
        ValueError: an unknown name.
    """
    if name == "seed":
        return ChatWorkload(arrival_rate=arrival_rate or 100.0)
    if name == "shared":
        return ChatWorkload(
            arrival_rate=arrival_rate or 100.0, shared_prefixes=shared_prefixes
        )
    if name == "agent":
        return ChatWorkload(
            arrival_rate=arrival_rate or 10.0,
            message_interval_s=6.0,
            mode="growing",
            prompt_tokens=2000,
            history_tokens=1000,
            answer_tokens=100,
            max_tokens=200,
            max_context_tokens=32_768,
        )
    raise ValueError(f"workload is one of {', '.join(WORKLOADS)}; got {name!r}")


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as the gateway receives it.

    ``history_tokens`` and ``stream_tokens`` count the shared prefix
    (``prefix_tokens`` of prefix ``prefix_group``; -1 and 0: none), which leads
    the prompt. A recorded trace's line has ``block_keys``, the keys of its
    leading KV blocks of ``block_keys_size`` tokens (``recorded_block_key``),
    and ``replica``, the replica that served it (empty: not recorded).
    """

    at: float
    team: str
    tier: str
    conversation: int
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    history_tokens: int
    stream_tokens: int
    prefix_group: int = -1
    prefix_tokens: int = 0
    block_keys: tuple[int, ...] = ()
    block_keys_size: int = 0
    replica: str = ""


# A recorded block's key: 62 bits of its hash under the two top bits of 64, so it
# is never a synthetic stream's key (below 2**63) nor a shared prefix's (bit 63
# alone over small numbers), and stays a uint64 as KV events need.
_RECORDED_TAG = 0b11 << 62
_RECORDED_MASK = (1 << 62) - 1


def recorded_block_key(block_hash: str) -> int:
    """Return the simulator's key of a recorded block hash (hex): the same hash,
    the same key, whatever conversation it comes from."""
    return _RECORDED_TAG | (int(block_hash, 16) & _RECORDED_MASK)


def convert_block_keys(
    keys: tuple[int, ...], from_size: int, to_size: int
) -> tuple[int, ...]:
    """Return ``keys`` (blocks of ``from_size`` tokens) as blocks of ``to_size``.

    Each key of a chain names the whole prefix up to its block, so block j of
    ``k * from_size`` tokens is the key of the trace's block ``(j + 1) * k - 1``.

    Raises:
        ValueError: ``to_size`` is not a multiple of ``from_size`` (a smaller
            block's hash is not in the trace).
    """
    if not keys or from_size == to_size:
        return keys
    if from_size < 1 or to_size % from_size:
        raise ValueError(
            f"the trace's prefix hashes are blocks of {from_size} tokens; the "
            f"simulator's block of {to_size} is not a multiple of it (replay "
            f"with a block size of {from_size} or a multiple)"
        )
    k = to_size // from_size
    return keys[k - 1 :: k]


def check_block_size(arrivals: Iterable[Arrival], block_size: int) -> None:
    """Raise ``convert_block_keys``' ValueError now, before a run, if the first
    arrival with recorded blocks cannot be replayed on blocks of ``block_size``."""
    for arrival in arrivals:
        if arrival.block_keys_size:
            convert_block_keys(arrival.block_keys, arrival.block_keys_size, block_size)
            return


class Conversations:
    """The per-user state of a ``ChatWorkload``: who talks in which conversation."""

    def __init__(self, workload: ChatWorkload, rng: random.Random) -> None:
        self.workload = workload
        self.rng = rng
        self._restarts: dict[int, int] = {}
        # user -> [conversation, turn, own stream length so far, prefix group]
        self._state: dict[int, list[int]] = {}
        self._groups = range(workload.shared_prefixes)
        self._weights = workload.prefix_weights()
        self._prefix_tokens = [prefix_tokens_of(workload, g) for g in self._groups]

    def _new_conversation(self, user: int) -> list[int]:
        # Numbered per user, so one team's traffic never renumbers another's.
        restarts = self._restarts.get(user, 0)
        self._restarts[user] = restarts + 1
        group = -1
        if self._weights:
            # Drawn only with shared prefixes: the seed's chat keeps its draws.
            group = self.rng.choices(self._groups, self._weights)[0]
        return [user << 20 | restarts, 0, 0, group]

    def next_request(self, user: int, team: TeamSpec, at: float) -> Arrival:
        """Return user ``user``'s next message at ``at``."""
        w = self.workload
        state = self._state.get(user)
        if state is None or (
            w.conversation_turns is not None and state[1] >= w.conversation_turns
        ):
            state = self._state[user] = self._new_conversation(user)
        conversation, turn, stream, group = state
        prefix = self._prefix_tokens[group] if group >= 0 else 0
        new_tokens = w.prompt_tokens - w.history_tokens
        if w.mode == "seed":
            prompt = prefix + w.prompt_tokens
            history = prefix + (w.history_tokens if turn else 0)
            stream_tokens = prefix + w.history_tokens
        else:
            prompt = prefix + stream + new_tokens
            if prompt + w.max_tokens > w.max_context_tokens:
                state[:] = self._new_conversation(user)
                conversation, turn, stream, group = state
                prefix = self._prefix_tokens[group] if group >= 0 else 0
                prompt = prefix + new_tokens
            history = prefix + stream
            stream_tokens = prompt + w.answer_tokens
            state[2] = stream_tokens - prefix
        state[1] = turn + 1
        return Arrival(
            at=at,
            team=team.name,
            tier=team.tier,
            conversation=conversation,
            prompt_tokens=prompt,
            output_tokens=w.answer_tokens,
            max_tokens=w.max_tokens,
            history_tokens=history,
            stream_tokens=stream_tokens,
            prefix_group=group,
            prefix_tokens=prefix,
        )


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a logged trace, as read."""

    t: float
    team: str
    tier: str
    conversation: str
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    history_tokens: int | None
    prompt_ids: tuple[int, ...] | None = None
    block_size: int = 0  # of ``prefix_blocks``; 0: none recorded
    prefix_blocks: tuple[str, ...] = ()
    cached_tokens: int = 0  # the recorded replica's hit (an export's), if any
    replica: str = ""  # the replica that served it (an export's), if recorded


def _trace_line(number: int, raw: dict[str, object]) -> TraceRequest:
    def need(name: str) -> object:
        if name not in raw:
            raise ValueError(f"trace line {number}: missing {name!r}")
        return raw[name]

    def number_of(name: str, value: object) -> float:
        # JSON gives int, float or str here when the trace is well formed; anything
        # else (null, a list, an unparsable string) is the line's error, named.
        if isinstance(value, int | float | str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"trace line {number}: {name} is not a number ({value!r})")

    def whole(name: str, value: object) -> int:
        if isinstance(value, int | float | str):
            try:
                return int(value)
            except (ValueError, OverflowError):
                pass
        raise ValueError(f"trace line {number}: {name} is not an integer ({value!r})")

    prompt_ids: tuple[int, ...] | None = None
    if "prompt_tokens" in raw:
        prompt_tokens = whole("prompt_tokens", raw["prompt_tokens"])
    elif "messages" in raw:
        messages = raw["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(message, dict) for message in messages
        ):
            raise ValueError(f"trace line {number}: messages is not a list of objects")
        prompt_ids = tuple(tokenizer.encode(tokenizer.render_chat(messages)))
        prompt_tokens = len(prompt_ids)
    elif "prompt" in raw:
        prompt_ids = tuple(tokenizer.encode(str(raw["prompt"])))
        prompt_tokens = len(prompt_ids)
    else:
        raise ValueError(
            f"trace line {number}: needs prompt_tokens, prompt or messages"
        )
    max_tokens = whole("max_tokens", need("max_tokens"))
    output = whole("output_tokens", raw.get("output_tokens", max_tokens))
    history = raw.get("history_tokens")
    block_size, blocks = _prefix_blocks(number, raw, prompt_tokens)
    request = TraceRequest(
        t=number_of("t", need("t")),
        team=str(raw.get("team", "default")),
        tier=str(raw.get("tier", Tier.STANDARD.value)),
        conversation=str(raw.get("conversation", f"line-{number}")),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        output_tokens=min(output, max_tokens),
        history_tokens=None if history is None else whole("history_tokens", history),
        prompt_ids=prompt_ids,
        block_size=block_size,
        prefix_blocks=blocks,
        cached_tokens=max(0, whole("cached_tokens", raw.get("cached_tokens", 0))),
        replica=str(raw.get("replica") or ""),
    )
    if request.t < 0 or request.prompt_tokens < 1 or request.output_tokens < 1:
        raise ValueError(
            f"trace line {number}: t must be >= 0, prompt and output tokens >= 1"
        )
    Tier(request.tier)
    return request


def _prefix_blocks(
    number: int, raw: dict[str, object], prompt_tokens: int
) -> tuple[int, tuple[str, ...]]:
    blocks = raw.get("prefix_blocks")
    if blocks is None:
        return 0, ()
    size = raw.get("block_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"trace line {number}: prefix_blocks needs a block_size >= 1")
    if not isinstance(blocks, list) or not all(
        isinstance(b, str) and _is_hex(b) for b in blocks
    ):
        raise ValueError(f"trace line {number}: prefix_blocks is not a list of hex")
    if len(blocks) * size > prompt_tokens:
        raise ValueError(
            f"trace line {number}: {len(blocks)} blocks of {size} tokens exceed "
            f"the prompt's {prompt_tokens}"
        )
    return size, tuple(blocks)


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return bool(text)


def read_trace(path: Path | str) -> list[TraceRequest]:
    """Read a JSONL trace, sorted by time (stable).

    Raises:
        ValueError: a line that is not JSON or lacks a field, naming the line.
    """
    requests = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"trace line {number}: not JSON ({exc.msg})") from None
            if not isinstance(raw, dict):
                raise ValueError(f"trace line {number}: not a JSON object")
            requests.append(_trace_line(number, raw))
    requests.sort(key=lambda r: r.t)
    return requests


def trace_arrivals(trace: Iterable[TraceRequest]) -> Iterator[Arrival]:
    """Turn trace lines into arrivals, working out each turn's shared history.

    A conversation is one token stream while each turn extends the last (prompt,
    then answer, then the next prompt). A turn that shares less than that (an
    edited history) starts a new stream with no history: its hits are then
    under-counted, never invented.
    """
    requests = list(trace)
    answers = _answer_blocks(requests)
    seen: set[str] = set()  # recorded blocks some earlier line produced
    # conversation -> (stream id, prompt ids or None, stream length)
    last: dict[str, tuple[int, tuple[int, ...] | None, int]] = {}
    streams = 0
    for index, request in enumerate(requests):
        previous = last.get(request.conversation)
        history = 0
        if previous is None:
            stream = streams
            streams += 1
        else:
            stream, prev_ids, prev_len = previous
            if request.history_tokens is not None:
                history = request.history_tokens
            elif request.prompt_ids is not None and prev_ids is not None:
                shared = _common_prefix(request.prompt_ids, prev_ids)
                # All of the last prompt: the turn extends it through the answer.
                history = prev_len if shared == len(prev_ids) else shared
            else:
                history = prev_len
            history = min(history, request.prompt_tokens)
            if history < min(prev_len, request.prompt_tokens):
                stream, history = streams, 0
                streams += 1
        stream_tokens = request.prompt_tokens + request.output_tokens
        last[request.conversation] = (stream, request.prompt_ids, stream_tokens)
        blocks = request.prefix_blocks
        if request.block_size:
            held = 0
            while held < len(blocks) and blocks[held] in seen:
                held += 1
            history = held * request.block_size
            blocks += answers.get(index, ())
            seen.update(blocks)
        yield Arrival(
            at=request.t,
            team=request.team,
            tier=request.tier,
            conversation=stream,
            prompt_tokens=request.prompt_tokens,
            output_tokens=request.output_tokens,
            max_tokens=request.max_tokens,
            history_tokens=history,
            stream_tokens=stream_tokens,
            block_keys=tuple(recorded_block_key(b) for b in blocks),
            block_keys_size=request.block_size,
            replica=request.replica,
        )


def _answer_blocks(requests: list[TraceRequest]) -> dict[int, tuple[str, ...]]:
    """Return, per line with recorded blocks, the blocks of its answer: those of
    its conversation's next turn that extend its prompt, within prompt + answer."""
    answers: dict[int, tuple[str, ...]] = {}
    previous: dict[str, int] = {}
    for index, request in enumerate(requests):
        before = previous.get(request.conversation)
        previous[request.conversation] = index
        if before is None:
            continue
        last = requests[before]
        if not last.block_size or last.block_size != request.block_size:
            continue
        mine, theirs = last.prefix_blocks, request.prefix_blocks
        if theirs[: len(mine)] == mine:
            # The last answer token is never computed (its KV would come next step).
            full = (last.prompt_tokens + last.output_tokens - 1) // last.block_size
            answers[before] = theirs[len(mine) : full]
    return answers


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

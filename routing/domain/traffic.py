"""The traffic twin's records: what the gateway keeps of a request, with no text.

Public surface: ``TrafficRecord``, ``block_chain``, ``text_block_chain``,
``is_sampled``, ``salted_id``, ``derive_salt``, ``trace_lines``.

A pool that opts in (``Pool.record_traffic_share``) has that share of its
conversations recorded: arrival time, team, tier, model and version, prompt
tokens, ``max_tokens``, output tokens, the replica and its cached tokens (its
hit), the routing key's hash, and the prompt's prefix as a chain of salted block
hashes. Nothing in a record is text.

- **Chained, salted block hashes.** The prompt's token ids are cut into blocks of
  ``block_size`` (vLLM's 16 by default; a trailing partial block is left out, as
  an engine's prefix cache leaves it out); block i's hash is keyed BLAKE2b over
  block i-1's hash and block i's ids, so it covers blocks 0..i. Two prompts
  share exactly as many leading hashes as they share leading full blocks: a
  shared system prompt or a conversation's history shows, its content does not.
  The key (the salt) is the platform's secret, so a hash cannot be looked up in a
  dictionary of likely prompts, and two platforms' records cannot be joined.
- **Whole conversations.** Sampling draws on the routing key (``is_sampled``): a
  conversation is recorded turn after turn or not at all, so its history stays
  visible in the trace.
- **Identifiers hashed.** The routing key (it may be a client's conversation id)
  is kept only salted and hashed; the export hashes the team as well
  (``trace_lines``).

A replay that must send text (the load-test gate) gets a stand-in
(``stand_in_prompt``): one word of the stand-in tokenizer's vocabulary per token,
drawn from the block hashes, so prompts that share hash prefixes share text
prefixes, and the text says nothing of the original. In an export a turn's
partial last block takes the words of its conversation's next turn where that
turn extends it (``trace_lines``): the next turn's text then extends this one's
whole, as the real prompts did, and a replay keeps the conversation's history.

Without token ids, ``text_block_chain`` cuts texts into blocks of characters the
same way (deterministic, so shared prefixes still share hashes).
"""

from __future__ import annotations

import array
import hashlib
import hmac
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from routing.domain.routing_key import stable_fraction
from simengine.domain.tokens import OUTPUT_WORDS

__all__ = [
    "TrafficRecord",
    "block_chain",
    "derive_salt",
    "is_sampled",
    "salted_id",
    "stand_in_prompt",
    "text_block_chain",
    "trace_lines",
]

_DIGEST_BYTES = 8  # 64 bits per block: a collision only merges two prefixes
_SAMPLE_SALT = "traffic"


def derive_salt(secret: str) -> bytes:
    """Return the 32-byte hashing key derived from a platform secret (never the
    secret itself)."""
    return hmac.new(secret.encode(), b"platform traffic twin", hashlib.sha256).digest()


def block_chain(token_ids: Sequence[int], *, block_size: int, salt: bytes) -> list[str]:
    """Return the chained, salted hashes (hex) of the full blocks of ``token_ids``.

    Each id counts as 4 little-endian bytes (its low 32 bits); one keyed hasher
    is set up and copied per block (a fifth of the cost of keying each).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    try:
        ids = array.array("I", token_ids)
    except OverflowError:  # an id outside 32 bits: keep its low 32
        ids = array.array("I", (t & 0xFFFFFFFF for t in token_ids))
    if sys.byteorder == "big":  # pragma: no cover
        ids.byteswap()
    raw = ids.tobytes()
    keyed = hashlib.blake2b(digest_size=_DIGEST_BYTES, key=salt)
    step = 4 * block_size
    chain: list[str] = []
    parent = b""
    for start in range(0, len(ids) // block_size * step, step):
        hasher = keyed.copy()
        hasher.update(parent)
        hasher.update(raw[start : start + step])
        parent = hasher.digest()
        chain.append(parent.hex())
    return chain


def text_block_chain(
    texts: Iterable[str], *, block_chars: int, salt: bytes
) -> list[str]:
    """Return the chain of ``texts`` joined (NUL between them) and cut into blocks
    of ``block_chars`` code points: the fallback where no token ids are known."""
    if block_chars < 1:
        raise ValueError("block_chars must be >= 1")
    joined = "\x00".join(texts)
    chain: list[str] = []
    parent = b""
    for start in range(0, len(joined) - block_chars + 1, block_chars):
        data = parent + joined[start : start + block_chars].encode("utf-8")
        parent = hashlib.blake2b(data, digest_size=_DIGEST_BYTES, key=salt).digest()
        chain.append(parent.hex())
    return chain


def salted_id(value: str, salt: bytes) -> str:
    """Return 16 hex digits standing for ``value`` (a routing key, a team)."""
    return hashlib.blake2b(
        value.encode("utf-8"), digest_size=_DIGEST_BYTES, key=salt, person=b"id"
    ).hexdigest()


def is_sampled(routing_key: str, share: float) -> bool:
    """Return True if the conversation of ``routing_key`` is in the recorded
    ``share`` (0..1); the same answer for every turn and every gateway."""
    if share <= 0.0:
        return False
    return share >= 1.0 or stable_fraction(routing_key, _SAMPLE_SALT) < share


@dataclass(frozen=True, slots=True)
class TrafficRecord:
    """One request as the traffic twin keeps it (no text; see the module).

    ``at`` is the arrival (unix seconds); ``key`` the routing key's salted hash;
    ``blocks`` the prompt's chain of block hashes; ``cached_tokens`` the replica's
    hit (prompt tokens its prefix cache held); ``outcome`` how the request ended
    (``ok``, ``client_closed``, ``error``...).
    """

    at: float
    team: str
    tier: str
    model: str
    version: str
    surface: str
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    cached_tokens: int
    key: str
    replica: str
    outcome: str
    block_size: int
    blocks: tuple[str, ...]

    def to_row(self) -> list[Any]:
        """Return the record as a JSON-able row (the stream keeps batches of rows)."""
        return [
            round(self.at, 3),
            self.team,
            self.tier,
            self.model,
            self.version,
            self.surface,
            self.prompt_tokens,
            self.max_tokens,
            self.output_tokens,
            self.cached_tokens,
            self.key,
            self.replica,
            self.outcome,
            self.block_size,
            " ".join(self.blocks),
        ]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> TrafficRecord:
        """Return the record ``to_row`` wrote.

        Raises:
            TypeError, ValueError: not such a row.
        """
        if not isinstance(row, list | tuple) or len(row) != _ROW_LENGTH:
            raise ValueError("not a traffic record row")
        (at, team, tier, model, version, surface, prompt, most, out, cached) = row[:10]
        key, replica, outcome, block_size, blocks = row[10:]
        return cls(
            at=float(at),
            team=str(team),
            tier=str(tier),
            model=str(model),
            version=str(version),
            surface=str(surface),
            prompt_tokens=int(prompt),
            max_tokens=int(most),
            output_tokens=int(out),
            cached_tokens=int(cached),
            key=str(key),
            replica=str(replica),
            outcome=str(outcome),
            block_size=int(block_size),
            blocks=tuple(str(blocks).split()),
        )


_ROW_LENGTH = 15


def _block_words(block: str, block_size: int) -> list[str]:
    picks = hashlib.shake_128(bytes.fromhex(block)).digest(block_size)
    return [OUTPUT_WORDS[i % len(OUTPUT_WORDS)] for i in picks]


def stand_in_prompt(record: TrafficRecord, *, then: TrafficRecord | None = None) -> str:
    """Return a text of about ``record.prompt_tokens`` stand-in tokens whose
    leading blocks follow ``record.blocks`` (the same hashes, the same words).

    ``then`` is the conversation's next turn: where its blocks extend
    ``record``'s, the partial last block is the start of its next block's words
    (that block held this prompt's end and the answer), so its text extends this one.
    """
    words: list[str] = []
    for block in record.blocks:
        words.extend(_block_words(block, record.block_size))
    if (
        then is not None
        and then.block_size == record.block_size
        and len(then.blocks) > len(record.blocks)
        and then.blocks[: len(record.blocks)] == record.blocks
    ):
        after = _block_words(then.blocks[len(record.blocks)], record.block_size)
        words.extend(after[: max(0, record.prompt_tokens - len(words))])
    tail = max(0, record.prompt_tokens - len(words))
    seed = f"{record.key}:{record.at:.3f}".encode()
    words.extend(
        OUTPUT_WORDS[i % len(OUTPUT_WORDS)]
        for i in hashlib.shake_128(seed).digest(tail)
    )
    return "".join(words).lstrip()


def trace_lines(
    records: Iterable[TrafficRecord], *, salt: bytes, stand_in_text: bool = True
) -> tuple[list[dict[str, Any]], int]:
    """Return a replayable trace of ``records`` and how many were left out.

    One line per answered request, in arrival order, in the fields the load-test
    gate and the fleet simulator read (``drills.domain.workload``: ``t`` from the
    first arrival, ``team``, ``tier``, ``conversation``, ``prompt_tokens``,
    ``max_tokens``, ``output_tokens``, ``history_tokens``), plus the record's own
    (``model``, ``version``, ``cached_tokens``, ``replica``, ``block_size``,
    ``prefix_blocks``). The team is hashed; the conversation is the routing key's
    hash. ``history_tokens`` is set where a turn does not extend its
    conversation's previous prompt whole (the blocks they share); otherwise the
    reader counts the previous prompt and answer as the history. With
    ``stand_in_text`` each line has a ``prompt`` (``stand_in_prompt``) for a
    replay that sends text (a turn's text extends into its next turn's, see the
    module); readers that count take ``prompt_tokens``. Requests that
    produced no output token (refused by the engine, failed, left before it) are
    left out: a replay cannot ask for zero tokens.
    """
    ordered = sorted(records, key=lambda r: r.at)
    following: dict[int, TrafficRecord] = {}  # index -> its conversation's next turn
    last_of: dict[str, int] = {}
    for index, record in enumerate(ordered):
        if record.output_tokens < 1 or record.prompt_tokens < 1:
            continue
        if record.key in last_of:
            following[last_of[record.key]] = record
        last_of[record.key] = index
    lines: list[dict[str, Any]] = []
    skipped = 0
    previous: dict[str, tuple[str, ...]] = {}
    start: float | None = None
    for index, record in enumerate(ordered):
        if record.output_tokens < 1 or record.prompt_tokens < 1:
            skipped += 1
            continue
        if start is None:
            start = record.at
        line: dict[str, Any] = {
            "t": round(record.at - start, 3),
            "team": "team-" + salted_id(record.team, salt),
            "tier": record.tier,
            "conversation": record.key,
            "model": record.model,
            "version": record.version,
            "prompt_tokens": record.prompt_tokens,
            "max_tokens": max(record.max_tokens, record.output_tokens),
            "output_tokens": record.output_tokens,
            "cached_tokens": record.cached_tokens,
            "replica": record.replica,
            "block_size": record.block_size,
            "prefix_blocks": list(record.blocks),
        }
        if stand_in_text:
            line["prompt"] = stand_in_prompt(record, then=following.get(index))
        before = previous.get(record.key)
        if before is not None and record.blocks[: len(before)] != before:
            line["history_tokens"] = _shared(before, record.blocks) * record.block_size
        previous[record.key] = record.blocks
        lines.append(line)
    return lines, skipped


def _shared(a: Sequence[str], b: Sequence[str]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

"""The deterministic stand-in tokenizer and chat template (gateway and replica).

Public surface: ``render_chat``, ``encode``, ``split_pieces``, ``count_chat_tokens``,
``decode_token``, ``output_token_id``, ``output_token_ids``, ``output_text``, ``request_seed``,
``SPECIAL_TOKEN_IDS``, ``OUTPUT_WORDS``.

It is not a real BPE. It only has to be the same everywhere, cheap, prefix-stable and
about as dense as a real one (≈ 4 characters of English per token):

- ``encode`` splits text with one regex, tried in this order:

  1. the chat markers ``<|system|> <|user|> <|assistant|> <|end|>`` (fixed ids 1-4);
  2. a run of at most 4 letters/digits, with **one** optional leading space attached
     (``" hello"`` → ``" hell"``, ``"o"``);
  3. one punctuation character (``_`` counts as punctuation), with an optional leading
     space, unless it starts a marker (so ``"hi <|end|>"`` still ends in ``<|end|>``);
  4. a run of whitespace that stops before the last space ahead of a word, so that
     space joins the word (GPT-2's ``\\s+(?!\\S)``); any other whitespace run.

  Every other piece maps to ``1000 + crc32(utf-8) % 127000``, so ids lie in
  ``[1000, 128000)`` and never depend on ``PYTHONHASHSEED``. Different pieces may share
  an id (the space is small); that only matters for ``decode_token``.
- Prefix stability: every rendered message ends with ``<|end|>\\n`` and the next starts
  with a marker, and the prompt ends with ``<|assistant|>\\n``; the regex never joins
  across those points, so a conversation that grows by whole messages (or by the reply
  after ``<|assistant|>\\n``) has the old token list as an exact prefix.
- Tools: with ``tools`` the prompt opens with one ``<|system|>`` block holding the
  tool definitions' compact JSON; an assistant message's ``tool_calls`` follow its
  content as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``. Without
  tools the prompt is as it always was.
- Output text is drawn from ``OUTPUT_WORDS`` by a seeded counter-mode generator: 256
  short English words, each with a leading space, each exactly one piece and thus one
  token, with distinct ids. ``output_token_id(seed, i)`` is the id of the i-th output
  piece. The engine generates ``output_token_ids(request_seed(request_id), ...)``, so
  a server that streams ``output_text(request_seed(request_id), n)`` sends text that
  re-encodes to the ids in the replica's output KV blocks (next-turn prefix hits).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "OUTPUT_WORDS",
    "SPECIAL_TOKEN_IDS",
    "count_chat_tokens",
    "decode_token",
    "encode",
    "message_text",
    "output_text",
    "output_token_id",
    "output_token_ids",
    "render_chat",
    "request_seed",
    "split_pieces",
]

SPECIAL_TOKEN_IDS: Mapping[str, int] = {
    "<|system|>": 1,
    "<|user|>": 2,
    "<|assistant|>": 3,
    "<|end|>": 4,
}
_FIRST_PIECE_ID = 1000
_PIECE_ID_SPAN = 127_000  # ids lie in [1000, 128000), a Llama-3-sized vocabulary

_MARKER = r"<\|(?:system|user|assistant|end)\|>"
_PIECE_RE = re.compile(
    _MARKER + r"| ?[^\W_]{1,4}"
    r"| ?(?!" + _MARKER + r")(?:[^\w\s]|_)"
    r"|\s+(?!\S)"
    r"|\s+"
)


@functools.lru_cache(maxsize=1 << 16)
def _piece_id(piece: str) -> int:
    special = SPECIAL_TOKEN_IDS.get(piece)
    if special is not None:
        return special
    return _FIRST_PIECE_ID + zlib.crc32(piece.encode("utf-8")) % _PIECE_ID_SPAN


def message_text(content: Any) -> str:
    """Return a message's text: a string as is, the text parts of a list joined.

    OpenAI clients send content as a string or as ``[{"type": "text", "text": ...}]``
    parts; other parts (images) carry no text; ``None`` is empty.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _render_message(message: Mapping[str, Any]) -> str:
    text = message_text(message.get("content"))
    calls = message.get("tool_calls")
    if calls:
        text += "".join(
            "<tool_call>"
            + _compact_json(
                {
                    "name": call.get("function", {}).get("name"),
                    "arguments": call.get("function", {}).get("arguments"),
                }
            )
            + "</tool_call>"
            for call in calls
            if isinstance(call, Mapping)
        )
    return f"<|{message['role']}|>\n{text}<|end|>\n"


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Return the prompt text: the tools' block when ``tools`` is non-empty, then
    ``<|role|>\ncontent<|end|>\n`` per message, then ``<|assistant|>\n``."""
    parts = [f"<|system|>\n{_compact_json(list(tools))}<|end|>\n"] if tools else []
    parts.extend(_render_message(m) for m in messages)
    parts.append("<|assistant|>\n")
    return "".join(parts)


def encode(text: str) -> list[int]:
    """Return the token ids of ``text``; a pure function of the text."""
    return [_piece_id(piece) for piece in _PIECE_RE.findall(text)]


def split_pieces(text: str) -> list[str]:
    """Return ``text`` cut into its tokens' texts: they join back to ``text`` and
    ``len(split_pieces(t)) == len(encode(t))``."""
    return _PIECE_RE.findall(text)


def count_chat_tokens(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> int:
    """Return the number of prompt tokens of a chat request (with its ``tools``,
    as the request sends them), equal to the replica's ``prompt_tokens``."""
    return len(encode(render_chat(messages, tools)))


# 256 short, common words, all with distinct ids: with the leading space each is one
# regex piece (at most 4 letters), so n output pieces re-encode to exactly n tokens,
# and one random byte picks one word.
_WORD_SOURCE = (
    "the of and to in is it that for on was with as he be at by this had not are "
    "but from or have an they one you were her all she we him been has when who "
    "will more no if out so said what up its into than them can only new some time "
    "two may then do any my now such like our over man me even most made also did "
    "many off must well back just year much way your very make long down work life "
    "good know same each part take four own last next five hand end day does keep "
    "came old home both side left felt mean show few word less open seem city near "
    "upon once told hard line tree real lost form high ever best fact team book "
    "read love data plan road soon kind run sea eye far let set put say too use big "
    "car yes got ask war boy bad cut job air fire door game land town mind free "
    "hope rate body task blue gold rest note step path ship rain sun moon star wind "
    "snow fish bird dog cat cow pig hill lake farm bank shop fair deep dark warm "
    "cold cool fast slow late busy calm wise bold pure safe rich poor full half "
    "done gone seen sent kept held hold give find tell call move play live walk "
    "talk turn help stop wait hear feel grow draw pay buy sell send lead meet sit "
    "lie fall rise win lose"
)
_OUTPUT_VOCABULARY_SIZE = 256
_OUTPUT_BLOCK = 16  # output ids are drawn 16 at a time, one blake2b digest per block


def _build_output_vocabulary() -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Return the output words (with their leading space) and their ids.

    Raises:
        RuntimeError: the word list lost a word to a long spelling or an id
            collision (raised at import, so a bad edit cannot ship).
    """
    words: list[str] = []
    ids: list[int] = []
    for word in _WORD_SOURCE.split():
        piece = " " + word
        token_id = _piece_id(piece)
        if len(word) > 4 or token_id in ids:
            continue
        words.append(piece)
        ids.append(token_id)
    if len(words) != _OUTPUT_VOCABULARY_SIZE:
        raise RuntimeError(f"output vocabulary has {len(words)} usable words, not 256")
    return tuple(words), tuple(ids)


OUTPUT_WORDS, _OUTPUT_IDS = _build_output_vocabulary()
_ID_TO_TEXT: dict[int, str] = {
    **{token_id: piece for piece, token_id in SPECIAL_TOKEN_IDS.items()},
    **dict(zip(_OUTPUT_IDS, OUTPUT_WORDS, strict=True)),
}
_MASK64 = (1 << 64) - 1


def request_seed(request_id: str) -> int:
    """Return a 64-bit seed derived from a request id (stable across processes)."""
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _output_block_ids(seed_bytes: bytes, block: int) -> list[int]:
    digest = hashlib.blake2b(
        seed_bytes + block.to_bytes(8, "little"), digest_size=_OUTPUT_BLOCK
    ).digest()
    return [_OUTPUT_IDS[byte] for byte in digest]


def output_token_ids(seed: int, start: int, stop: int) -> list[int]:
    """Return the ids of output pieces ``start`` to ``stop - 1`` of stream ``seed``.

    Piece ``i`` is word number ``byte[i % 16]`` of ``blake2b(seed, i // 16)``: a
    counter-mode generator, so any slice costs one digest per 16 pieces.
    """
    if stop <= start:
        return []
    seed_bytes = (seed & _MASK64).to_bytes(8, "little")
    first_block = start // _OUTPUT_BLOCK
    ids: list[int] = []
    for block in range(first_block, (stop - 1) // _OUTPUT_BLOCK + 1):
        ids += _output_block_ids(seed_bytes, block)
    offset = first_block * _OUTPUT_BLOCK
    return ids[start - offset : stop - offset]


def output_token_id(seed: int, index: int) -> int:
    """Return the id of output piece ``index`` of the stream seeded by ``seed``."""
    return output_token_ids(seed, index, index + 1)[0]


def output_text(seed: int, n: int) -> list[str]:
    """Return the first ``n`` output pieces of the stream seeded by ``seed``.

    Invariant: ``encode("".join(output_text(s, n))) == output_token_ids(s, 0, n)``:
    each piece is one word with a leading space, hence one token.
    """
    return [_ID_TO_TEXT[token_id] for token_id in output_token_ids(seed, 0, n)]


def decode_token(token_id: int) -> str:
    """Return the text of a token id.

    Markers and output-vocabulary ids decode exactly. Any other id decodes to a
    stand-in output word (``encode`` is many-to-one, so it cannot be inverted).
    """
    text = _ID_TO_TEXT.get(token_id)
    if text is not None:
        return text
    return OUTPUT_WORDS[token_id % _OUTPUT_VOCABULARY_SIZE]

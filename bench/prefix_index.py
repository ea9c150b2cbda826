"""Measure what cache-aware routing adds to a request, and what events cost.

A pool's ``PrefixIndex`` is filled as a busy pool's would be: ``--replicas``
replicas, each holding ``--blocks`` 16-token blocks of 1,200-token conversations
(a 7B model's GPU cache on an H100 is about 30,000 such blocks; the host tier
adds more). Then, side by side on the same prompts (2,000 tokens, half of them
opening with a conversation some replica holds):

- ``encode``: what the gateway already does per request without cache-aware
  routing, counting the prompt (the stand-in tokenizer over the rendered chat);
- ``keys``: cutting the prompt's ids into blocks and hashing them
  (``prompt_block_keys``);
- ``match``: the index lookup (``PrefixIndex.match``);
- ``apply``: applying one replica's ``BlockStored`` of a 1,200-token prompt
  (75 blocks), the gateway's cost per event batch, off the request path.

Each is timed ``--repeats`` times; medians are reported, and the request-path
cost as a ratio to ``encode``. Run from the repository root:

    .venv/bin/python bench/prefix_index.py --out bench/results/prefix_index.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from routing.domain.kv_index import PrefixIndex, prompt_block_keys  # noqa: E402
from simengine.domain import tokens  # noqa: E402
from simengine.domain.kv_events import BlockStored, EventBatch  # noqa: E402

BLOCK = 16
CONVERSATION_TOKENS = 1_200
PROMPT_TOKENS = 2_000


def conversation_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 50_000) for _ in range(n)]


def stored(ids: list[int], first_hash: int) -> BlockStored:
    blocks = len(ids) // BLOCK
    return BlockStored(
        block_hashes=tuple(range(first_hash, first_hash + blocks)),
        parent_block_hash=None,
        token_ids=tuple(ids[: blocks * BLOCK]),
        block_size=BLOCK,
    )


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=14)
    parser.add_argument("--blocks", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    index = PrefixIndex()
    held: list[list[int]] = []
    next_hash = 1
    per_replica = max(1, args.blocks * BLOCK // CONVERSATION_TOKENS)
    fill_started = time.perf_counter()
    apply_s: list[float] = []
    for r in range(args.replicas):
        for seq in range(per_replica):
            ids = conversation_ids(rng, CONVERSATION_TOKENS)
            batch = EventBatch(ts=0.0, events=(stored(ids, next_hash),))
            next_hash += CONVERSATION_TOKENS // BLOCK
            started = time.perf_counter()
            index.apply(f"r{r}", seq, batch, now=0.0)
            apply_s.append(time.perf_counter() - started)
            if rng.random() < 0.01:
                held.append(ids)
    fill_s = time.perf_counter() - fill_started

    words = tokens.OUTPUT_WORDS
    encode_s: list[float] = []
    keys_s: list[float] = []
    match_s: list[float] = []
    hits = 0
    for i in range(args.repeats):
        text = "".join(rng.choice(words) for _ in range(PROMPT_TOKENS))
        messages = [{"role": "user", "content": text}]
        started = time.perf_counter()
        ids = tokens.encode(tokens.render_chat(messages))
        encode_s.append(time.perf_counter() - started)
        if i % 2 == 0 and held:
            # Half the prompts open with a conversation a replica holds.
            opening = rng.choice(held)
            ids = opening + ids[: PROMPT_TOKENS - len(opening)]
        started = time.perf_counter()
        keys = prompt_block_keys(ids, BLOCK)
        keys_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        found = index.match(keys, len(ids))
        match_s.append(time.perf_counter() - started)
        hits += bool(found)

    result = {
        "replicas": args.replicas,
        "blocks_per_replica": index.blocks() // args.replicas,
        "prompt_tokens": PROMPT_TOKENS,
        "repeats": args.repeats,
        "prompts_with_a_hit": hits,
        "fill_s": round(fill_s, 2),
        "median_us": {
            "encode": round(median_us(encode_s), 1),
            "keys": round(median_us(keys_s), 1),
            "match": round(median_us(match_s), 1),
            "apply_75_blocks": round(median_us(apply_s), 1),
        },
        "request_path_over_encode": round(
            (statistics.median(keys_s) + statistics.median(match_s))
            / statistics.median(encode_s),
            3,
        ),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

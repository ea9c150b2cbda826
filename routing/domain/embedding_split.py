"""Whether to split a large embeddings request across replicas, and where.

Public surface: ``SplitRule``, ``DEFAULT_SPLIT_RULE``, ``split_inputs``.

An embeddings request is one batch on one replica, and a pooling engine's time
grows with the batch's tokens (the simulated replica: 9 ms a batch plus 0.32 ms
an input token, measured on vLLM). Split into contiguous chunks sent at once to
replicas that are idle, it takes about the longest chunk's time. It is worth it
only where the replicas would otherwise sit idle (a busy replica gains nothing,
and each chunk pays a batch's fixed cost again) and where each chunk is large
enough that the fixed costs (the batch's, the gateway's extra round trip and
merge) are small beside what it saves. The numbers behind the defaults are in
docs/engines.md (``bench/embedding_split.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_SPLIT_RULE", "SplitRule", "split_inputs"]


@dataclass(frozen=True, slots=True)
class SplitRule:
    """When a request is split: at least ``min_inputs`` inputs, each chunk at
    least ``min_chunk_tokens`` input tokens, at most ``max_chunks`` chunks."""

    min_inputs: int
    min_chunk_tokens: int
    max_chunks: int


DEFAULT_SPLIT_RULE = SplitRule(min_inputs=32, min_chunk_tokens=256, max_chunks=4)


def split_inputs(
    input_tokens: Sequence[int], idle_replicas: int, rule: SplitRule
) -> list[range]:
    """Return the request's inputs as contiguous ranges, one per replica.

    ``input_tokens`` are the inputs' counts, in order; ``idle_replicas`` the
    serving replicas with nothing in flight. One range (the whole request) when
    splitting is not worth it; otherwise as many chunks as idle replicas, the
    rule's cap, the tokens (``min_chunk_tokens`` each) and the inputs allow,
    cut where the running total of tokens crosses each chunk's even share.
    """
    count = len(input_tokens)
    total = sum(input_tokens)
    chunks = min(
        idle_replicas, rule.max_chunks, total // max(1, rule.min_chunk_tokens), count
    )
    if count < rule.min_inputs or chunks < 2:
        return [range(count)]
    cuts = [0]
    running = 0
    for index, tokens in enumerate(input_tokens):
        running += tokens
        # Cut after this input once its chunk holds its share, leaving at least
        # one input for each chunk still to come.
        share = total * len(cuts) / chunks
        if (
            running >= share
            and len(cuts) < chunks
            and count - index - 1 >= chunks - len(cuts)
        ):
            cuts.append(index + 1)
    cuts.append(count)
    return [range(start, end) for start, end in itertools.pairwise(cuts)]

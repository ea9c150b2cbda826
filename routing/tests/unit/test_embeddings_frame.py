"""An engine's embeddings answer is read by its frame: vectors kept byte for byte."""

from __future__ import annotations

import json

import pytest

from routing.embeddings import merge_embeddings, read_embeddings

# Numbers as an engine prints them, which a parse and print could change.
VECTOR = b"[0.1, -2.5e-07, 1.0000000000000002, 3]"


def answer(*vectors: bytes, usage: bytes = b'{"prompt_tokens": 7}') -> bytes:
    data = b", ".join(
        b'{"object": "embedding", "index": %d, "embedding": %s}' % (i, v)
        for i, v in enumerate(vectors)
    )
    return (
        b'{"id": "embd-1", "object": "list", "created": 5, "model": "m", '
        b'"data": [%s], "usage": %s}' % (data, usage)
    )


def test_vectors_are_kept_as_the_engines_bytes() -> None:
    read = read_embeddings(answer(VECTOR, b'"AAAAPw=="'), counted=99)
    assert [bytes(item.embedding) for item in read.data] == [VECTOR, b'"AAAAPw=="']
    assert [item.index for item in read.data] == [0, 1]
    assert (read.answer_id, read.created) == ("embd-1", 5)
    assert read.usage.prompt_tokens == 7
    assert read.usage.completion_tokens == 0


def test_an_answer_without_the_engines_count_is_charged_the_gateways() -> None:
    read = read_embeddings(answer(VECTOR, usage=b"null"), counted=11)
    assert read.usage.prompt_tokens == 11
    read = read_embeddings(answer(VECTOR, usage=b'{"prompt_tokens": "7"}'), counted=11)
    assert read.usage.prompt_tokens == 11


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"data": {}}',
        b'{"object": "list"}',
        b'{"data": [{"index": "0", "embedding": [1]}]}',
        b'{"data": [{"index": 0}]}',
        answer(VECTOR)[:-3],
    ],
)
def test_a_body_that_is_not_an_embeddings_answer_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="not an embeddings answer"):
        read_embeddings(raw, counted=1)


def test_a_split_is_merged_in_input_order_with_whole_request_indexes() -> None:
    first = read_embeddings(answer(b"[1]", b"[2]"), counted=0)
    # The second chunk's engine answered its vectors out of order.
    second = read_embeddings(
        b'{"data": [{"index": 1, "embedding": [4]}, {"index": 0, "embedding": [3]}],'
        b' "usage": {"prompt_tokens": 5}}',
        counted=0,
    )
    merged = merge_embeddings([first, second], [range(0, 2), range(2, 4)])
    assert [
        (item.index, json.loads(bytes(item.embedding))) for item in merged.data
    ] == [
        (0, [1]),
        (1, [2]),
        (2, [3]),
        (3, [4]),
    ]
    assert merged.usage.prompt_tokens == 12
    with pytest.raises(ValueError, match="one vector per input"):
        merge_embeddings([first, second], [range(0, 2), range(2, 5)])

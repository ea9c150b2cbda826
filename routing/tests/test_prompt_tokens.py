"""Prompt tokens counted with a version's own tokenizer and chat template.

A small byte-level BPE is trained here with ``tokenizers`` (milliseconds), so these
tests need neither vLLM nor transformers; ``tests/test_vllm_e2e.py`` checks the
count against real vLLM's ``prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import TypedDict, Unpack

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine_nodes.weights import tokenizer_digest
from routing.domain.snapshot import VersionRecord
from routing.prompt_tokens import (
    STAND_IN,
    PromptRejected,
    TemplateCounter,
    VersionCounters,
    load_counter,
)
from simengine.domain import tokens

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Loops over content parts: vLLM hands such templates the parts, not a string.
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
    "{% for part in m.content %}({{ part.text }}){% endfor %}{% endfor %}"
)
SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["def hello(): return 1", "the quick brown fox jumps"] * 50
    tokenizer.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    return root


class VersionChanges(TypedDict, total=False):
    """The fields of the tiny version a test may change."""

    weights_uri: str
    tokenizer_hash: str


def version_of(
    root: Path, template: str = TEMPLATE, **changes: Unpack[VersionChanges]
) -> VersionRecord:
    version = VersionRecord(
        model="tiny",
        version="v1",
        status="live",
        max_model_len=2048,
        load_test_tokens_in_flight=None,
        weights_uri=f"file://{root}/",
        tokenizer_hash=tokenizer_digest(root),
        chat_template=template,
    )
    return dataclasses.replace(version, **changes)


def encoded(root: Path, text: str) -> int:
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_counter_counts_the_rendered_template_with_the_real_tokenizer(
    checkpoint: Path,
) -> None:
    counter = load_counter(version_of(checkpoint))
    assert isinstance(counter, TemplateCounter)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "def hello(): return 1"},
    ]
    text = (
        "<|system|>\nbe brief<|end|>\n<|user|>\ndef hello(): return 1<|end|>\n"
        "<|assistant|>\n"
    )
    assert counter.render(messages) == text
    assert counter.count(messages) == encoded(checkpoint, text)
    # The markers are special tokens of this tokenizer: one token each.
    assert counter.count(messages) < tokens.count_chat_tokens(messages) * 3


def test_text_parts_are_joined_with_newlines_for_a_string_template(
    checkpoint: Path,
) -> None:
    counter = load_counter(version_of(checkpoint))
    assert isinstance(counter, TemplateCounter)
    parts = [
        {"type": "text", "text": "one"},
        {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "two"},
    ]
    rendered = counter.render(
        [{"role": "user", "content": parts}, {"role": "assistant", "content": None}]
    )
    assert rendered == (
        "<|user|>\none\ntwo<|end|>\n<|assistant|>\n<|end|>\n<|assistant|>\n"
    )


def test_a_template_that_loops_over_parts_gets_parts_and_special_tokens(
    checkpoint: Path,
) -> None:
    counter = load_counter(version_of(checkpoint, PARTS_TEMPLATE))
    assert isinstance(counter, TemplateCounter)
    assert counter.content_format == "openai"
    rendered = counter.render(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "text", "text": "b"},
                ],
            }
        ]
    )
    assert rendered == "<s>[user](a)(b)"


def test_developer_messages_become_one_leading_system_message(
    checkpoint: Path,
) -> None:
    counter = load_counter(version_of(checkpoint))
    assert isinstance(counter, TemplateCounter)
    rendered = counter.render(
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": "dev"},
        ]
    )
    assert rendered == (
        "<|system|>\nsys\n\ndev<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"weights_uri": "s3://models/tiny/"},
        {"tokenizer_hash": "0" * 64},
        {"weights_uri": "file:///nonexistent/tiny/"},
    ],
    ids=["object-storage", "tokenizer-changed", "no-tokenizer"],
)
def test_versions_without_a_usable_tokenizer_use_the_stand_in(
    checkpoint: Path, changes: VersionChanges
) -> None:
    assert load_counter(version_of(checkpoint, **changes)) is STAND_IN


def test_version_counters_load_off_the_loop_and_count(checkpoint: Path) -> None:
    version = version_of(checkpoint)
    messages = [{"role": "user", "content": "the quick brown fox " * 50}]

    async def scenario() -> tuple[int, int, int]:
        counters = VersionCounters(inline_chars=100)
        counters.prepare([version])
        assert counters.counter_for("tiny", "v1") is None  # loading in a thread
        threaded = await counters.count(version, messages)  # past inline_chars
        assert isinstance(counters.counter_for("tiny", "v1"), TemplateCounter)
        short = await counters.count(version, [{"role": "user", "content": "hi"}])
        stand_in = await counters.count(None, messages)
        counters.prepare([])
        assert counters.counter_for("tiny", "v1") is None
        return threaded, short, stand_in

    threaded, short, stand_in = asyncio.run(scenario())
    counter = load_counter(version)
    assert threaded == counter.count(messages)
    assert short == counter.count([{"role": "user", "content": "hi"}])
    assert stand_in == tokens.count_chat_tokens(messages)


def test_a_template_refusing_the_messages_is_a_prompt_rejection(
    checkpoint: Path,
) -> None:
    version = version_of(
        checkpoint,
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('system first') }}{% endif %}",
    )

    async def scenario() -> None:
        await VersionCounters().count(version, [{"role": "user", "content": "x"}])

    with pytest.raises(PromptRejected, match="system first"):
        asyncio.run(scenario())


def test_transformers_template_extensions_render(checkpoint: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
    )
    counter = load_counter(version_of(checkpoint, template))
    assert isinstance(counter, TemplateCounter)
    rendered = counter.render([{"role": "user", "content": "é"}, {"role": "x"}])
    assert rendered == '{"role": "user", "content": "é"}'


def test_a_tokenizer_saved_with_truncation_and_padding_counts_the_whole_text(
    checkpoint: Path, tmp_path: Path
) -> None:
    """GIVEN a tokenizer.json that fixes truncation and padding (MiniLM's: 128)
    and a version with no chat template (an embedding model's)
    WHEN the gateway counts a prompt longer than that, and a short one
    THEN both counts are the texts' own: not cut at 128, not padded to it.
    """
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=8)
    tokenizer.enable_padding(length=8, pad_token="<unk>")
    root = tmp_path / "fixed"
    root.mkdir()
    tokenizer.save(str(root / "tokenizer.json"))
    counter = load_counter(version_of(root, template=""))
    assert isinstance(counter, TemplateCounter)
    long_text = "the quick brown fox jumps " * 10
    assert counter.count_prompt(long_text) == encoded(checkpoint, long_text) > 8
    assert counter.count_prompt("fox") == encoded(checkpoint, "fox") < 8

"""The refusal detector: patterns at the start of an answer, and their setting."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.domain.refusals import (
    DEFAULT_REFUSAL_PATTERNS,
    HEAD_CHARS,
    RefusalDetector,
    parse_refusal_patterns,
)

DETECTOR = RefusalDetector()


@pytest.mark.parametrize(
    "text",
    [
        "I am sorry, I cannot help with that.",
        "i'm sorry",
        "I\u2019m unable to do that",
        "  \n\tI cannot",
        "I can't answer",
        "I CAN\u2019T",
        "As an AI language model, ...",
        "I am unable to comply",
    ],
)
def test_default_patterns_catch_refusals(text: str) -> None:
    assert DETECTOR.is_refusal(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Sure! I am sorry to hear that.",  # a refusal is how an answer begins
        "Paris is the capital of France.",
        "As an AIrline pilot ...",
        "Icannot",
    ],
)
def test_default_patterns_pass_answers(text: str) -> None:
    assert not DETECTOR.is_refusal(text)


def test_detector_reads_only_the_head() -> None:
    late = " " * HEAD_CHARS + "I cannot"
    assert not DETECTOR.is_refusal(late)
    assert DETECTOR.is_refusal(" " * (HEAD_CHARS - 8) + "I cannot")


def test_custom_patterns_replace_the_defaults() -> None:
    detector = RefusalDetector([r"no\b", r"n[o0]pe"])
    assert detector.is_refusal("No, never")
    assert detector.is_refusal(" N0PE")
    assert not detector.is_refusal("I am sorry")
    assert not RefusalDetector([]).is_refusal("I am sorry")


@given(st.text(max_size=40))
def test_a_refusal_opening_any_text_is_one(tail: str) -> None:
    assert DETECTOR.is_refusal("I cannot" + tail)


def test_parse_patterns_reads_a_json_list() -> None:
    assert parse_refusal_patterns('["a+", "b\\\\s"]') == ("a+", "b\\s")
    assert parse_refusal_patterns("[]") == ()
    assert all(re.compile(p) for p in DEFAULT_REFUSAL_PATTERNS)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("I am sorry", "JSON list"),
        ('{"a": 1}', "JSON list of non-empty strings"),
        ('["ok", 3]', "JSON list of non-empty strings"),
        ('[""]', "JSON list of non-empty strings"),
        ('["fine", "(unclosed"]', "pattern 1 ('(unclosed') is not a valid regular"),
    ],
)
def test_parse_patterns_refuses_bad_values_clearly(raw: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_refusal_patterns(raw)

"""Tests for a model version's identity rules: names, refs, labels, URIs, configs."""

from __future__ import annotations

import pytest

from config.names import is_valid_slug, is_valid_version_label
from models_registry.domain.identity import (
    ModelRef,
    canonical_json,
    engine_config_errors,
    head_count_errors,
    is_sha256_hex,
    is_valid_model_name,
    next_version_label,
    parse_model_ref,
    sha256_text,
    uri_errors,
)

ROOTS = ["s3://models/", "file:///srv/weights/"]
DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


# is_sha256_hex / sha256_text --------------------------------------------------


def test_is_sha256_hex_accepts_64_lowercase_hex() -> None:
    assert is_sha256_hex(DIGEST)
    assert is_sha256_hex("0" * 64)


@pytest.mark.parametrize(
    "value",
    [
        DIGEST.upper(),
        DIGEST[:-1] + "A",
        DIGEST[:-1],
        DIGEST + "0",
        "",
        "g" * 64,
        " " + DIGEST[1:],
        "sha256:" + DIGEST,
    ],
)
def test_is_sha256_hex_rejects_wrong_case_length_or_characters(value: str) -> None:
    assert not is_sha256_hex(value)


def test_is_sha256_hex_rejects_trailing_newline() -> None:
    # 65 characters: the column is max_length=64 with a hex CHECK constraint.
    assert not is_sha256_hex(DIGEST + "\n")


def test_sha256_text_hashes_utf8() -> None:
    assert sha256_text("") == DIGEST
    assert is_sha256_hex(sha256_text("{{ messages }} é"))
    assert sha256_text("a") != sha256_text("b")


# model names (the shared slug rule) ------------------------------------------


@pytest.mark.parametrize(
    "name", ["chat-7b", "a", "0", "llama3.1_70b", "x" * 64, "eu-west-1"]
)
def test_is_valid_model_name_accepts_slugs(name: str) -> None:
    assert is_valid_model_name(name)
    assert is_valid_slug(name)


@pytest.mark.parametrize(
    "name",
    ["", "Chat", "chat 7b", "-chat", ".chat", "_chat", "chat@v1", "x" * 65, "chät"],
)
def test_is_valid_model_name_rejects_non_slugs(name: str) -> None:
    assert not is_valid_model_name(name)
    assert not is_valid_slug(name)


def test_is_valid_slug_rejects_trailing_newline() -> None:
    assert not is_valid_slug("chat-7b\n")


# version labels --------------------------------------------------------------


@pytest.mark.parametrize("label", ["v1", "v2", "v13", "v100", "v999999999"])
def test_is_valid_version_label_accepts_numbered_labels(label: str) -> None:
    assert is_valid_version_label(label)


@pytest.mark.parametrize(
    "label", ["", "v", "v0", "v01", "13", "V13", "v1.0", "v-1", "latest", "v1000000000"]
)
def test_is_valid_version_label_rejects_other_labels(label: str) -> None:
    assert not is_valid_version_label(label)


def test_is_valid_version_label_rejects_trailing_newline() -> None:
    assert not is_valid_version_label("v13\n")


# parse_model_ref -------------------------------------------------------------


def test_parse_model_ref_alias_has_no_version() -> None:
    assert parse_model_ref("chat-7b") == ModelRef(model="chat-7b", version=None)


def test_parse_model_ref_pinned_version() -> None:
    assert parse_model_ref("chat-7b@v13") == ModelRef(model="chat-7b", version="v13")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("chat-7b@v0", "not a valid version label"),
        ("chat-7b@13", "not a valid version label"),
        ("chat-7b@", "not a valid version label"),
        ("a@b@c", "not a valid version label"),
        ("chat-7b@v1@v2", "not a valid version label"),
        ("Chat", "not a valid model name"),
        ("", "not a valid model name"),
        ("@v1", "not a valid model name"),
        ("chat 7b@v1", "not a valid model name"),
    ],
)
def test_parse_model_ref_rejects_malformed_refs(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_ref(text)


@pytest.mark.parametrize("text", ["chat-7b\n", "chat-7b@v13\n"])
def test_parse_model_ref_rejects_trailing_newline(text: str) -> None:
    with pytest.raises(ValueError):
        parse_model_ref(text)


# next_version_label ----------------------------------------------------------


def test_next_version_label_starts_at_v1() -> None:
    assert next_version_label([]) == "v1"


def test_next_version_label_follows_the_highest() -> None:
    assert next_version_label(["v1", "v2", "v3"]) == "v4"


def test_next_version_label_never_fills_gaps() -> None:
    assert next_version_label(["v1", "v7", "v3"]) == "v8"


def test_next_version_label_compares_numerically_not_as_text() -> None:
    assert next_version_label(["v9", "v10", "v2"]) == "v11"


def test_next_version_label_ignores_foreign_labels() -> None:
    assert next_version_label(["latest", "v2", "V40", "v05", "v0", "x99"]) == "v3"
    assert next_version_label(["latest", "staging"]) == "v1"


def test_next_version_label_accepts_a_generator() -> None:
    assert next_version_label(f"v{n}" for n in (1, 2)) == "v3"


# uri_errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri",
    [
        "s3://models/chat-7b/v13/",
        "s3://models/chat-7b/weights.safetensors",
        "file:///srv/weights/chat-7b",
        "s3://models/a..b/c",
        "s3://models/...",
    ],
)
def test_uri_errors_empty_under_a_root(uri: str) -> None:
    assert uri_errors(uri, ROOTS) == []


@pytest.mark.parametrize(
    "uri", ["s3://other/chat-7b", "gs://models/chat-7b", "file:///etc/passwd"]
)
def test_uri_errors_rejects_uri_outside_roots(uri: str) -> None:
    errors = uri_errors(uri, ROOTS)
    assert len(errors) == 1
    assert errors[0].startswith("must lie under a configured storage root")
    assert "s3://models/" in errors[0]


def test_uri_errors_rejects_everything_without_roots() -> None:
    assert uri_errors("s3://models/chat-7b", []) != []


def test_uri_errors_root_is_matched_on_a_path_boundary() -> None:
    # A root written without its trailing slash must not admit a sibling bucket
    # or directory that merely shares the prefix.
    assert uri_errors("s3://models-private/secrets", ["s3://models"]) != []
    assert uri_errors("file:///srv/weights-old/x", ["file:///srv/weights"]) != []


@pytest.mark.parametrize(
    "uri",
    [
        "s3://models/../secrets",
        "s3://models/chat-7b/../../etc",
        "s3://models/chat-7b/..",
        "file:///srv/weights/../../etc/passwd",
        "s3://models/%2e%2e/secrets",
        "s3://models/%2E%2E/secrets",
        "s3://models/.%2e/secrets",
        "s3://models/chat%2f..%2fsecrets",
    ],
)
def test_uri_errors_rejects_parent_segments_even_encoded(uri: str) -> None:
    assert uri_errors(uri, ROOTS) == ["must not contain '..' segments"]


@pytest.mark.parametrize(
    "uri",
    [
        "s3://models/chat 7b",
        "s3://models/chat-7b\n",
        "s3://models/chat\t7b",
        " s3://models/chat-7b",
        "s3://models/chat\x007b",
        "s3://models/chat\x1b7b",
    ],
)
def test_uri_errors_rejects_whitespace_and_control_characters(uri: str) -> None:
    assert uri_errors(uri, ROOTS) == [
        "must not contain whitespace or control characters"
    ]


def test_uri_errors_rejects_empty() -> None:
    assert uri_errors("", ROOTS) == ["must not be empty"]


# engine_config_errors --------------------------------------------------------


@pytest.mark.parametrize(
    "config", [{}, {"max_model_len": 8192, "enable_prefix_caching": True}]
)
def test_engine_config_errors_accepts_objects_of_flags(config: object) -> None:
    assert engine_config_errors(config) == []


@pytest.mark.parametrize("config", [None, [], ["--max-model-len"], "x", 1])
def test_engine_config_errors_rejects_non_objects(config: object) -> None:
    assert engine_config_errors(config) == ["must be a JSON object of engine flags"]


@pytest.mark.parametrize("config", [{"": 1}, {1: "x"}, {"ok": 1, None: 2}])
def test_engine_config_errors_rejects_bad_keys(config: object) -> None:
    assert engine_config_errors(config) == ["keys must be non-empty strings"]


# canonical_json --------------------------------------------------------------


def test_canonical_json_sorts_keys_and_drops_spaces() -> None:
    assert canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'


def test_canonical_json_equal_for_different_key_order() -> None:
    first = {"tp": 2, "flags": {"z": True, "a": None}}
    second = {"flags": {"a": None, "z": True}, "tp": 2}
    assert canonical_json(first) == canonical_json(second)
    assert canonical_json(first) == '{"flags":{"a":null,"z":true},"tp":2}'


def test_canonical_json_differs_for_different_values() -> None:
    assert canonical_json({"tp": 2}) != canonical_json({"tp": 4})


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_config_accepts_the_engines_the_platform_runs(engine: str) -> None:
    assert engine_config_errors({"engine": engine, "max_model_len": 8192}) == []


@pytest.mark.parametrize("engine", ["tgi", "SGLang", "", None, 1, ["sglang"]])
def test_engine_config_refuses_any_other_engine(engine: object) -> None:
    """An engine the agent cannot start is refused at registration, not at the
    node (where the version would fail every replica it starts)."""
    [problem] = engine_config_errors({"engine": engine})
    assert problem.startswith("engine must be one of vllm, sglang, not ")


@pytest.mark.parametrize(
    ("gpus", "config", "is_ok"),
    [
        (8, {"num_attention_heads": 32, "num_key_value_heads": 8}, True),
        (16, {"num_attention_heads": 32, "num_key_value_heads": 8}, False),
        (3, {"num_attention_heads": 32, "num_key_value_heads": 8}, False),
        (4, {"num_attention_heads": 28}, True),  # KV heads default to heads
        (8, {"num_attention_heads": 28}, False),
        (
            2,
            {"text_config": {"num_attention_heads": 8, "num_key_value_heads": 1}},
            False,
        ),
        (4, {"architectures": ["LlamaForCausalLM"]}, True),  # nothing to check
    ],
)
def test_head_count_errors_needs_gpus_to_divide_both_head_counts(
    gpus: int, config: dict[str, object], is_ok: bool
) -> None:
    assert (head_count_errors(gpus, config) == []) is is_ok


def test_head_count_errors_refuses_a_config_with_nonsense_heads() -> None:
    (why,) = head_count_errors(1, {"num_attention_heads": "32"})
    assert "num_attention_heads" in why

"""A model version's identity: what must never change once a version is registered.

Public surface: ``Precision``, ``VersionStatus``, ``IDENTITY_FIELDS``, ``ModelRef``,
``is_sha256_hex``, ``sha256_text``, ``parse_model_ref``, ``is_valid_model_name``,
``is_valid_version_label``, ``next_version_label``, ``uri_errors``,
``engine_config_errors``, ``head_count_errors``, ``ENGINES``, ``DEFAULT_ENGINE``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from accounts.domain.keys import SHA256_PATTERN
from config.names import is_valid_slug, is_valid_version_label

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "IDENTITY_FIELDS",
    "SHA256_PATTERN",
    "ModelRef",
    "Precision",
    "VersionStatus",
    "canonical_json",
    "engine_config_errors",
    "head_count_errors",
    "is_sha256_hex",
    "is_valid_model_name",
    "next_version_label",
    "parse_model_ref",
    "sha256_text",
    "uri_errors",
]

# The inference engines a version may run on (``engine_config["engine"]``).
ENGINES: tuple[str, ...] = ("vllm", "sglang")
DEFAULT_ENGINE = "vllm"

# The fields whose change would make a different version. A new chat template,
# precision or engine flag is a new version and goes through a full rollout.
IDENTITY_FIELDS: tuple[str, ...] = (
    "model_id",
    "version",
    "weights_uri",
    "weights_hash",
    "tokenizer_hash",
    "chat_template",
    "chat_template_hash",
    "precision",
    "gpus_per_replica",
    "engine_config",
)

MAX_GPUS_PER_REPLICA = 64
_SHA256 = re.compile(SHA256_PATTERN)


class Precision(enum.StrEnum):
    """How a version's weights are stored; quantized weights do not shrink the KV cache."""

    FP16 = "fp16"
    INT8 = "int8"
    BIT4 = "4bit"


class VersionStatus(enum.StrEnum):
    """Where a version is in its life (seed: register, gate, roll out, serve, retire).

    ``registered -> evaluating -> load_testing -> ready`` as its gates pass
    (``models_registry.domain.gates``), or ``rejected`` with the reason.
    """

    REGISTERED = "registered"
    EVALUATING = "evaluating"
    LOAD_TESTING = "load_testing"
    READY = "ready"
    REJECTED = "rejected"
    LIVE = "live"
    RETIRED = "retired"


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A model name as a client writes it: ``chat-7b`` (the alias) or ``chat-7b@v13``."""

    model: str
    version: str | None


def is_sha256_hex(value: str) -> bool:
    """Return True for exactly 64 lowercase hex characters."""
    return _SHA256.fullmatch(value) is not None


def sha256_text(text: str) -> str:
    """Return the hex SHA-256 of ``text`` as UTF-8 (used for chat templates)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def canonical_json(value: object) -> str:
    """Return ``value`` as JSON with sorted keys, so equal configs compare equal."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def is_valid_model_name(name: str) -> bool:
    """Return True for a lowercase name of letters, digits, '.', '-' and '_' (no '@')."""
    return is_valid_slug(name)


def parse_model_ref(text: str) -> ModelRef:
    """Split ``chat-7b@v13`` into its model and pinned version.

    Raises:
        ValueError: the name or the version label is malformed.
    """
    model, sep, version = text.partition("@")
    if not is_valid_model_name(model):
        raise ValueError(f"{model!r} is not a valid model name")
    if not sep:
        return ModelRef(model=model, version=None)
    if not is_valid_version_label(version):
        raise ValueError(f"{version!r} is not a valid version label (v1, v2, ...)")
    return ModelRef(model=model, version=version)


def next_version_label(existing: Iterable[str]) -> str:
    """Return the label after the highest existing one: versions are never renumbered.

    Raises:
        ValueError: the next number would not fit a label (after v999999999).
    """
    numbers = [int(label[1:]) for label in existing if is_valid_version_label(label)]
    label = f"v{max(numbers, default=0) + 1}"
    if not is_valid_version_label(label):
        raise ValueError("no version labels left")
    return label


def uri_errors(uri: str, roots: Sequence[str]) -> list[str]:
    """Return why ``uri`` may not be used; empty when it lies under a configured root.

    A URI must start with one of ``roots`` and must not climb out of it with
    ``..`` segments (also when percent-encoded). A query or fragment (``?``,
    ``#``) or a backslash is refused: a URL parser stops the path there, while
    fsspec opens the whole string as a path, so ``root/x#/../../etc`` would pass
    a check of the parsed path and climb out of the root when opened.
    """
    if not uri:
        return ["must not be empty"]
    if any(ch.isspace() or ord(ch) < 32 for ch in uri):
        return ["must not contain whitespace or control characters"]
    if any(ch in uri for ch in "?#\\"):
        return ["must not contain '?', '#' or '\\'"]
    path = unquote(urlsplit(uri).path)
    if any(segment == ".." for segment in path.split("/")):
        return ["must not contain '..' segments"]
    # Roots are matched on a path boundary: "s3://models" must not admit
    # "s3://models-private/...".
    if not any(
        uri.startswith(root if root.endswith("/") else f"{root}/") for root in roots
    ):
        return [f"must lie under a configured storage root ({', '.join(roots)})"]
    return []


def engine_config_errors(config: object) -> list[str]:
    """Return why an engine config is unusable: it must be a JSON object of flags,
    and its ``engine``, when set, one of ``ENGINES`` (the engine is part of the
    version, so changing it is a full rollout)."""
    if not isinstance(config, dict):
        return ["must be a JSON object of engine flags"]
    for key in config:
        if not isinstance(key, str) or not key:
            return ["keys must be non-empty strings"]
    engine = config.get("engine", DEFAULT_ENGINE)
    if not isinstance(engine, str) or engine not in ENGINES:
        return [f"engine must be one of {', '.join(ENGINES)}, not {engine!r}"]
    return []


def _head_count(config: dict[str, object], name: str) -> int | None:
    value = config.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} {value!r} is not a positive whole number")
    return value


def head_count_errors(gpus_per_replica: int, config: object) -> list[str]:
    """Return why ``gpus_per_replica`` cannot split the model's attention heads.

    ``config`` is the model's ``config.json`` (Hugging Face's). Tensor parallelism
    gives each GPU a whole share of the attention heads and of the KV heads (vLLM
    refuses to start otherwise), so ``gpus_per_replica`` must divide both.
    ``num_key_value_heads`` defaults to ``num_attention_heads`` (no grouped-query
    attention); a config with neither (also under ``text_config``, as multimodal
    models nest it) is not checked. Empty when the split works.
    """
    if not isinstance(config, dict):
        return ["config.json must be a JSON object"]
    text = config.get("text_config")
    if "num_attention_heads" not in config and isinstance(text, dict):
        config = text
    try:
        heads = _head_count(config, "num_attention_heads")
        kv_heads = _head_count(config, "num_key_value_heads")
    except ValueError as exc:
        return [f"config.json: {exc}"]
    if heads is None:
        return []
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % gpus_per_replica or kv_heads % gpus_per_replica:
        return [
            f"gpus_per_replica {gpus_per_replica} must divide the model's "
            f"attention heads ({heads}) and KV heads ({kv_heads}), as config.json "
            "gives them: each GPU takes a whole share of both"
        ]
    return []

"""Turn the model a client named into the version that serves it, canary and shadow.

Public surface: ``Resolution``, ``resolve``, ``ResolveError``, ``UnknownModel``,
``UnknownVersion``, ``NoLiveVersion``.

Invariants:

- ``chat-7b@v13`` pins v13: no canary split and never a shadow copy.
- ``chat-7b`` (the alias) serves the live version, except that a conversation
  whose ``stable_fraction(routing_key, salt="canary:" + model) * 100`` is below
  ``canary_percent`` gets the canary version. The fraction depends only on the
  key, so a chat never changes version halfway, and raising the percent only ever
  moves conversations onto the canary (never back).
- A shadow copy is sampled per request: ``request_fraction * 100 <
  shadow_percent``, where ``request_fraction`` is a uniform draw in [0, 1) made by
  the caller (so this module stays deterministic).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from models_registry.domain.identity import parse_model_ref
from routing.domain.routing_key import stable_fraction
from routing.domain.snapshot import ModelRecord

__all__ = [
    "NoLiveVersion",
    "Resolution",
    "ResolveError",
    "UnknownModel",
    "UnknownVersion",
    "resolve",
]


class ResolveError(Exception):
    """The requested model cannot be served; ``param`` names the request field."""

    def __init__(self, message: str, *, param: str = "model") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class UnknownModel(ResolveError):
    """No such model, or the name is malformed (the API answers 404)."""


class UnknownVersion(ResolveError):
    """A pinned version is not registered for the model (the API answers 404)."""


class NoLiveVersion(ResolveError):
    """The model exists but its alias points at no version yet (the API answers 503)."""


@dataclass(frozen=True, slots=True)
class Resolution:
    """The version one request is served by.

    ``is_canary`` is True only when the canary split chose the version (a request
    pinned to the canary's label is pinned, not canary). ``shadow_version`` is the
    version to copy the request to, output discarded, or None.
    """

    model: str
    version: str
    is_pinned: bool
    is_canary: bool
    shadow_version: str | None


def resolve(
    model_ref: str,
    models: Mapping[str, ModelRecord],
    versions: Collection[tuple[str, str]],
    routing_key: str,
    request_fraction: float,
) -> Resolution:
    """Return the version serving ``model_ref`` for this conversation and request.

    Args:
        model_ref: ``chat-7b`` or ``chat-7b@v13`` as the client wrote it.
        models: model name to record (``ConfigSnapshot.models``).
        versions: the (model, version) pairs that may be pinned
            (``ConfigSnapshot.versions`` works as is).
        routing_key: the conversation's key (``routing_key()``), for the canary split.
        request_fraction: a fresh uniform draw in [0, 1), for shadow sampling.

    Raises:
        UnknownModel: the name is malformed or not in ``models``.
        UnknownVersion: a pinned version is not in ``versions``.
        NoLiveVersion: the alias is used and the model has no live version.
    """
    try:
        ref = parse_model_ref(model_ref)
    except ValueError as exc:
        raise UnknownModel(f"The model {model_ref!r} does not exist: {exc}") from None
    record = models.get(ref.model)
    if record is None:
        raise UnknownModel(f"The model {ref.model!r} does not exist")

    if ref.version is not None:
        if (ref.model, ref.version) not in versions:
            raise UnknownVersion(
                f"The model {ref.model!r} has no version {ref.version!r}"
            )
        return Resolution(
            model=ref.model,
            version=ref.version,
            is_pinned=True,
            is_canary=False,
            shadow_version=None,
        )

    if record.live_version is None:
        raise NoLiveVersion(f"The model {ref.model!r} has no live version yet")
    version = record.live_version
    is_canary = False
    canary = record.canary_version
    if (
        canary is not None
        and canary != version
        and record.canary_percent > 0
        and stable_fraction(routing_key, salt="canary:" + ref.model) * 100
        < record.canary_percent
    ):
        version, is_canary = canary, True

    shadow = record.shadow_version
    if (
        shadow is None
        or shadow == version
        or not (request_fraction * 100 < record.shadow_percent)
    ):
        shadow = None
    return Resolution(
        model=ref.model,
        version=version,
        is_pinned=False,
        is_canary=is_canary,
        shadow_version=shadow,
    )

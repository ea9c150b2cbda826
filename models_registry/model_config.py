"""Read a model's ``config.json`` next to its weights, where they are local.

Public surface: ``read_model_config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote, urlsplit

from config.errors import InvalidRequest

__all__ = ["read_model_config"]


def read_model_config(weights_uri: str) -> object:
    """Return the ``config.json`` beside weights on this machine, or ``{}``.

    Only ``file://`` weights (already checked to lie under a storage root) are
    read: object stores are not fetched at registration, so their head counts
    go unchecked (docs/platform-admins.md). A missing config.json is not checked
    either; one that is no JSON is refused, naming the weights.
    """
    parts = urlsplit(weights_uri)
    if parts.scheme != "file" or parts.netloc not in {"", "localhost"}:
        return {}
    path = Path(unquote(parts.path)) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(
            f"weights_uri's config.json cannot be read: {type(exc).__name__}",
            param="weights_uri",
        ) from None

"""The simulated replica's Responses store (vLLM's with
``VLLM_ENABLE_RESPONSES_API_STORE=1``).

Public surface: ``ResponseStore``.

vLLM keeps every stored response and its input messages in memory, unbounded; the
simulator keeps the newest ``capacity`` of them, so a long benchmark cannot grow a
replica without limit. A later request's ``previous_response_id`` continues the
conversation as vLLM's ``construct_input_messages`` does: the earlier messages
without their system ones (instructions do not carry over), then the text of the
earlier output's messages as assistant turns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

__all__ = ["ResponseStore"]


class ResponseStore:
    """Stored responses by id, with the chat messages each was answered from."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = (
            OrderedDict()
        )

    def keep(self, messages: list[dict[str, Any]], response: Mapping[str, Any]) -> None:
        """Store ``response`` (under its id) and the messages it answered."""
        self._kept[str(response["id"])] = (messages, dict(response))
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def response(self, response_id: str) -> dict[str, Any] | None:
        """Return a stored response object, or None."""
        kept = self._kept.get(response_id)
        return kept[1] if kept is not None else None

    def history(self, response_id: str) -> list[dict[str, Any]] | None:
        """Return the conversation a follow-up of ``response_id`` continues
        (None: not stored)."""
        kept = self._kept.get(response_id)
        if kept is None:
            return None
        messages, response = kept
        history = [m for m in messages if m.get("role") != "system"]
        for item in response.get("output") or ():
            if item.get("type") != "message":
                continue
            history.extend(
                {"role": "assistant", "content": part.get("text", "")}
                for part in item.get("content") or ()
            )
        return history

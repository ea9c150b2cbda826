"""Turn a Responses API request's input into the chat messages and tools the
stand-in chat template renders (gateway and replica count the same prompt).

Public surface: ``to_chat_messages``, ``to_chat_tools``, ``count_response_tokens``.

As vLLM's ``responses/utils.py`` ``construct_input_messages``: ``instructions``
first as a system message; a string input is one user message; message items
keep their role (``developer`` included) and their text parts
(``input_text``/``output_text``) joined; a ``function_call`` item becomes an
assistant message with that tool call, a ``function_call_output`` a ``tool``
message with the output. Flat function tools (``{"type": "function", "name",
"parameters"}``) become chat tools (``{"type": "function", "function": {...}}``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from simengine.domain.tokens import count_chat_tokens

__all__ = ["count_response_tokens", "to_chat_messages", "to_chat_tools"]

_TEXT_PARTS = ("input_text", "output_text", "text")


def _item_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS
        )
    return ""


def to_chat_messages(instructions: Any, input_value: Any) -> list[dict[str, Any]]:
    """Return the chat messages of a Responses request's ``instructions`` and
    ``input``; raise ``ValueError`` on an item it cannot read."""
    messages: list[dict[str, Any]] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input_value, str):
        messages.append({"role": "user", "content": input_value})
        return messages
    if not isinstance(input_value, list):
        raise ValueError("input must be a string or a list of items")
    for item in input_value:
        if not isinstance(item, Mapping):
            raise ValueError("each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(
                {
                    "role": str(item.get("role", "user")),
                    "content": _item_text(item.get("content")),
                }
            )
        elif kind == "function_call":
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": item.get("call_id"),
                            "type": "function",
                            "function": {
                                "name": item.get("name"),
                                "arguments": item.get("arguments", ""),
                            },
                        }
                    ],
                }
            )
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "content": output
                    if isinstance(output, str)
                    else _item_text(output),
                    "tool_call_id": item.get("call_id"),
                }
            )
        else:
            raise ValueError(f"input items of type {kind!r} are not supported")
    return messages


def to_chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Return the chat form of a Responses request's function tools (None: no
    tools); other tool types are left out, as the model cannot call them here."""
    if not isinstance(tools, list) or not tools:
        return None
    chat_tools = []
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            continue
        function = {
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
        }
        chat_tools.append({"type": "function", "function": function})
    return chat_tools or None


def count_response_tokens(
    instructions: Any, input_value: Any, tools: Sequence[Any] | None = None
) -> int:
    """Return the prompt tokens of a Responses request (its ``input_tokens``)."""
    return count_chat_tokens(
        to_chat_messages(instructions, input_value), to_chat_tools(tools)
    )

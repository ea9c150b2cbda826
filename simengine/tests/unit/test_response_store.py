"""The Responses store: what a follow-up continues, and its bound."""

from __future__ import annotations

from simengine.response_store import ResponseStore


def test_response_store_continues_without_system_messages_and_forgets_oldest() -> None:
    store = ResponseStore(capacity=2)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    output = [
        {"type": "message", "content": [{"type": "output_text", "text": "hello"}]},
        {"type": "function_call", "name": "f", "arguments": "{}"},
    ]
    store.keep(messages, {"id": "resp_1", "output": output})
    assert store.history("resp_1") == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    store.keep([], {"id": "resp_2", "output": []})
    store.keep([], {"id": "resp_3", "output": []})
    assert store.response("resp_1") is None
    assert store.response("resp_3") == {"id": "resp_3", "output": []}

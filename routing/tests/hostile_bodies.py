"""The issue's probes of /v1/chat/completions, sent in process and to real processes.

Public surface: ``HOSTILE`` (name, raw body, the param the 400 must name).

Item 3's bodies each got a plain-text 500 (TypeError, UnicodeEncodeError,
RecursionError, ValueError); item 8's were each answered 200.
"""

from __future__ import annotations

__all__ = ["HOSTILE"]

CHAT = '"model":"chat-7b","max_tokens":3'
USER = '"messages":[{"role":"user","content":"x"}]'

# The probes (item 3: each was a plain-text 500; item 8: each a 200).
HOSTILE = [
    ("role-list", f'{{{CHAT},"messages":[{{"role":["user"],"content":"x"}}]}}', "messages.0.role"),
    ("role-object", f'{{{CHAT},"messages":[{{"role":{{"a":1}},"content":"x"}}]}}', "messages.0.role"),
    ("lone-surrogate", f'{{{CHAT},"messages":[{{"role":"user","content":"\\ud800"}}]}}', "messages.0.content"),
    ("nested-1000", f'{{{CHAT},{USER},"metadata":{"[" * 1000}{"]" * 1000}}}', "metadata"),
    ("int-4301-digits", f'{{{CHAT},{USER},"seed":{"1" * 4301}}}', "seed"),
    ("tools-string", f'{{{CHAT},{USER},"tools":"nope"}}', "tools"),
    ("tools-no-function", f'{{{CHAT},{USER},"tools":[{{"type":"function"}}]}}', "tools.0.function"),
    ("tool-choice", f'{{{CHAT},{USER},"tool_choice":"maybe"}}', "tool_choice"),
    ("logprobs", f'{{{CHAT},{USER},"logprobs":"yes"}}', "logprobs"),
    ("top-logprobs", f'{{{CHAT},{USER},"logprobs":true,"top_logprobs":50}}', "top_logprobs"),
    ("response-format", f'{{{CHAT},{USER},"response_format":{{"type":"xml"}}}}', "response_format.type"),
    ("presence-penalty", f'{{{CHAT},{USER},"presence_penalty":5}}', "presence_penalty"),
    ("frequency-penalty", f'{{{CHAT},{USER},"frequency_penalty":"high"}}', "frequency_penalty"),
    ("part-not-object", f'{{{CHAT},"messages":[{{"role":"user","content":[1,"x"]}}]}}', "messages.0.content.0"),
    ("part-without-type", f'{{{CHAT},"messages":[{{"role":"user","content":[{{"text":"x"}}]}}]}}', "messages.0.content.0.type"),
    ("n-float", f'{{{CHAT},{USER},"n":1.0}}', "n"),
    ("n-bool", f'{{{CHAT},{USER},"n":true}}', "n"),
]  # fmt: skip

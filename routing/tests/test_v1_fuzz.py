"""Property: whatever body a client sends to /v1, the gateway never answers 5xx.

Bodies are drawn by hypothesis (derandomized: the same examples on every run,
bounded in number): mostly OpenAI chat bodies with some fields replaced by
arbitrary JSON, the issue's hostile shapes (lone surrogates, deep nesting, long
integers, NaN), and raw bytes; Responses bodies the same way. Every answer must be
below 500; every refusal in OpenAI's shape, ``{"error": {"type", "message",
"param", "code"}}``; every 200 a whole answer or a stream ending in ``[DONE]``
(``response.completed`` for a response) without an error event.

Two gateways take them: one in this process (``embedded_gateway``, many examples
fast, in front of a real simulated replica process), and a real gateway process
of a live platform (fewer examples, over HTTP).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from localrun.processes import sim_replica
from routing.tests.embedded_gateway import MODEL, Answer, EmbeddedGateway

if TYPE_CHECKING:
    from tests.live import LivePlatform

# Answers are short: the property is about the gateway, not the engine's speed.
FAST_ENGINE = (
    *("--sim-a-ms", "0.05", "--sim-b-ms", "0.001", "--sim-ctok-ms", "0.001"),
    *("--sim-w-ms", "0.001", "--sim-kkv-us", "0.001", "--sim-frontend-ms", "0"),
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
# Values that are nearly right: what a careless client sends.
near_misses = st.sampled_from(
    [1.0, True, 2, 0, -1, "1", "", [], {}, [1, "x"], {"type": "xml"}, "auto"]
)
text_part = st.fixed_dictionaries(
    {"type": st.just("text"), "text": st.text(max_size=20)}
)
valid_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": st.text(max_size=40)
            | st.lists(text_part, min_size=1, max_size=2),
        }
    ),
    min_size=1,
    max_size=3,
)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(min_value=1, max_value=6),
    "max_completion_tokens": st.integers(min_value=1, max_value=6),
    "stream": st.booleans(),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0, max_value=1),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "n": st.just(1),
    "seed": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=4),
    "logprobs": st.booleans(),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}},
        ]
    ),
    "logit_bias": st.dictionaries(
        st.from_regex(r"[0-9]{1,5}", fullmatch=True),
        st.integers(min_value=-100, max_value=100),
        max_size=2,
    ),
    "user": st.text(max_size=8),
    "ignore_eos": st.booleans(),
    "metadata": json_values,
}
# Fields that are refused whatever their value here (tools), or only valid with
# another one (top_logprobs, stream_options): drawn only as the field gone wrong.
WRONG_ONLY = [
    "model",
    "messages",
    "tools",
    "tool_choice",
    "functions",
    "parallel_tool_calls",
    "top_logprobs",
    "stream_options",
]


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid chat body, or one with a field or a message part gone wrong."""
    body: dict[str, Any] = {
        "model": draw(st.sampled_from([MODEL, f"{MODEL}@v1"])),
        "messages": draw(valid_messages),
    }
    for name in draw(st.sets(st.sampled_from(sorted(VALID)), max_size=5)):
        body[name] = draw(VALID[name])
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if body.get("logprobs") and draw(st.booleans()):
        body["top_logprobs"] = draw(st.integers(min_value=0, max_value=20))
    wrong = draw(st.sampled_from(["none", "none", "field", "message"]))
    if wrong == "field":
        name = draw(st.sampled_from(sorted(VALID) + WRONG_ONLY))
        body[name] = draw(json_values | near_misses)
    elif wrong == "message":
        message = dict(draw(st.sampled_from(body["messages"])))
        key = draw(st.sampled_from(["role", "content", "name", "tool_call_id"]))
        message[key] = draw(
            json_values | near_misses | st.lists(json_values, min_size=1, max_size=2)
        )
        body["messages"] = [*body["messages"], message]
    return body


tokenize_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={
        "prompt": st.text(max_size=30) | json_values,
        "messages": valid_messages | json_values,
        "add_special_tokens": st.booleans() | json_values,
    },
)


input_items = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user"]),
            "content": st.text(max_size=40)
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.just("input_text"), "text": st.text(max_size=20)}
                ),
                min_size=1,
                max_size=2,
            ),
        }
    ),
    min_size=1,
    max_size=3,
)
RESPONSES_VALID: dict[str, st.SearchStrategy[Any]] = {
    "instructions": st.text(max_size=20),
    "max_output_tokens": st.integers(min_value=1, max_value=6),
    "stream": st.booleans(),
    "store": st.just(False),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0, max_value=1),
    "text": st.sampled_from(
        [
            {"format": {"type": "text"}},
            {"format": {"type": "json_object"}},
            {"format": {"type": "json_schema", "name": "a", "schema": {}}},
        ]
    ),
    "user": st.text(max_size=8),
    "metadata": st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=2),
}
RESPONSES_WRONG_ONLY = [
    "model",
    "input",
    "tools",
    "tool_choice",
    "previous_response_id",
    "include",
    "background",
    "extra",
]


@st.composite
def responses_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid Responses body, or one with a field gone wrong."""
    body: dict[str, Any] = {
        "model": draw(st.sampled_from([MODEL, f"{MODEL}@v1"])),
        "input": draw(st.text(max_size=40) | input_items),
    }
    for name in draw(st.sets(st.sampled_from(sorted(RESPONSES_VALID)), max_size=5)):
        body[name] = draw(RESPONSES_VALID[name])
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(RESPONSES_VALID) + RESPONSES_WRONG_ONLY))
        body[name] = draw(json_values | near_misses)
    return body


def hostile_text(body: dict[str, Any]) -> st.SearchStrategy[str]:
    """The body as JSON text, with one of the issue's hostile values spliced in."""
    text = json.dumps(body)
    splices = st.sampled_from(
        [
            '"\\ud800"',
            '"ok\\udfff"',
            "[" * 1000 + "]" * 1000,
            "[" * 70 + "]" * 70,
            "1" * 4301,
            "NaN",
            "-Infinity",
            "1e999",
        ]
    )
    return splices.map(lambda value: text[:-1] + f', "extra": {value}}}')


def as_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


requests = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), chat_bodies().map(as_bytes)),
    st.tuples(st.just("/v1/chat/completions"), chat_bodies().map(as_bytes)),
    st.tuples(
        st.just("/v1/chat/completions"),
        chat_bodies().flatmap(hostile_text).map(str.encode),
    ),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/tokenize"]), st.binary()),
    st.tuples(st.just("/tokenize"), tokenize_bodies.map(as_bytes)),
    st.tuples(st.just("/v1/responses"), responses_bodies().map(as_bytes)),
    st.tuples(
        st.just("/v1/responses"),
        responses_bodies().flatmap(hostile_text).map(str.encode),
    ),
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "x-priority": st.sampled_from(["interactive", "standard", "batch", "urgent"]),
        "x-conversation-id": st.text(
            st.characters(min_codepoint=33, max_codepoint=126), max_size=10
        ),
    },
)


def check(path: str, status: int, content_type: str, body: bytes) -> None:
    """The property: below 500, and in OpenAI's shape."""
    event(f"HTTP {status}")  # shown by --hypothesis-show-statistics
    assert status < 500, body[:500]
    if status != 200:
        assert content_type == "application/json", body[:500]
        document = json.loads(body)
        assert set(document) == {"error"}, document
        error = document["error"]
        assert set(error) == {"type", "message", "param", "code"}, error
        assert isinstance(error["type"], str) and error["type"], error
        assert isinstance(error["message"], str) and error["message"], error
        assert error["param"] is None or isinstance(error["param"], str), error
        assert error["code"] is None or isinstance(error["code"], str), error
    elif content_type.startswith("text/event-stream"):
        events = [e for e in body.decode().split("\n\n") if e]
        if path == "/v1/responses":
            assert events[-1].startswith("event: response.completed\n"), events[-3:]
            assert not any(e.startswith("event: error") for e in events), events
            return
        assert events[-1] == "data: [DONE]", events[-3:]
        assert not any(e.startswith('data: {"error"') for e in events), events
    else:
        answer = json.loads(body)
        if path == "/v1/responses":
            assert answer["object"] == "response", answer
        elif path == "/tokenize":
            assert answer["count"] == len(answer["tokens"]), answer
        else:
            assert answer["choices"], answer


FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedGateway]:
    with (
        sim_replica(tmp_path_factory.mktemp("sim"), *FAST_ENGINE, model=MODEL) as sim,
        EmbeddedGateway(sim.url, default_max_tokens=6) as gateway,
    ):
        yield gateway


@settings(FUZZ, max_examples=400)
@given(request=requests, extra_headers=headers)
def test_v1_bodies_never_get_a_5xx_in_process(
    embedded: EmbeddedGateway,
    request: tuple[str, bytes],
    extra_headers: dict[str, str],
) -> None:
    path, body = request
    answer: Answer = embedded.request(path, body, headers=extra_headers)
    check(path, answer.status, answer.headers.get("content-type", ""), answer.body)


@pytest.fixture(scope="module")
def client(shared_platform: LivePlatform) -> Iterator[httpx.Client]:
    """A client of the shared platform (conftest.py), whose gateway ends an answer
    after 6 tokens where the body names no max_tokens."""
    with httpx.Client(
        base_url=shared_platform.url,
        headers={"Authorization": f"Bearer {shared_platform.keys['alpha']}"},
        timeout=30,
    ) as http:
        yield http


@pytest.mark.e2e
@pytest.mark.slow
@settings(FUZZ, max_examples=60)
@given(request=requests, extra_headers=headers)
def test_v1_bodies_never_get_a_5xx_from_a_gateway_process(
    client: httpx.Client, request: tuple[str, bytes], extra_headers: dict[str, str]
) -> None:
    path, body = request
    response = client.post(path, content=body, headers=extra_headers)
    check(
        path,
        response.status_code,
        response.headers.get("content-type", ""),
        response.content,
    )

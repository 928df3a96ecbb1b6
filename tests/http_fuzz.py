"""Hypothesis strategies for HTTP requests to the gateway, and the check every response must pass.

Shared by tests/router/test_fuzz_http.py (fake nodes) and tests/e2e/test_gateway_security.py
(a real cluster). A request is a `FuzzRequest` (method, path, headers, raw body bytes); the
strategies cover raw bytes (invalid UTF-8 included), recursive JSON documents, OpenAI bodies
with wrong types, absurd values and unknown fields, deep nesting and unicode edge cases.
`check_response` is the oracle: never a 5xx, and every 4xx carries the OpenAI error body.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
KNOWN_PATHS = [COMPLETIONS, CHAT, RESPONSES, "/v1/models", "/health", "/metrics"]
ODD_PATHS = [
    "/",
    "/v1",
    "/v1/completions/",
    "/v1/embeddings",
    "/docs",
    "/openapi.json",
    "/health/",
    "/v1//completions",
    "/%00",
    "/..%2f..%2fetc/passwd",
]
METHODS = ["POST"] * 4 + ["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]

# Characters that break naive code: NUL, BOM, bidi override, lone surrogates, noncharacters,
# a combining mark, astral emoji, a special token of the tiny model's tokenizer.
EDGE_CHARS = ["\x00", "\ufeff", "\u202e", "\ud800", "\udfff", "\uffff", "\u0301", "🚀", "\n"]
EDGE_STRINGS = [
    "",
    " ",
    "<|endoftext|>",
    "<｜begin▁of▁sentence｜>",
    "a" * 100_000,
    "日本語" * 999,
    "\ud83d",
    "\ud83d\ude80",
    "null",
    "{}",
    "\\u0000",
]

text_chars = st.one_of(st.characters(exclude_categories=()), st.sampled_from(EDGE_CHARS))
texts = st.one_of(st.text(text_chars, max_size=40), st.sampled_from(EDGE_STRINGS))
huge_ints = st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400, -(10**400)])
ints = st.one_of(st.integers(-(2**70), 2**70), huge_ints)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 5e-324, -0.0, 1e-308]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(texts, inner, max_size=6)),
    max_leaves=24,
)


@dataclass
class FuzzRequest:
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, bytes] = field(default_factory=dict)

    def __repr__(self) -> str:  # bodies can be megabytes: show their start
        body = self.body if len(self.body) <= 300 else self.body[:300] + b"..."
        return f"FuzzRequest({self.method} {self.path[:200]!r}, {body!r}, {self.headers!r})"

    def send(self, client: httpx.Client) -> httpx.Response:
        return client.request(self.method, self.path, content=self.body, headers=self.headers)


def encode_json(value, ensure_ascii: bool) -> bytes:
    """JSON text of `value` as bytes: NaN/Infinity written as Python does; a lone surrogate is
    either a \\uXXXX escape (ensure_ascii) or its raw, invalid UTF-8 encoding."""
    text = json.dumps(value, ensure_ascii=ensure_ascii, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


# ---- headers -----------------------------------------------------------------------------------
# Bytes h11 allows in a header value (no CR, LF or NUL; obs-text is allowed).
_header_bytes = st.binary(max_size=60).map(
    lambda b: bytes(c for c in b if c == 9 or 32 <= c < 127 or c >= 128).strip()
)


def auth_headers(good_keys: list[str]):
    """Authorization values: mostly a right key (so bodies reach the parser), else none, a
    wrong key, another scheme, an empty token, or raw bytes."""
    right = st.sampled_from([f"Bearer {k}".encode() for k in good_keys] or [None])
    odd = st.sampled_from(
        [
            None,
            b"Bearer wrong-key",
            b"bearer " + (good_keys[0].encode() if good_keys else b"x"),
            b"Basic dXNlcjpwYXNz",
            b"Bearer",
            b"Bearer \xff\xfe",
        ]
    )
    random = _header_bytes.map(lambda b: b"Bearer " + b)
    return st.integers(0, 9).flatmap(lambda i: right if i < 8 else (odd if i == 8 else random))


def headers(good_keys: list[str]):
    content_types = st.sampled_from(
        [
            None,
            b"application/json",
            b"text/plain",
            b"application/x-www-form-urlencoded",
            b"application/json; charset=utf-16",
            b"multipart/form-data; boundary=x",
        ]
    )

    def build(auth, ctype, extra):
        # h11 refuses values with leading or trailing whitespace: send them stripped.
        values = {"authorization": auth, "content-type": ctype, "x-fuzz": extra}
        return {k: v.strip() for k, v in values.items() if v is not None and v.strip()}

    return st.builds(build, auth_headers(good_keys), content_types, _header_bytes)


# ---- paths and raw requests --------------------------------------------------------------------
random_paths = st.text(text_chars, max_size=30).map(
    lambda t: "/" + urllib.parse.quote(t.encode("utf-8", "surrogatepass"), safe="/")
)
paths = st.one_of(st.sampled_from(KNOWN_PATHS * 3 + ODD_PATHS), random_paths)
queries = st.one_of(
    st.just(""),
    st.text(text_chars, max_size=20).map(
        lambda t: "?" + urllib.parse.quote(t.encode("utf-8", "surrogatepass"), safe="=&")
    ),
)

invalid_utf8 = st.sampled_from(
    [
        b"\xff",
        b"\xc3\x28",
        b"\xe2\x82",
        b"\xed\xa0\x80",
        b"\xf4\x90\x80\x80",
        b"\xc0\xaf",
        b"\xfe\xff\x00{",
        b"\xef\xbb\xbf{}",
    ]
)
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda a, b, c: a + b + c, st.binary(max_size=20), invalid_utf8, st.binary(max_size=20)
    ),
    st.sampled_from(
        [
            b"",
            b"{",
            b"}",
            b"[]",
            b"null",
            b"0",
            b'"x"',
            b"{}",
            b'{"prompt":}',
            b'{"prompt": "x"}{}',
            b"NaN",
            b'{"prompt": "x", "max_tokens": 1e999}',
            b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        ]
    ),
)


def raw_requests(good_keys: list[str]):
    return st.builds(
        lambda m, p, q, b, h: FuzzRequest(m, p + q, b, h),
        st.sampled_from(METHODS),
        paths,
        queries,
        raw_bodies,
        headers(good_keys),
    )


def json_document_requests(good_keys: list[str]):
    """Any JSON document (objects most often) to a completion endpoint."""
    documents = st.one_of(st.dictionaries(texts, json_values, max_size=8), json_values)
    return st.builds(
        lambda p, d, a, h: FuzzRequest("POST", p, encode_json(d, a), h),
        st.sampled_from([COMPLETIONS, CHAT]),
        documents,
        st.booleans(),
        headers(good_keys),
    )


# ---- OpenAI bodies -----------------------------------------------------------------------------
def _nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


BIG_STOP = ["s"] * 100_000  # 10^5 stop strings
BIG_BIAS = {str(i): 100.0 for i in range(50_000)}
messages_good = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}
    ),
    min_size=1,
    max_size=3,
)
SCHEMA_KEYS = ["type", "properties", "required", "items", "enum", "$ref", "pattern", "anyOf"]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS},
}
FLAT_WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
NAMED_CHOICE = {"type": "function", "function": {"name": "get_weather"}}
RESPONSES_LOOP = [
    {"role": "user", "content": "Weather?"},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
]
# Per field: (good values, absurd values of the right type).
FIELDS = {
    "model": (st.sampled_from(["tiny-model"]), texts),
    "max_tokens": (st.integers(1, 8), st.one_of(ints, st.sampled_from([0, -1, 10**6]))),
    "max_completion_tokens": (st.integers(1, 8), ints),
    "temperature": (st.floats(0, 2), floats),
    "top_p": (st.floats(0.01, 1), st.sampled_from([-1.0, 0.0, 1.0000001, 2.0, 1e308])),
    "top_k": (st.integers(-1, 50), ints),
    "seed": (st.integers(0, 2**32), st.sampled_from([-1, 2**63, 2**64, 10**30, 2**200])),
    "stop": (
        st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1), max_size=4)),
        st.one_of(st.just(BIG_STOP), st.just(""), st.lists(texts, max_size=10)),
    ),
    "n": (st.sampled_from([1, 1, 2]), st.sampled_from([0, -1, 17, 10**9, 2**64])),
    "stream": (st.booleans(), st.booleans()),
    "stream_options": (
        st.fixed_dictionaries({"include_usage": st.booleans()}),
        st.dictionaries(texts, json_values, max_size=3),
    ),
    "presence_penalty": (st.just(0.0), floats),
    "frequency_penalty": (st.just(0.0), floats),
    "logit_bias": (st.just({}), st.one_of(st.just(BIG_BIAS), st.dictionaries(texts, floats))),
    "user": (st.text(max_size=10), texts),
    "ignore_eos": (st.booleans(), st.booleans()),
    "stop_token_ids": (
        st.lists(st.integers(0, 511), max_size=3),
        st.lists(ints, max_size=5),
    ),
    # Structured output: well-formed specs, and any JSON (or text, for the compilers) instead.
    "response_format": (
        st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
        st.one_of(
            json_values,
            st.fixed_dictionaries(
                {"type": st.just("json_schema"), "json_schema": st.dictionaries(texts, json_values)}
            ),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries(
                        {"name": texts, "schema": st.dictionaries(texts, json_values)}
                    ),
                }
            ),
        ),
    ),
    "guided_json": (
        st.sampled_from([{"type": "object", "properties": {"a": {"enum": [1, 2]}}}]),
        st.one_of(json_values, st.dictionaries(st.sampled_from(SCHEMA_KEYS), json_values)),
    ),
    "guided_regex": (st.sampled_from(["[a-z]{1,4}", "\\d+"]), texts),
    "guided_choice": (
        st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3),
        json_values,
    ),
    "guided_grammar": (st.sampled_from(['start: "a" | "b"']), texts),
    "prompt_logprobs": (st.sampled_from([None, 0, 2]), ints),
    "structured_outputs": (
        st.sampled_from([{"regex": "[0-9]+"}, {"choice": ["x", "y"]}]),
        st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "x"]), json_values),
    ),
}
COMPLETION_FIELDS = {
    "prompt": (
        st.one_of(
            st.text(min_size=1, max_size=40), st.lists(st.integers(0, 511), min_size=1, max_size=20)
        ),
        st.one_of(
            texts, st.lists(ints, max_size=5), st.lists(texts, max_size=3), st.just([0] * 100_000)
        ),
    ),
    "echo": (st.just(False), st.booleans()),
    "logprobs": (st.none(), ints),
    "best_of": (st.sampled_from([None, 1]), ints),
    "suffix": (st.sampled_from([None, "", "return x"]), texts),
}
CHAT_FIELDS = {
    "messages": (
        messages_good,
        st.one_of(
            st.lists(st.dictionaries(texts, json_values, max_size=4), max_size=4),
            st.lists(st.fixed_dictionaries({"role": texts, "content": texts}), max_size=3),
            st.just([{"role": "user", "content": [{"type": "text", "text": "x"}] * 3}]),
            st.just([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
            st.just([{"role": "user", "content": "x"}] * 20_000),
        ),
    ),
    "logprobs": (st.just(False), st.booleans()),
    "top_logprobs": (st.none(), ints),
    "echo": (st.booleans(), json_values),
    "add_generation_prompt": (st.booleans(), json_values),
    "continue_final_message": (st.booleans(), json_values),
    "tools": (
        st.sampled_from([None, [WEATHER_TOOL]]),
        st.one_of(
            st.lists(st.dictionaries(texts, json_values, max_size=3), max_size=2),
            st.just([WEATHER_TOOL] * 2),
            st.just([{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
            st.just([{"type": "function", "function": {"name": "f", "parameters": {"$ref": 1}}}]),
        ),
    ),
    "tool_choice": (
        st.sampled_from([None, "none", "auto", "required", NAMED_CHOICE]),
        st.one_of(json_values, st.just({"type": "function", "function": {"name": "nope"}})),
    ),
    "parallel_tool_calls": (st.booleans(), json_values),
    "chat_template_kwargs": (
        st.sampled_from([None, {}, {"thinking": True}]),
        st.one_of(json_values, st.just({"messages": 1}), st.dictionaries(texts, json_values)),
    ),
}
RESPONSES_FIELDS = {
    "input": (
        st.one_of(st.text(min_size=1, max_size=30), st.just(RESPONSES_LOOP)),
        st.one_of(
            json_values,
            st.lists(st.dictionaries(texts, json_values, max_size=4), max_size=4),
            st.just([{"type": "function_call", "call_id": 1}]),
            st.just([{"role": "user", "content": [{"type": "input_image"}]}]),
        ),
    ),
    "instructions": (st.text(max_size=20), texts),
    "max_output_tokens": (st.integers(1, 8), ints),
    "tools": (st.sampled_from([None, [FLAT_WEATHER_TOOL]]), json_values),
    "tool_choice": (
        st.sampled_from([None, "auto", "required", {"type": "function", "name": "get_weather"}]),
        json_values,
    ),
    "text": (st.sampled_from([None, {"format": {"type": "text"}}]), json_values),
    "previous_response_id": (st.none(), texts),
    "store": (st.booleans(), json_values),
    "stream": (st.booleans(), json_values),
    "temperature": FIELDS["temperature"],
}


@st.composite
def openai_requests(draw, good_keys: list[str]):
    """A body that is valid except for a few mutations: a field with an absurd value or a wrong
    type, a required field dropped, unknown fields, or a field of the other endpoint."""
    path = draw(st.sampled_from([COMPLETIONS, CHAT, RESPONSES]))
    if path == RESPONSES:
        fields, required = RESPONSES_FIELDS, "input"
    else:
        own = COMPLETION_FIELDS if path == COMPLETIONS else CHAT_FIELDS
        fields = {**FIELDS, **own}
        required = "prompt" if path == COMPLETIONS else "messages"
    body = {required: draw(fields[required][0])}
    optional = sorted(name for name in fields if name != required)
    for name in draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)):
        body[name] = draw(fields[name][0])
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["absurd", "absurd", "wrong_type", "drop", "unknown"]))
        name = draw(st.sampled_from(sorted(fields)))
        if kind == "absurd":
            body[name] = draw(fields[name][1])
        elif kind == "wrong_type":
            body[name] = draw(json_values)
        elif kind == "drop":
            body.pop(required, None)
        else:
            other = CHAT_FIELDS if path != CHAT else COMPLETION_FIELDS
            body[draw(st.one_of(texts, st.sampled_from(sorted(other))))] = draw(json_values)
    raw = encode_json(body, draw(st.booleans()))
    return FuzzRequest("POST", path, raw, draw(headers(good_keys)))


@st.composite
def nesting_and_unicode_requests(draw, good_keys: list[str]):
    """Deeply nested documents (RecursionError bait), lone surrogates and invalid UTF-8 inside
    otherwise valid bodies, and number literals past float and int conversion limits."""
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    kind = draw(st.sampled_from(["deep", "deep_field", "unicode", "bytes", "numbers"]))
    if kind == "deep":
        raw = _nested(
            draw(st.sampled_from([63, 64, 65, 1000, 10_000, 100_000])),
            draw(st.sampled_from(["list", "dict"])),
        )
    elif kind == "deep_field":
        depth = draw(st.integers(1, 3000))
        raw = b'{"prompt": "x", "tools": ' + _nested(depth, "list") + b"}"
    elif kind == "unicode":
        value = draw(st.text(st.sampled_from(EDGE_CHARS), min_size=1, max_size=20))
        field_ = "prompt" if path == COMPLETIONS else "messages"
        body = (
            {"prompt": value, "max_tokens": 2, "stop": [value]}
            if field_ == "prompt"
            else {"messages": [{"role": "user", "content": value, "name": value}], "model": value}
        )
        raw = encode_json(body, draw(st.booleans()))
    elif kind == "bytes":
        prefix = (
            b'{"prompt": "'
            if path == COMPLETIONS
            else b'{"messages": [{"role": "user", "content": "'
        )
        suffix = b'"}' if path == COMPLETIONS else b'"}]}'
        raw = prefix + draw(invalid_utf8) + suffix
    else:
        literal = draw(
            st.sampled_from(
                [
                    b"1e999",
                    b"-1e999",
                    b"1" * 4301,
                    b"1" * 4000,
                    b"0." + b"0" * 10_000 + b"1",
                    b"1e-999",
                    b"-0",
                ]
            )
        )
        name = draw(st.sampled_from([b"max_tokens", b"temperature", b"top_k", b"seed", b"n"]))
        raw = b'{"prompt": "x", "' + name + b'": ' + literal + b"}"
    return FuzzRequest("POST", path, raw, draw(headers(good_keys)))


# ---- the oracle --------------------------------------------------------------------------------
def check_response(req: FuzzRequest, resp: httpx.Response) -> None:
    """Never a 5xx; a 4xx has the OpenAI error body; a 200 stream holds no error event."""
    assert resp.status_code < 500, (req, resp.status_code, resp.text[:300])
    if req.method == "HEAD":
        return
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"], (req, resp.text[:300])
        assert isinstance(error["type"], str) and "param" in error and "code" in error
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), (req, line[:500])


def fuzz_settings(max_examples: int):
    """Hypothesis settings of the HTTP fuzzers: reproducible (derandomized, no example
    database), no per-example deadline (a request may wait on the cluster), no health checks."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )

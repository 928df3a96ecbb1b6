"""The structured-output fields over fake nodes: every way of asking (OpenAI's response_format
on both endpoints, vLLM's guided_* and structured_outputs) reaches both nodes as the one
(kind, spec) it means, through the official openai client; a malformed or uncompilable spec,
two fields at once, or a spec over its size limit is a 400 naming the field before any node
hears of the request."""

import json

import httpx
import openai
import pytest
from router_fakes import (
    RecordingCluster,
    RouterServer,
    assert_invalid_value,
    fake_config,
    tokens,
)

from control.protocol import Prefill, Reserve, sampling_from_dict
from control.structured_output import MAX_SPEC_CHARS
from control.tokenizer import Tokenizer
from tinymodel.make import ensure_tiny_model

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


class Recording(RecordingCluster):
    def structured_sent(self) -> tuple:
        """The structured field both nodes were sent for the one request."""
        (reserve,) = [m for m in self.messages if isinstance(m, Reserve)]
        (prefill,) = [m for m in self.messages if isinstance(m, Prefill)]
        got = sampling_from_dict(reserve.sampling).structured
        assert got == sampling_from_dict(prefill.sampling).structured
        return got


@pytest.fixture(scope="module")
def cluster():
    tok = Tokenizer(ensure_tiny_model())
    cfg = fake_config()
    fakes = Recording(cfg, tok.encode("one two three"), eos_id=tok.eos_token_ids[0])
    fakes.start()
    server = RouterServer(cfg, str(ensure_tiny_model()))
    server.start()
    yield fakes, server
    server.stop()
    fakes.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=20)


JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
ASKED = [
    ({"response_format": JSON_SCHEMA_FORMAT}, ("json_schema", SCHEMA_TEXT)),
    (
        {
            "response_format": {
                **JSON_SCHEMA_FORMAT,
                "json_schema": {"name": "a", "strict": True, "schema": SCHEMA},
            }
        },
        ("json_schema", SCHEMA_TEXT),
    ),
    ({"response_format": {"type": "json_object"}}, ("json_object", "")),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, ("json_schema", SCHEMA_TEXT)),
    ({"guided_json": json.dumps(SCHEMA, indent=2)}, ("json_schema", SCHEMA_TEXT)),
    ({"guided_regex": r"\d+"}, ("regex", r"\d+")),
    ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
    ({"guided_grammar": 'start: "a" | "b"'}, ("grammar", 'start: "a" | "b"')),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", SCHEMA_TEXT)),
    ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+")),
    ({"structured_outputs": {"choice": ["x"]}}, ("choice", '["x"]')),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, ("grammar", 'start: "a"')),
    ({"structured_outputs": {"json_object": True}}, ("json_object", "")),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, ("regex", "a")),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("fields,want", ASKED)
def test_every_way_of_asking_reaches_the_nodes(cluster, fields, want, endpoint, stream):
    fakes, server = cluster
    fakes.messages.clear()
    c = client(server)
    if endpoint == "completions":
        out = c.completions.create(
            model="tiny-model", prompt="Hi", max_tokens=3, stream=stream, extra_body=fields
        )
    else:
        out = c.chat.completions.create(
            model="tiny-model",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            stream=stream,
            extra_body=fields,
        )
    if stream:
        list(out)
    assert fakes.structured_sent() == want


BAD = [
    ({"guided_json": {"type": "foo"}}, "guided_json", "invalid json_schema: Invalid type: foo"),
    ({"guided_json": "{nope"}, "guided_json", "guided_json: not valid JSON"),
    ({"guided_json": {"$ref": "#/x"}}, "guided_json", "/x"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": 3}},
            }
        },
        "response_format",
        "invalid json_schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
        "response_format",
        "json_schema.schema is required",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", "with a name and a schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type must be 'text'"),
    ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
    ({"guided_choice": []}, "guided_choice", "1 to 1024 strings"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "invalid grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one structured"),
    (
        {"response_format": {"type": "json_object"}, "guided_json": SCHEMA},
        "guided_json",
        "got response_format, guided_json",
    ),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "one of"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "unsupported"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "must be a string"),
    ({"guided_regex": "a" * (MAX_SPEC_CHARS["regex"] + 1)}, "guided_regex", "at most 4096"),
    (
        {"guided_json": {"enum": ["x" * MAX_SPEC_CHARS["json_schema"]]}},
        "guided_json",
        "at most 65536 are accepted",
    ),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "min_tokens cannot be combined"),
]


@pytest.mark.parametrize("fields,param,message", BAD)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_specs_are_a_400_naming_the_field(cluster, fields, param, message, path):
    assert_invalid_value(cluster, path, fields, param, message)


def test_wrong_types_are_a_422(cluster):
    _, server = cluster
    for fields in ({"guided_choice": [1, 2]}, {"guided_regex": 5}, {"response_format": "json"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", **fields}, timeout=10)
        assert r.status_code == 422 and r.json()["error"]["param"].startswith(next(iter(fields)))


def test_the_openai_client_sees_the_400(cluster):
    _, server = cluster
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        client(server).completions.create(
            model="tiny-model", prompt="x", extra_body={"guided_regex": "(a"}
        )


def test_a_preempted_structured_request_resumes_its_grammar():
    """The restarted attempt's prompt holds the streamed output: both nodes are told to replay
    it into the grammar (structured_resume), and the decode node gets the ids to replay."""
    import asyncio

    from test_core import EOS, submit
    from test_migration import answer_reserve
    from test_preemption_router import REASON, make_router

    from control.protocol import FirstToken, Preempted

    async def main():
        r = make_router(num_decode=2)
        structured = ("regex", "[a-z]+")
        req = await submit(r, prompt_len=10, max_new=50, structured=structured)
        (_, first_reserve) = r.transport.of(Reserve)[-1]
        assert sampling_from_dict(first_reserve.sampling).structured_resume == 0
        assert first_reserve.prompt_ids == []  # nothing to replay: the ids are not needed
        r.handle(FirstToken("r1", 5, 10))
        r.handle(tokens("r1", [6, 7]))
        r.handle(Preempted("r1", 3, REASON))
        _, reserve = await answer_reserve(r, 2)
        (prefill,) = [m for _, m in r.transport.of(Prefill) if m.request_id == "r1~1"]
        for sampling in (reserve.sampling, prefill.sampling):
            params = sampling_from_dict(sampling)
            assert params.structured == structured and params.structured_resume == 3
        assert reserve.prompt_ids == prefill.token_ids == [*range(2, 12), 5, 6, 7]
        r.handle(FirstToken("r1~1", 8, 13))
        r.handle(tokens("r1~1", [EOS], "stop"))
        assert req.output_ids == [5, 6, 7, 8, EOS]

    asyncio.run(main())

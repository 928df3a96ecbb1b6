"""Tool calling through the real router over fake nodes whose output is a Hermes-style call:
the official openai client's tool loop (the call, streamed and not; the tool's result sent back
in the history, rendered by the chat template), tool_choice none / auto / required / named (a
forced call reaches both nodes as its grammar), and a 400 naming the field for every bad
tools or tool_choice value, before any node hears of the request."""

import httpx
import openai
import pytest
from router_fakes import RecordingCluster, fake_config, start_cluster, stop_all

from control.protocol import Prefill, sampling_from_dict

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def script(tok):
    """The fake nodes' output: some text, the call, then EOS (the model stops after a call)."""
    ids = tok.encode("Let me look. " + CALL)
    assert tok.decode(ids) == "Let me look. " + CALL
    return [*ids, tok.eos_token_ids[0]]


@pytest.fixture(scope="module")
def cluster(model_dir, tok, script):
    started = []
    cfg = fake_config(tool_parser="hermes")
    yield start_cluster(cfg, script, tok.eos_token_ids[0], model_dir, started, RecordingCluster)
    stop_all(started)


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster[1].url + "/v1", api_key="x")


def _create(client, script, **kwargs):
    return client.chat.completions.create(
        model="tiny-model",
        messages=kwargs.pop("messages", MESSAGES),
        max_tokens=len(script) + 8,
        **kwargs,
    )


def test_auto_returns_the_call_with_its_arguments(client, script):
    choice = _create(client, script, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris"}'  # as the model wrote it


def test_a_streamed_call_comes_name_first_then_its_arguments_in_pieces(client, script):
    stream = _create(client, script, tools=TOOLS, stream=True)
    content, calls, pieces, finish = [], {}, [], None
    for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for part in choice.delta.tool_calls or []:
                if part.index not in calls:  # a call's first piece: its id, type and name
                    assert part.id.startswith("call_") and part.type == "function"
                    calls[part.index] = {"name": part.function.name, "arguments": ""}
                else:
                    assert part.function.name is None and part.id is None
                calls[part.index]["arguments"] += part.function.arguments or ""
                pieces.append(part.function.arguments)
            finish = choice.finish_reason or finish
    assert "".join(content) == "Let me look. "
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    # the model's own text, token by token as the fake node sends it
    assert calls[0]["arguments"] == '{"city": "Paris"}'
    assert len([p for p in pieces if p]) > 1
    assert finish == "tool_calls"


def test_the_tool_loop_sends_the_result_back_through_the_template(client, script, cluster):
    fakes, _ = cluster
    first = _create(client, script, tools=TOOLS).choices[0].message
    history = [
        *MESSAGES,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C, sunny"},
    ]
    fakes.messages.clear()
    _create(client, script, tools=TOOLS, messages=history)
    (prefill,) = [m for m in fakes.messages if isinstance(m, Prefill)]
    r = httpx.post(
        cluster[1].url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=10
    )
    assert r.json()["tokens"] == list(prefill.token_ids)
    assert (
        "<tool_response>18 C, sunny</tool_response>"
        in httpx.post(
            cluster[1].url + "/detokenize", json={"tokens": list(prefill.token_ids)}, timeout=10
        ).json()["prompt"]
    )


def test_none_leaves_the_text_alone(client, script):
    choice = _create(client, script, tools=TOOLS, tool_choice="none").choices[0]
    assert choice.message.content == "Let me look. " + CALL
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_reaches_both_nodes_as_its_grammar(client, script, cluster, tool_choice):
    fakes, _ = cluster
    fakes.messages.clear()
    _create(client, script, tools=TOOLS, tool_choice=tool_choice)
    grammars = {sampling_from_dict(m.sampling).structured for m in fakes.messages}
    ((kind, spec),) = grammars
    assert kind == "grammar" and "<tool_call>" in spec and '"get_weather"' in spec


BAD = [
    ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "must match"),
    ({"tools": TOOLS * 2}, "tools", "two tools are named"),
    ({"tool_choice": "required"}, "tool_choice", "required needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be none, auto"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "no tool is named 'nope'",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "cannot be combined with structured output",
    ),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD)
def test_bad_tool_fields_are_a_400_naming_the_field(cluster, fields, param, message):
    fakes, server = cluster
    fakes.messages.clear()
    body = {"messages": MESSAGES, "max_tokens": 2, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]
    assert fakes.messages == []


def test_without_a_tool_parser_tools_are_refused(model_dir, tok, script):
    started = []
    try:
        _, server = start_cluster(fake_config(), script, tok.eos_token_ids[0], model_dir, started)
        body = {"messages": MESSAGES, "max_tokens": 2, "tools": TOOLS}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        body["tool_choice"] = "none"  # not asking for calls: served
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10).is_success
    finally:
        stop_all(started)

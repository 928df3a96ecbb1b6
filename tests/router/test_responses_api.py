"""The Responses API (`POST /v1/responses`) through the official openai client over fake nodes:
text, reasoning and function calls as output items, whole and streamed (the typed events in
order), the input items a tool loop sends back (function_call, function_call_output) rendered
into the prompt, and a 400 naming the field for what cannot be served."""

import json

import httpx
import openai
import pytest
from router_fakes import RecordingCluster, fake_config, start_cluster, stop_all

from control.protocol import Prefill

THINK, ANSWER = "Paris is in France.", "It is sunny."
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]


def _cluster(tok, model_dir, text, started):
    ids = [*tok.encode(text), tok.eos_token_ids[0]]
    cfg = fake_config(reasoning_parser="deepseek_r1", tool_parser="hermes")
    fakes, server = start_cluster(
        cfg, ids, tok.eos_token_ids[0], model_dir, started, RecordingCluster
    )
    return fakes, openai.OpenAI(base_url=server.url + "/v1", api_key="x"), server.url


@pytest.fixture(scope="module")
def text_cluster(tok, model_dir):
    started = []
    yield _cluster(tok, model_dir, THINK + "</think>" + ANSWER, started)
    stop_all(started)


@pytest.fixture(scope="module")
def call_cluster(tok, model_dir):
    started = []
    yield _cluster(tok, model_dir, "</think>" + CALL, started)
    stop_all(started)


def test_text_and_reasoning_come_as_output_items(text_cluster):
    _, client, _ = text_cluster
    response = client.responses.create(model="tiny-model", input="Weather?", max_output_tokens=64)
    assert response.status == "completed" and response.object == "response"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THINK
    assert message.type == "message" and message.content[0].text == ANSWER
    assert response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_the_stream_is_the_typed_events_in_order(text_cluster):
    _, client, _ = text_cluster
    events = list(client.responses.create(model="tiny-model", input="Weather?", stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (THINK, ANSWER)
    message_kinds = [k for k in kinds if "content_part" in k or "output_text" in k]
    assert message_kinds[0] == "response.content_part.added"
    assert message_kinds[-2:] == ["response.output_text.done", "response.content_part.done"]
    assert events[-1].response.output[1].content[0].text == ANSWER


def test_a_function_call_and_the_loop_that_answers_it(call_cluster):
    fakes, client, url = call_cluster
    response = client.responses.create(model="tiny-model", input="Weather?", tools=TOOLS)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    fakes.messages.clear()
    follow_up = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]  # fmt: skip
    client.responses.create(model="tiny-model", input=follow_up, tools=TOOLS)
    (prefill,) = fakes.sent(Prefill)
    prompt = httpx.post(url + "/detokenize", json={"tokens": list(prefill.token_ids)}).json()
    assert "<tool_response>18 C</tool_response>" in prompt["prompt"]
    assert '"arguments": {"city": "Paris"}' in prompt["prompt"]


def test_a_streamed_function_call(call_cluster):
    _, client, _ = call_cluster
    events = list(
        client.responses.create(model="tiny-model", input="Weather?", tools=TOOLS, stream=True)
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == '{"city": "Paris"}'
    # added (name known, no arguments yet), the arguments in pieces, done, the item done
    (added,) = _call_items(events, "response.output_item.added")
    assert added.item.name == "get_weather" and added.item.arguments == ""
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(e.delta for e in pieces) == done[0].arguments
    assert {e.item_id for e in pieces} == {added.item.id}
    order = [e.sequence_number for e in (added, *pieces, done[0])]
    assert order == sorted(order)
    ((_, item),) = [(e, e.item) for e in _call_items(events, "response.output_item.done")]
    assert item.arguments == done[0].arguments and item.status == "completed"
    assert events[-1].type == "response.completed"


def _call_items(events, kind):
    return [e for e in events if e.type == kind and e.item.type == "function_call"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(text_cluster, fields, param):
    fakes, _, url = text_cluster
    fakes.messages.clear()
    body = {"model": "tiny-model", "input": "Weather?", **fields}
    r = httpx.post(url + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert fakes.messages == []

"""Tool calling end to end on the random tiny model (`duet up --tool-parser hermes`): with
tool_choice required or a named function the sampling nodes write under the call's grammar, so
even this model's calls always parse and their arguments validate against the function's
schema; the official openai client's loop (call, the tool's result, an answer) completes."""

import json

import jsonschema
import openai
import pytest
from e2e_helpers import start_cluster

from tinymodel.make import make_tiny_model

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "hot": {"type": "boolean"}},
    "required": ["city", "hot"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# The tiny model's context is 512 tokens and its tokenizer spends many on JSON: the tools and
# the question are kept short, so a call always has room.
MESSAGES = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("random") / "tiny-model", seed=0)
    args = ["--prefill", "1", "--decode", "1", "--dtype", "float32", "--threads", "1"]
    up = start_cluster([*args, "--model", str(model), "--tool-parser", "hermes"], tmp_path_factory)
    yield openai.OpenAI(base_url=up.url + "/v1", api_key="x")
    up.stop()


def _valid_calls(message) -> list[str]:
    names = []
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.append(call.function.name)
    return names


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_always_validates(client, seed, stream):
    kwargs = dict(model="tiny-model", messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=seed)
    kwargs["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    kwargs["temperature"] = 1.0
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert _valid_calls(choice.message) == ["get_weather"]
        return
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_required_calls_validate_whichever_function_is_called(client, seed):
    choice = client.chat.completions.create(
        model="tiny-model",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        seed=seed,
        temperature=1.0,
    ).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert set(_valid_calls(choice.message)) <= set(SCHEMAS)


def test_the_openai_tool_loop_completes(client):
    first = (
        client.chat.completions.create(
            model="tiny-model",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=300,
            temperature=0.0,
        )
        .choices[0]
        .message
    )
    (call, *_) = first.tool_calls
    history = [
        *MESSAGES,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})},
    ]
    answer = client.chat.completions.create(
        model="tiny-model", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    ).choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)

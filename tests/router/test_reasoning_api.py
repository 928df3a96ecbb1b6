"""Reasoning output and chat_template_kwargs through the real router over fake nodes: with
`reasoning_parser = "deepseek_r1"` a chat's `<think>...</think>` comes back as reasoning_content,
streamed and not, and the usage counts the tokens spent reasoning; completions and a router
without the parser leave the text as it is. Structured output and forced tool calls reach the
nodes as grammars that start after "</think>". chat_template_kwargs reach the chat template."""

import json
import shutil

import httpx
import openai
import pytest
from router_fakes import RecordingCluster, fake_config, start_cluster, stop_all

from control.protocol import sampling_from_dict
from control.tokenizer import Tokenizer
from router.serving import TEMPLATE_VARIABLES

OUTPUT = "Let me think: 2+2.</think>It is 4."
REASONING, CONTENT = "Let me think: 2+2.", "It is 4."
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def script(tok):
    ids = tok.encode(OUTPUT)
    assert tok.decode(ids) == OUTPUT
    # the oracle of the usage count: the tokens up to the one that completes the closing tag
    ends = [k for k in range(1, len(ids) + 1) if "</think>" in tok.decode(ids[:k])]
    return ids, ends[0]


@pytest.fixture(scope="module")
def cluster(model_dir, tok, script):
    started = []
    cfg = fake_config(reasoning_parser="deepseek_r1", tool_parser="hermes")
    ids, _ = script
    eos = tok.eos_token_ids[0]
    fakes, server = start_cluster(cfg, ids, eos, model_dir, started, RecordingCluster)
    yield fakes, server
    stop_all(started)


def _body(script, **extra):
    ids, _ = script
    return {"messages": MESSAGES, "max_tokens": len(ids), "ignore_eos": True, **extra}


def test_a_whole_chat_splits_reasoning_from_content(cluster, script):
    _, server = cluster
    r = httpx.post(server.url + "/v1/chat/completions", json=_body(script), timeout=30)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, CONTENT)
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == len(script[0])
    assert usage["completion_tokens_details"] == {"reasoning_tokens": script[1]}


def test_a_streamed_chat_sends_reasoning_then_content_through_the_openai_client(cluster, script):
    _, server = cluster
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    stream = client.chat.completions.create(
        model="tiny-model",
        messages=MESSAGES,
        max_tokens=len(script[0]),
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    reasoning, content, order, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
                order.append("r")
            if delta.get("content"):
                content.append(delta["content"])
                order.append("c")
    assert ("".join(reasoning), "".join(content)) == (REASONING, CONTENT)
    assert order == sorted(order, key="rc".index)  # all reasoning first
    assert usage.completion_tokens_details.reasoning_tokens == script[1]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOL = {"type": "function", "function": {"name": "add", "parameters": SCHEMA}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}


@pytest.mark.parametrize(
    ("extra", "kind"),
    [
        ({"response_format": RESPONSE_FORMAT}, "json_schema"),
        ({"guided_regex": "[0-9]+"}, "regex"),
        ({"tools": [TOOL], "tool_choice": "required"}, "grammar"),
    ],
)
def test_structured_output_starts_after_the_reasoning(cluster, script, extra, kind):
    fakes, server = cluster
    fakes.messages.clear()
    body = {"messages": MESSAGES, "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    sent = {sampling_from_dict(m.sampling).structured for m in fakes.messages}
    ((got_kind, _, after),) = sent  # the same on both nodes
    assert (got_kind, after) == (kind, "</think>")


def test_completions_keep_their_grammar_from_the_start(cluster):
    fakes, server = cluster
    fakes.messages.clear()
    body = {"prompt": "2+2=", "max_tokens": 2, "guided_regex": "[0-9]+"}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    sent = {sampling_from_dict(m.sampling).structured for m in fakes.messages}
    assert sent == {("regex", "[0-9]+")}


def test_completions_keep_the_text_whole(cluster, script):
    _, server = cluster
    body = {"prompt": "What is 2+2?", "max_tokens": len(script[0]), "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.json()["choices"][0]["text"] == OUTPUT
    assert "completion_tokens_details" not in r.json()["usage"]


def test_without_a_parser_the_chat_is_left_as_it_is(model_dir, tok, script):
    started = []
    try:
        _, server = start_cluster(
            fake_config(), script[0], tok.eos_token_ids[0], model_dir, started
        )
        r = httpx.post(server.url + "/v1/chat/completions", json=_body(script), timeout=30)
        message = r.json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": OUTPUT}
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def thinking_model(model_dir, tmp_path_factory):
    """The tiny model's tokenizer and config, with a template that opens `<think>` when the
    request's chat_template_kwargs ask for `thinking`."""
    out = tmp_path_factory.mktemp("thinking-model")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(f"{model_dir}/{name}", out / name)
    cfg = json.loads(open(f"{model_dir}/tokenizer_config.json").read())
    cfg["chat_template"] += "{% if add_generation_prompt and thinking %}<think>{% endif %}"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(out)


def test_chat_template_kwargs_reach_the_template(thinking_model, tok, script):
    started = []
    try:
        _, server = start_cluster(
            fake_config(), script[0], tok.eos_token_ids[0], thinking_model, started
        )

        def tokenize(**extra):
            body = {"messages": MESSAGES, **extra}
            return httpx.post(server.url + "/tokenize", json=body, timeout=10)

        plain = tokenize().json()["tokens"]
        thinking = tokenize(chat_template_kwargs={"thinking": True}).json()["tokens"]
        tok = Tokenizer(thinking_model)
        assert tok.decode(thinking, skip_special_tokens=False).endswith("<think>")
        assert thinking[: len(plain)] == plain and len(thinking) > len(plain)
        assert tokenize(chat_template_kwargs={"thinking": False}).json()["tokens"] == plain
        for name in sorted(TEMPLATE_VARIABLES):
            r = tokenize(chat_template_kwargs={name: 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
            assert name in r.json()["error"]["message"]
        r = tokenize(chat_template_kwargs=["thinking"])
        assert r.status_code == 422 and r.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        stop_all(started)

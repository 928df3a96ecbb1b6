"""vLLM's chat `echo`, `add_generation_prompt` and `continue_final_message` through the real
router over fake nodes. The prompt ids the prefill node receives are checked against
transformers' own rendering (apply_chat_template) and encoding of the tiny model's chat; the
echoed text against the request's last message."""

import httpx
import openai
import pytest
from router_fakes import RecordingCluster, fake_config, start_cluster, stop_all

from control.protocol import Prefill
from router.unknown_fields import IGNORED_FIELDS_HEADER

transformers = pytest.importorskip("transformers")

OUTPUT = "world, and more."
# deepseek_r1's split of an output that thinks first
THINKING_OUTPUT = "Hmm, greet.</think>Hi there."
REASONING, CONTENT = "Hmm, greet.", "Hi there."
USER = {"role": "user", "content": "Write a greeting."}


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def output_ids(tok):
    ids = tok.encode(OUTPUT)
    assert tok.decode(ids) == OUTPUT
    return ids


@pytest.fixture(scope="module")
def cluster(model_dir, tok, output_ids):
    started = []
    eos = tok.eos_token_ids[0]
    fakes, server = start_cluster(
        fake_config(), output_ids, eos, model_dir, started, RecordingCluster
    )
    yield fakes, server
    stop_all(started)


@pytest.fixture(scope="module")
def thinking_cluster(model_dir, tok):
    ids = tok.encode(THINKING_OUTPUT)
    assert tok.decode(ids) == THINKING_OUTPUT
    started = []
    cfg = fake_config(reasoning_parser="deepseek_r1")
    _, server = start_cluster(cfg, ids, tok.eos_token_ids[0], model_dir, started)
    yield server, len(ids)
    stop_all(started)


def _oracle(hf_tok, messages, **flags) -> list[int]:
    """transformers' ids of the chat: its rendering, encoded with nothing added (the template
    writes the bos)."""
    text = hf_tok.apply_chat_template(messages, tokenize=False, **flags)
    return hf_tok(text, add_special_tokens=False)["input_ids"]


def _chat(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def _prefilled(fakes, server, **body) -> list[int]:
    """The prompt ids the prefill node got for the chat request `body`."""
    fakes.messages.clear()
    r = _chat(server, max_tokens=2, **body)
    assert r.status_code == 200, r.text
    assert IGNORED_FIELDS_HEADER not in r.headers  # the fields are known, none ignored
    (prefill,) = fakes.sent(Prefill)
    return list(prefill.token_ids)


# ---- the prompt -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "final",
    [
        {"role": "assistant", "content": "Hello, wor"},
        {"role": "assistant", "content": "Trailing space "},
        # the text is in the end of turn too ("<|end_of_text|>"): only the cut after the
        # message's own end is right
        {"role": "assistant", "content": "text"},
        {"role": "user", "content": "Continue my sen"},
    ],
)
def test_continue_final_message_leaves_the_final_message_open(cluster, hf_tok, tok, final):
    fakes, server = cluster
    messages = [USER, final]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = _prefilled(fakes, server, messages=messages, **flags)
    assert ids == _oracle(hf_tok, messages, **flags)
    rendered = tok.decode(ids, skip_special_tokens=False)
    assert rendered.endswith(final["content"]) and tok.eos_token not in rendered
    # /tokenize of the same chat: the ids the chat request prefills
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, **flags}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids


@pytest.mark.parametrize("last", [USER, {"role": "assistant", "content": "Hi."}])
def test_add_generation_prompt_is_the_templates(cluster, hf_tok, last):
    fakes, server = cluster
    messages = [USER, last] if last is not USER else [USER]
    with_prompt = _prefilled(fakes, server, messages=messages)  # the default: true
    assert with_prompt == _oracle(hf_tok, messages, add_generation_prompt=True)
    assert _prefilled(fakes, server, messages=messages, add_generation_prompt=True) == with_prompt
    without = _prefilled(fakes, server, messages=messages, add_generation_prompt=False)
    assert without == _oracle(hf_tok, messages, add_generation_prompt=False)
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    r = httpx.post(
        server.url + "/tokenize",
        json={"messages": messages, "add_generation_prompt": False},
        timeout=10,
    )
    assert r.json()["tokens"] == without


# ---- echo -----------------------------------------------------------------------------------
PARTIAL = {"role": "assistant", "content": "Hello, "}
PARTS = {
    "role": "assistant",
    "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo, "}],
}
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.mark.parametrize(
    ("messages", "flags", "echoed"),
    [
        # continuing the assistant's message: the whole message comes back
        ([USER, PARTIAL], CONTINUE, "Hello, "),
        ([USER, PARTS], CONTINUE, "Hello, "),
        # a new assistant message after an assistant message: the reply's role, echoed
        ([USER, PARTIAL], {}, "Hello, "),
        # a new assistant message after the user's: another role, nothing echoed
        ([USER], {}, ""),
        # no generation prompt: the reply's role is the last message's own
        ([USER], {"add_generation_prompt": False}, USER["content"]),
    ],
)
def test_echo_prepends_the_last_message_of_the_replys_role(
    cluster, output_ids, messages, flags, echoed
):
    _, server = cluster
    body = {"messages": messages, "max_tokens": len(output_ids), "ignore_eos": True, **flags}
    r = _chat(server, **body, echo=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == echoed + OUTPUT
    # the reply's role: the last message's own without a generation prompt (vLLM's)
    role = "assistant" if flags.get("add_generation_prompt", True) else messages[-1]["role"]
    assert r.json()["choices"][0]["message"]["role"] == role
    assert r.json()["usage"]["completion_tokens"] == len(output_ids)  # echo is no output
    assert _chat(server, **body).json()["choices"][0]["message"]["content"] == OUTPUT


@pytest.mark.parametrize(("messages", "echoed"), [([USER, PARTS], "Hello, "), ([USER], "")])
def test_a_streamed_echo_is_the_first_delta_of_every_choice(cluster, output_ids, messages, echoed):
    _, server = cluster
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    stream = client.chat.completions.create(
        model="tiny-model",
        messages=messages,
        max_tokens=len(output_ids),
        n=2,
        stream=True,
        extra_body={"echo": True, "ignore_eos": True},
    )
    deltas: dict[int, list[dict]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            deltas[choice.index].append(choice.delta.model_dump(exclude_none=True))
    for index in (0, 1):
        got = deltas[index]
        assert got[0] == {"role": "assistant", "content": ""}
        contents = [d["content"] for d in got[1:] if d.get("content")]
        assert "".join(contents) == echoed + OUTPUT
        if echoed:
            assert got[1] == {"content": echoed}  # its own delta, right after the role's


def test_with_a_reasoning_parser_echo_goes_to_the_content_only(thinking_cluster):
    server, num_ids = thinking_cluster
    body = {"messages": [USER, PARTIAL], "max_tokens": num_ids, "ignore_eos": True, "echo": True}
    body.update(CONTINUE)
    message = _chat(server, **body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, "Hello, " + CONTENT)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    stream = client.chat.completions.create(
        model="tiny-model",
        messages=body["messages"],
        max_tokens=num_ids,
        stream=True,
        extra_body={**CONTINUE, "echo": True, "ignore_eos": True},
    )
    reasoning, content = [], []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
    assert ("".join(reasoning), "".join(content)) == (REASONING, "Hello, " + CONTENT)


# ---- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"continue_final_message": True}, "cannot be combined with add_generation_prompt"),
        (
            {"continue_final_message": True, "add_generation_prompt": True},
            "set add_generation_prompt to false",
        ),
        (
            {"continue_final_message": True, "add_generation_prompt": False, "empty": ""},
            "no content",
        ),
        (
            {"continue_final_message": True, "add_generation_prompt": False, "empty": None},
            "no content",
        ),
        (
            {"continue_final_message": True, "add_generation_prompt": False, "empty": []},
            "no content",
        ),
    ],
)
def test_continue_final_message_is_refused_when_it_cannot_be_honoured(
    cluster, path, fields, message
):
    fakes, server = cluster
    fakes.messages.clear()
    fields = dict(fields)
    final = {"role": "assistant", "content": fields.pop("empty", "Hello")}
    body = {"messages": [USER, final], **fields}
    r = httpx.post(server.url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "continue_final_message", error
    assert error["message"].startswith("continue_final_message: ") and message in error["message"]
    assert fakes.messages == []


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "echo", "yes"),
        ("/v1/chat/completions", "echo", 1),
        ("/v1/chat/completions", "add_generation_prompt", 0),
        ("/v1/chat/completions", "add_generation_prompt", None),
        ("/v1/chat/completions", "continue_final_message", "true"),
        ("/tokenize", "continue_final_message", 1),
        ("/tokenize", "add_generation_prompt", "false"),
    ],
)
def test_a_bad_type_is_a_422_naming_the_field(cluster, path, field, value):
    fakes, server = cluster
    fakes.messages.clear()
    body = {"messages": [USER], field: value}
    r = httpx.post(server.url + path, json=body, timeout=10)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == field
    assert fakes.messages == []


def test_continue_final_message_is_not_a_template_variable_of_the_request(cluster):
    _, server = cluster
    body = {"messages": [USER], "chat_template_kwargs": {"continue_final_message": True}}
    r = _chat(server, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"

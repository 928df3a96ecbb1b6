"""Logprobs in the OpenAI response shapes, through the official openai client: completions
(`logprobs: k`, with `echo` the prompt's too) and chat (`logprobs`, `top_logprobs`), streamed and
not; vLLM's `prompt_logprobs` on both. The fake nodes send `router_fakes.fake_logprobs` and
`fake_rank`, so every value here is known."""

import dataclasses

import openai
import pytest
from router_fakes import FakeCluster, RouterServer, fake_config, fake_logprobs, fake_rank

from control.tokenizer import Tokenizer
from tinymodel.make import ensure_tiny_model

SCRIPT_TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ensure_tiny_model())


@pytest.fixture(scope="module")
def server(tok):
    cfg = fake_config()
    cfg = dataclasses.replace(
        cfg, decode=tuple(dataclasses.replace(d, num_pages=256) for d in cfg.decode)
    )
    fakes = FakeCluster(cfg, tok.encode(SCRIPT_TEXT), eos_id=tok.eos_token_ids[0])
    fakes.start()
    srv = RouterServer(cfg, str(ensure_tiny_model()))
    srv.start()
    yield srv
    srv.stop()
    fakes.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=20)


def text_of(tok, token: int) -> str:
    return tok.decode([token], skip_special_tokens=False)


def merged_completion_logprobs(chunks) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                for key in out:
                    out[key] += getattr(choice.logprobs, key)
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprobs(server, tok, stream, echo):
    prompt_ids = tok.encode_prompt("Hello there")
    script = tok.encode(SCRIPT_TEXT)
    out = client(server).completions.create(
        model="tiny-model",
        prompt="Hello there",
        max_tokens=5,
        temperature=0.0,
        logprobs=3,
        echo=echo,
        stream=stream,
    )
    if stream:
        chunks = list(out)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        lp = merged_completion_logprobs(chunks)
    else:
        text = out.choices[0].text
        lp = out.choices[0].logprobs.model_dump()
    output = tok.decode(script[:5])
    assert text == (("Hello there" + output) if echo else output)
    ids = (prompt_ids if echo else []) + script[:5]
    assert lp["tokens"] == [text_of(tok, t) for t in ids]
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["text_offset"] == offsets
    for i, token in enumerate(ids):
        if echo and i == 0:  # the first prompt token has no logprob
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            continue
        logprob, top_ids, top_lps = fake_logprobs(token, 3)
        assert lp["token_logprobs"][i] == logprob
        want = {}
        for t, v in zip(top_ids, top_lps, strict=True):
            want.setdefault(text_of(tok, t), v)  # ids of one text: the likelier's value
        want.setdefault(text_of(tok, token), logprob)  # k alternatives plus the chosen token
        assert lp["top_logprobs"][i] == want


def test_completion_without_logprobs_has_none(server):
    out = client(server).completions.create(model="tiny-model", prompt="Hi", max_tokens=2)
    assert out.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("top", [None, 2])
def test_chat_logprobs(server, tok, stream, top):
    script = tok.encode(SCRIPT_TEXT)
    out = client(server).chat.completions.create(
        model="tiny-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=top,
        stream=stream,
    )
    if stream:
        content = [
            e
            for c in out
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
    else:
        content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry, token in zip(content, script[:4], strict=True):
        logprob, top_ids, top_lps = fake_logprobs(token, top or 0)
        assert entry.token == text_of(tok, token)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == logprob
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (text_of(tok, t), v) for t, v in zip(top_ids, top_lps, strict=True)
        ]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        (
            "/v1/completions",
            {"prompt": "x", "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_logprob_requests_are_400(server, path, body, param):
    import httpx

    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    r = httpx.post(server.url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    if param in ("logprobs", "top_logprobs") and "21" in r.text:
        assert "[0, 20]" in error["message"]


def test_a_moved_request_keeps_logprobs_but_asks_prompt_logprobs_only_once():
    from control.sampling_params import SamplingParams
    from router.state import RouterRequest

    params = SamplingParams(max_new_tokens=8, logprobs=2, prompt_logprobs=2)
    req = RouterRequest("r", 1, [1, 2, 3], params, frozenset())
    assert req.attempt_sampling.prompt_logprobs == 2
    req.state = req.state.__class__.DECODING
    req.restart(room=2)
    # moved before its first token: the same prompt, so the new attempt asks for them again
    assert req.attempt_sampling.prompt_logprobs == 2
    req.num_output_tokens = 2  # two tokens went out to the client
    req.state = req.state.__class__.DECODING
    req.restart(room=2)
    assert req.attempt_sampling.logprobs == 2  # the new attempt's first token has its logprob
    assert req.attempt_sampling.prompt_logprobs is None  # its prompt holds the output too


def expected_prompt_logprobs(tok, prompt_ids, k):
    """vLLM's shape from what the fakes send: null first, then per token its own entry and the
    k alternatives (rank = place), keyed by token id."""
    out = [None]
    for token in prompt_ids[1:]:
        logprob, top_ids, top_lps = fake_logprobs(token, k)
        entry = {str(token): {"logprob": logprob, "rank": fake_rank(token),
                              "decoded_token": text_of(tok, token)}}  # fmt: skip
        for place, (t, v) in enumerate(zip(top_ids, top_lps, strict=True)):
            entry.setdefault(str(t), {"logprob": v, "rank": place + 1,
                                      "decoded_token": text_of(tok, t)})  # fmt: skip
        out.append(entry)
    return out


@pytest.mark.parametrize("k", [0, 3])
def test_completion_prompt_logprobs_come_per_choice(server, tok, k):
    import httpx

    prompts = ["Hello there", "The lazy dog"]
    body = {"prompt": prompts, "max_tokens": 2, "prompt_logprobs": k, "n": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for choice in choices:
        ids = tok.encode_prompt(prompts[choice["index"] // 2])
        assert choice["prompt_logprobs"] == expected_prompt_logprobs(tok, ids, k)
        assert choice["logprobs"] is None  # the output's were not asked for


def test_chat_prompt_logprobs_come_once_at_the_top(server, tok):
    import httpx

    messages = [{"role": "user", "content": "Hi"}]
    body = {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=20)
    ids = tokenized.json()["tokens"]
    assert r.json()["prompt_logprobs"] == expected_prompt_logprobs(tok, ids, 1)
    assert "prompt_logprobs" not in r.json()["choices"][0]


def test_echo_shows_its_own_k_beside_a_larger_prompt_logprobs(server, tok):
    import httpx

    body = {"prompt": "Hello there", "max_tokens": 1, "echo": True, "logprobs": 1}
    r = httpx.post(server.url + "/v1/completions", json={**body, "prompt_logprobs": 4}, timeout=20)
    choice = r.json()["choices"][0]
    ids = tok.encode_prompt("Hello there")
    assert choice["prompt_logprobs"] == expected_prompt_logprobs(tok, ids, 4)
    alone = httpx.post(server.url + "/v1/completions", json=body, timeout=20).json()["choices"][0]
    assert choice["logprobs"] == alone["logprobs"]  # echo's top: 1 alternative, not 4

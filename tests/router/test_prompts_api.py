"""The API parity surface over fake nodes: batched prompts on /v1/completions (strings, token ids,
lists of token ids), vLLM's /tokenize and /detokenize, GET /v1/models/{id}, and unknown fields
(ignored and named in a header, or refused where ignoring them would change the result).

The fakes answer every request with the same script, clipped to the room left in the model's
context (512 positions): prompts of different lengths near the context end get different
numbers of tokens, which tells the choices of a batch apart. The oracle for texts is the
tokenizer's own decode of the script's tokens."""

import dataclasses
import itertools
import json
import threading
import time

import httpx
import openai
import pytest
from http_fuzz import (
    FuzzRequest,
    check_response,
    encode_json,
    fuzz_settings,
    ints,
    json_values,
    texts,
)
from hypothesis import given
from hypothesis import strategies as st
from router_fakes import FakeCluster, fake_config, start_cluster, stop_all, wait_for

from control.protocol import RequestError
from tinymodel.make import make_tiny_model

SCRIPT_TEXT = "The quick brown fox jumps over the lazy dog. 日本語 🚀 done."
CONTEXT = 512  # the tiny model's max_position_embeddings
KEY = "sk-prompts-test"
IGNORED = "x-duet-ignored-fields"


class OneFails(FakeCluster):
    """Fails (RequestError at stage decode) the request whose prompt has `fail_prompt_len`
    tokens, once it has streamed `fail_after` tokens; the others run on."""

    fail_prompt_len = -1
    fail_after = 3

    def _tick_decode(self, now, only=None):
        for rid, run in list(self.running.items()):
            if run.prompt_len == self.fail_prompt_len and run.num_sent >= self.fail_after:
                self._send(run.node, RequestError(rid, "decode", "fake decode failure"))
                self._end(rid, run)
        super()._tick_decode(now, only)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The random tiny model: the vocabulary bounds asserted below are its 512 tokens (the
    default, trained model has 2048)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("random") / "tiny-model", seed=0))


@pytest.fixture
def make_cluster(model_dir, tok):
    """make_cluster(api_keys=(), **router_cfg) -> (OneFails fakes, RouterServer)."""
    started = []

    def factory(api_keys=(), **router_cfg):
        cfg = fake_config(**router_cfg)
        cfg = dataclasses.replace(
            cfg,
            security=dataclasses.replace(cfg.security, api_keys=tuple(api_keys)),
            decode=tuple(dataclasses.replace(d, num_pages=256) for d in cfg.decode),
        )
        ids, eos = tok.encode(SCRIPT_TEXT), tok.eos_token_ids[0]
        return start_cluster(cfg, ids, eos, model_dir, started, cluster_cls=OneFails)

    yield factory
    stop_all(started)


def client(server, key="none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=20)


def expected(tok, n: int) -> str:
    return tok.decode(tok.encode(SCRIPT_TEXT)[:n])


def nothing_left(fakes, server) -> bool:
    """No request unfinished in the router, none running on the fakes, no page reserved."""
    return not server.router.requests and not fakes.running and fakes.used_pages("d0") == 0


def post(server, path, body, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=10, **kwargs)


# Token-id prompts and the number of tokens each gets at max_tokens=9: the room left in the
# context clips the first two.
ID_PROMPTS = [[7] * (CONTEXT - 4), [3, 4, 5], [9] * (CONTEXT - 6)]
ID_OUTPUTS = [4, 9, 6]


# ---- batches ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_batch_of_token_id_lists(make_cluster, tok, stream):
    """One choice per prompt, `index` = its position, each with its own text and finish;
    usage summed over the prompts."""
    fakes, server = make_cluster()
    c = client(server)
    kwargs = dict(model="tiny-model", prompt=ID_PROMPTS, max_tokens=9)
    if stream:
        chunks = list(
            c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        )
        text = {i: "" for i in range(3)}
        finish = {}
        for ch in chunks[:-1]:
            (choice,) = ch.choices
            text[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
        assert len({ch.id for ch in chunks}) == 1
    else:
        out = c.completions.create(**kwargs)
        assert [ch.index for ch in out.choices] == [0, 1, 2]
        text = {ch.index: ch.text for ch in out.choices}
        finish = {ch.index: ch.finish_reason for ch in out.choices}
        usage = out.usage
    assert text == {i: expected(tok, n) for i, n in enumerate(ID_OUTPUTS)}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == sum(map(len, ID_PROMPTS))
    assert usage.completion_tokens == sum(ID_OUTPUTS)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert fakes.prefill_count["p0"] == 3
    assert wait_for(lambda: nothing_left(fakes, server))


@pytest.mark.parametrize("stream", [False, True])
def test_batch_of_strings(make_cluster, tok, stream):
    fakes, server = make_cluster()
    prompts = ["Hello", "日本語 🚀", "The quick brown fox"]
    out = client(server).completions.create(
        model="tiny-model",
        prompt=prompts,
        max_tokens=5,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
    )
    if stream:
        chunks = list(out)
        texts_ = [
            "".join(c.choices[0].text for c in chunks[:-1] if c.choices[0].index == i)
            for i in range(3)
        ]
        usage = chunks[-1].usage
    else:
        texts_, usage = [c.text for c in out.choices], out.usage
    assert texts_ == [expected(tok, 5)] * 3
    assert usage.prompt_tokens == sum(len(tok.encode_prompt(p)) for p in prompts)
    assert usage.completion_tokens == 15


def test_single_prompt_forms_are_one_choice(make_cluster, tok):
    """A text, a token-id list and a one-element batch give the same single choice 0."""
    _, server = make_cluster()
    ids = tok.encode_prompt("Hello")
    for prompt in ["Hello", ids, ["Hello"], [ids]]:
        body = {"prompt": prompt, "max_tokens": 4}
        out = post(server, "/v1/completions", body).json()
        assert [c["index"] for c in out["choices"]] == [0], prompt
        assert out["choices"][0]["text"] == expected(tok, 4)
        assert out["usage"]["prompt_tokens"] == len(ids)


def test_stream_interleaves_prompts(make_cluster, tok):
    """The prompts stream at once: chunks of different indices alternate, not one prompt after
    the other."""
    fakes, server = make_cluster()
    fakes.token_interval_s = 0.02
    body = {"prompt": ["a", "b", "c"], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    order = [e["choices"][0]["index"] for e in events]
    assert sorted(set(order)) == [0, 1, 2]
    switches = sum(a != b for a, b in itertools.pairwise(order))
    assert switches > 3, order  # one after the other would switch twice
    for i in range(3):
        assert "".join(
            e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i
        ) == expected(tok, 8)


@pytest.mark.parametrize("stream", [True, False])
def test_error_in_one_prompt_ends_response_and_aborts_the_rest(make_cluster, tok, stream):
    fakes, server = make_cluster()
    fakes.token_interval_s = 0.02
    fakes.fail_prompt_len = 4  # prompt 1 below
    prompts = [[5] * 3, [6] * 4, [7] * 5]
    c = client(server)
    if stream:
        got = c.completions.create(model="tiny-model", prompt=prompts, max_tokens=200, stream=True)
        with pytest.raises(openai.APIError, match=r"prompt\[1\]: fake decode failure"):
            for _ in got:
                pass
    else:
        with pytest.raises(openai.InternalServerError, match=r"prompt\[1\]: fake decode fail"):
            c.completions.create(model="tiny-model", prompt=prompts, max_tokens=200)
    # the two healthy prompts were aborted on both nodes, nothing is left running (wait for
    # those two by name: the failed prompt's own abort may reach the node first)
    aborted = lambda: {rid.rsplit("-", 1)[1] for n, rid in fakes.aborts if n == "d0"}  # noqa: E731
    assert wait_for(lambda: {"0", "2"} <= aborted()), aborted()
    assert wait_for(lambda: nothing_left(fakes, server))
    # and the router serves the next request
    out = c.completions.create(model="tiny-model", prompt=[[5] * 3], max_tokens=3)
    assert out.choices[0].text == expected(tok, 3)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_every_prompt(make_cluster, stream):
    fakes, server = make_cluster()
    fakes.token_interval_s = 0.05
    body = {"prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 200, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=5) as r:
            # Each prompt decodes for 10 s (200 tokens, 50 ms apart), and they start in their own
            # time: read on until all three run. Leaving the loop closes the line iterator, and
            # with it the connection (the disconnect under test), so the count is taken inside.
            deadline, all_running = time.monotonic() + 5.0, False
            for _ in r.iter_lines():
                all_running = len(fakes.running) == 3
                if all_running or time.monotonic() > deadline:
                    break
            assert all_running
    else:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    assert wait_for(lambda: len({rid for n, rid in fakes.aborts if n == "d0"}) == 3)
    assert wait_for(lambda: len({rid for n, rid in fakes.aborts if n == "p0"}) == 3)
    assert wait_for(lambda: nothing_left(fakes, server))
    # The slot comes back when the server has handled the hang-up (its task, not ours).
    assert wait_for(lambda: server.app.state.limiter.num_active() == 0)


def test_one_prompt_refused_aborts_the_started_ones(make_cluster):
    """All or none: with room for two more requests, a batch of three is a 503 naming the
    refused prompt, and the two that started are aborted."""
    fakes, server = make_cluster(max_queued_requests=3)
    fakes.prefill_delay_s = 1.0
    first = client(server).completions.create(
        model="tiny-model", prompt="x", max_tokens=3, stream=True
    )
    assert wait_for(lambda: len(server.router.requests) == 1)
    r = post(server, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 3})
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert r.json()["error"]["message"].startswith("prompt[2]: too many unfinished requests")
    assert wait_for(lambda: len(server.router.requests) == 1)  # only the first one runs
    assert wait_for(lambda: len(fakes.reserved["d0"]) == 1)
    first.close()
    assert wait_for(lambda: nothing_left(fakes, server))


@pytest.mark.parametrize(
    "prompt,status,message",
    [
        ([], 400, "the prompt is empty"),
        ([[]], 400, "prompt[0]: the prompt is empty"),
        ([[1], []], 400, "prompt[1]: the prompt is empty"),
        (["a", ""], 400, "prompt[1]: the prompt is empty"),
        ([1, 2, 512], 400, "token id 512 is outside the vocabulary [0, 512)"),
        ([-1], 400, "token id -1 is outside the vocabulary"),
        ([[1, 2], [3, 10**30]], 400, f"prompt[1]: token id {10**30} is outside the vocab"),
        ([[1, 2], [-5]], 400, "prompt[1]: token id -5 is outside the vocabulary"),
        ([[1], [2] * CONTEXT], 400, "prompt[1]: the prompt has 512 tokens; the model's context"),
        (["a", 1], 422, "prompt: must be a string, a list of token ids"),
        ([[1, "a"]], 422, "prompt: must be a string, a list of token ids"),
        ([True, 1], 422, "prompt: must be a string, a list of token ids"),
        ([[1.5]], 422, "prompt: must be a string, a list of token ids"),
        ([["a"]], 422, "prompt: must be a string, a list of token ids"),
    ],
)
def test_bad_prompts_are_400_naming_the_index(make_cluster, prompt, status, message):
    fakes, server = make_cluster()
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"].startswith(message), error
    assert error["param"].startswith("prompt")
    assert not server.router.requests and fakes.prefill_count["p0"] == 0


def test_prompt_limits(make_cluster):
    fakes, server = make_cluster(max_queued_requests=4, max_prompt_tokens=8)
    r = post(server, "/v1/completions", {"prompt": ["a"] * 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompts"
    assert "at most 4 prompts" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"prompt": ["a", "word " * 20]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
    assert r.json()["error"]["message"].startswith("prompt[1]: the prompt has")
    assert (
        post(server, "/v1/completions", {"prompt": ["a"] * 4, "max_tokens": 2}).status_code == 200
    )
    assert fakes.prefill_count["p0"] == 4


# ---- tokenize, detokenize, models ---------------------------------------------------------------
TEXTS = ["Hello world", "日本語 🚀 done.", "<|endoftext|> special", " leading space", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_detokenize_round_trip(make_cluster, tok, text):
    _, server = make_cluster()
    out = post(server, "/tokenize", {"model": "tiny-model", "prompt": text}).json()
    assert out == {
        "count": len(tok.encode_prompt(text)),
        "max_model_len": CONTEXT,
        "tokens": tok.encode_prompt(text),
        "token_strs": None,
    }
    bare = post(
        server,
        "/tokenize",
        {"prompt": text, "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert bare["tokens"] == tok.encode(text)
    assert bare["token_strs"] == [tok.id_to_token(t) for t in tok.encode(text)]
    for ids in (out["tokens"], bare["tokens"]):
        back = post(server, "/detokenize", {"model": "tiny-model", "tokens": ids}).json()
        assert back == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert post(server, "/detokenize", {"tokens": bare["tokens"]}).json()["prompt"] == text


def test_tokenize_chat_equals_encode_chat(make_cluster, tok):
    _, server = make_cluster()
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
    ]
    flat = [messages[0], {"role": "user", "content": "Hi there"}]
    out = post(server, "/tokenize", {"model": "tiny-model", "messages": messages}).json()
    assert out["tokens"] == tok.encode_chat(flat) and out["count"] == len(out["tokens"])
    out = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert out["tokens"] == tok.encode_chat(flat, add_generation_prompt=False)
    # the ids the chat endpoint prefills are these
    chat = client(server).chat.completions.create(
        model="tiny-model", messages=messages, max_tokens=2
    )
    assert chat.usage.prompt_tokens == len(tok.encode_chat(flat))


USER_X = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "path,body,status,param,message",
    [
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "the model 'gpt-4'"),
        ("/tokenize", {"prompt": 5}, 422, "prompt", "prompt: "),
        ("/tokenize", {}, 422, "prompt", "missing required field 'prompt'"),
        ("/tokenize", {"messages": []}, 422, "messages", "messages: "),
        ("/tokenize", {"messages": [{"role": "robot"}]}, 400, "messages", "messages: unknown"),
        ("/tokenize", {"messages": USER_X, "chat_template": "x"}, 400, "chat_template", "chat_"),
        (
            "/tokenize",
            {"messages": USER_X, "continue_final_message": True},
            400,
            "continue_final_message",
            "continue_final_message: ",
        ),
        ("/detokenize", {"tokens": [1, 512]}, 400, "tokens", "tokens[1]: token id 512 is out"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "tokens[0]: token id -1 is outside"),
        ("/detokenize", {"tokens": ["a"]}, 422, "tokens.0", "tokens.0: "),
        ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model", "the model 'gpt-4'"),
        ("/detokenize", [1, 2], 400, None, "the body must be a JSON object"),
    ],
)
def test_tokenize_bad_input(make_cluster, path, body, status, param, message):
    _, server = make_cluster()
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_models_retrieve(make_cluster, model_dir):
    _, server = make_cluster()
    c = client(server)
    card = c.models.retrieve("tiny-model")
    assert card.id == "tiny-model" and card.object == "model"
    assert card.model_extra["max_model_len"] == CONTEXT
    assert c.models.retrieve(model_dir).id == "tiny-model"  # the path, as `model` accepts
    with pytest.raises(openai.NotFoundError) as err:
        c.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found" and "gpt-4" in err.value.message
    r = httpx.get(server.url + "/v1/models/org/some-model")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_new_endpoints_need_the_key(make_cluster):
    _, server = make_cluster(api_keys=[KEY])
    good = {"authorization": f"Bearer {KEY}"}
    for method, path, body in [
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/v1/models/tiny-model", None),
    ]:
        r = httpx.request(method, server.url + path, json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
        assert httpx.request(method, server.url + path, json=body, headers=good).status_code == 200
    assert client(server, KEY).models.retrieve("tiny-model").id == "tiny-model"


# ---- unknown fields -----------------------------------------------------------------------------
def test_unknown_fields_are_ignored_and_named(make_cluster, tok):
    _, server = make_cluster()
    body = {
        "prompt": "x",
        "max_tokens": 3,
        "max_token": 9,
        "foo bar": [1],
        "use_beam_search": False,
    }
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected(tok, 3)
    assert r.headers[IGNORED] == "max_token,foo%20bar,use_beam_search"
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers[IGNORED] == "max_token,foo%20bar,use_beam_search"
        r.read()
    messages = [{"role": "user", "content": "Hi"}]
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 2, "documents": [], "x": None},
    )
    assert r.status_code == 200 and r.headers[IGNORED] == "documents,x"
    assert IGNORED not in post(server, "/v1/completions", {"prompt": "x"}).headers
    # on errors too, and on the tokenizer endpoints
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0, "foo": 1})
    assert r.status_code == 400 and r.headers[IGNORED] == "foo"
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": "1", "foo": 1})
    assert r.status_code == 422 and r.headers[IGNORED] == "foo"
    assert post(server, "/tokenize", {"prompt": "x", "temperature": 9}).headers[IGNORED] == (
        "temperature"
    )
    assert post(server, "/detokenize", {"tokens": [1], "foo": 1}).headers[IGNORED] == "foo"


def test_ignored_fields_header_is_safe(make_cluster):
    """Any JSON key becomes a valid header (percent-encoded), however many there are."""
    _, server = make_cluster()
    body = {"prompt": "x", "max_tokens": 2, "a,b": 1, "\x00\n": 2, "日本": 3}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 and r.headers[IGNORED] == "a%2Cb,%00%0A,%E6%97%A5%E6%9C%AC"
    many = {"prompt": "x", "max_tokens": 2, **{f"field_{i}": i for i in range(5000)}}
    r = post(server, "/v1/completions", many)
    assert r.status_code == 200 and len(r.headers[IGNORED]) <= 1000
    assert r.headers[IGNORED].startswith("field_0,field_1,") and r.headers[IGNORED].endswith(",...")


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/completions", "allowed_token_ids", [1, 2]),
        ("/v1/completions", "length_penalty", 1.2),
        ("/v1/completions", "use_beam_search", True),
        ("/v1/completions", "use_beam_search", 0),  # not JSON false
        ("/v1/completions", "bad_words", ["fox"]),
        ("/v1/completions", "logits_processors", ["my.module:Processor"]),
        ("/v1/completions", "max_completion_tokens", 5),
        ("/v1/completions", "skip_special_tokens", False),
        ("/v1/completions", "truncate_prompt_tokens", 3),
        ("/v1/chat/completions", "best_of", 2),
        ("/v1/chat/completions", "chat_template", "{{ messages }}"),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ],
)
def test_fields_that_would_change_the_result_are_refused(make_cluster, path, field, value):
    fakes, server = make_cluster()
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user"}]}
    r = post(server, path, {**body, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported"
    assert (
        error["message"].startswith(f"{field}: ")
        and "would change the result" in (error["message"])
    )
    assert fakes.prefill_count["p0"] == 0


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"messages": [{"role": "user"}], "n": 17}, 400, "n"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, 400, "logprobs"),
        (
            {"messages": [{"role": "user"}], "logprobs": True, "top_logprobs": 21},
            400,
            "top_logprobs",
        ),
        ({"messages": [{"role": "user"}], "top_logprobs": 2}, 400, "top_logprobs"),
        ({"prompt": "x", "best_of": 17}, 400, "best_of"),
        ({"messages": [{"role": "user"}], "best_of": 2}, 400, "best_of"),
        (
            {"messages": [{"role": "user"}], "response_format": {"type": "structural_tag"}},
            400,
            "response_format",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
            422,
            "messages.0.content",
        ),
        (
            {"messages": [{"role": "user", "tool_calls": [{"id": "1"}]}]},
            422,
            "messages.0.tool_calls",
        ),
    ],
)
def test_known_unsupported_values_stay_refused(make_cluster, body, status, param):
    _, server = make_cluster()
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = post(server, path, body)
    assert r.status_code == status and r.json()["error"]["param"].startswith(param), r.text


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_every_completion_field(make_cluster, tok, stream):
    """Every parameter of the openai client's completions.create at a value this server honours
    (and vLLM's extensions through extra_body)."""
    _, server = make_cluster()
    raw = client(server).completions.with_raw_response.create(
        model="tiny-model",
        prompt=["Hello", "World"],
        best_of=1,
        echo=False,
        frequency_penalty=0.0,
        logit_bias={},
        logprobs=None,
        max_tokens=6,
        n=1,
        presence_penalty=0.0,
        seed=7,
        stop=["never-seen"],
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        suffix=None,
        temperature=0.0,
        top_p=1.0,
        user="tester",
        extra_body={
            "top_k": 5,
            "ignore_eos": True,
            "stop_token_ids": [],
            "priority": 0,
            "add_special_tokens": True,
        },
    )
    assert raw.headers[IGNORED] == "priority"
    out = raw.parse()
    if stream:
        chunks = list(out)
        got = [
            "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(2)
        ]
        assert chunks[-1].usage.completion_tokens == 12
    else:
        got = [c.text for c in out.choices]
    assert got == [expected(tok, 6)] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_every_chat_field(make_cluster, tok, stream):
    _, server = make_cluster()
    raw = client(server).chat.completions.with_raw_response.create(
        model="tiny-model",
        messages=[{"role": "user", "content": "Hi", "name": "me"}],
        audio=None,
        frequency_penalty=0.0,
        logit_bias={},
        logprobs=False,
        max_completion_tokens=5,
        max_tokens=9,
        metadata={"k": "v"},
        modalities=["text"],
        n=1,
        parallel_tool_calls=False,
        presence_penalty=0.0,
        prompt_cache_key="k",
        reasoning_effort="low",
        response_format={"type": "text"},
        safety_identifier="s",
        seed=1,
        service_tier="auto",
        stop="never-seen",
        store=False,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        temperature=0.0,
        tool_choice="none",
        top_logprobs=None,
        top_p=1.0,
        user="u",
        verbosity="low",
        web_search_options=None,
    )
    ignored = raw.headers[IGNORED].split(",")
    assert "metadata" in ignored and "store" in ignored and "modalities" in ignored
    out = raw.parse()
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    else:
        text = out.choices[0].message.content
    assert text == expected(tok, 5)  # max_completion_tokens wins over max_tokens


# ---- fuzz of the new surface --------------------------------------------------------------------
NUM_FUZZ = 150
prompt_values = st.one_of(
    texts,
    st.lists(ints, max_size=6),
    st.lists(texts, max_size=4),
    st.lists(st.lists(st.integers(-2, 600), max_size=5), max_size=4),
    st.lists(st.lists(ints, max_size=3), max_size=3),
    st.lists(json_values, max_size=3),
)
bodies = st.one_of(
    st.fixed_dictionaries(
        {"prompt": prompt_values, "max_tokens": st.integers(1, 4)},
        optional={"stream": st.booleans(), "extra": json_values},
    ),
    st.dictionaries(
        st.sampled_from(
            [
                "prompt",
                "messages",
                "tokens",
                "model",
                "add_special_tokens",
                "return_token_strs",
                "add_generation_prompt",
                "min_p",
                "chat_template",
            ]
        ),
        json_values,
        max_size=4,
    ),
    st.fixed_dictionaries({"tokens": st.lists(ints, max_size=8)}),
)
fuzz_requests = st.builds(
    lambda path, body, ascii_: FuzzRequest(
        "POST", path, encode_json(body, ascii_), {"content-type": b"application/json"}
    ),
    st.sampled_from(["/v1/completions", "/tokenize", "/detokenize"]),
    bodies,
    st.booleans(),
)


def test_fuzz_batches_and_tokenizer_endpoints(make_cluster):
    fakes, server = make_cluster(max_tokens_limit=4)
    fakes.token_interval_s = 0.0
    with httpx.Client(base_url=server.url, timeout=30) as http:

        @fuzz_settings(NUM_FUZZ)
        @given(req=fuzz_requests)
        def run(req):
            check_response(req, req.send(http))

        run()
        paths = st.text(max_size=20).map(lambda t: FuzzRequest("GET", "/v1/models/" + t))

        @fuzz_settings(30)
        @given(req=paths)
        def models(req):
            try:
                check_response(req, req.send(http))
            except httpx.InvalidURL:
                pass  # the client refuses to send it

        models()
    assert wait_for(lambda: nothing_left(fakes, server))
    assert server.app.state.limiter.num_active() == 0


def test_concurrent_batches_all_finish(make_cluster, tok):
    fakes, server = make_cluster()
    results = [None] * 6

    def run(i):
        out = client(server).completions.create(
            model="tiny-model", prompt=["a", "b", "c"], max_tokens=4
        )
        results[i] = [c.text for c in out.choices]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results == [[expected(tok, 4)] * 3] * 6
    assert fakes.prefill_count["p0"] == 18
    assert wait_for(lambda: nothing_left(fakes, server))

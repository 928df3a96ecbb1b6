"""The router over real sockets and HTTP, against fake nodes that speak the protocol (no model).

The expected text of a request is the tokenizer's own decode of the tokens the fakes produce
(the oracle); the official `openai` client is the HTTP client where it fits."""

import json
import threading
import time

import httpx
import openai
import pytest
from router_fakes import fake_config, start_cluster, stop_all, wait_for

SCRIPT_TEXT = "The quick brown fox jumps over the lazy dog. 日本語 🚀 done."


@pytest.fixture
def make_cluster(model_dir, tok):
    """make_cluster(num_prefill, num_decode, **router_cfg) -> (FakeCluster, RouterServer)."""
    started = []

    def factory(num_prefill=1, num_decode=1, **router_cfg):
        cfg = fake_config(num_prefill, num_decode, **router_cfg)
        return start_cluster(cfg, tok.encode(SCRIPT_TEXT), tok.eos_token_ids[0], model_dir, started)

    yield factory
    stop_all(started)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=20)


def expected(tok, n: int) -> str:
    return tok.decode(tok.encode(SCRIPT_TEXT)[:n])


def metric(server, name: str, **labels) -> float:
    """A sample's value from /metrics (0.0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


def test_models_health_metrics(make_cluster):
    _, server = make_cluster()
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-model"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and set(health["nodes"]) == {"p0", "d0"}
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "duet_ttft_seconds",
        "duet_tpot_seconds",
        "duet_inter_token_latency_seconds",
        "duet_node_queued_requests",
        "duet_node_running_requests",
        "duet_kv_pages_used",
        "duet_sla_attainment_ratio",
        "duet_stage_seconds",
    ):
        assert f"# TYPE {name}" in text


@pytest.mark.parametrize("stream", [False, True])
def test_completions(make_cluster, tok, stream):
    _, server = make_cluster()
    c = client(server)
    if stream:
        chunks = list(
            c.completions.create(
                model="tiny-model",
                prompt="Hello",
                max_tokens=9,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        usage = chunks[-1].usage
    else:
        out = c.completions.create(model="tiny-model", prompt="Hello", max_tokens=9)
        text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert text == expected(tok, 9)
    assert finish == "length"
    assert usage.prompt_tokens == len(tok.encode_prompt("Hello")) and usage.completion_tokens == 9


@pytest.mark.parametrize("stream", [False, True])
def test_chat(make_cluster, tok, stream):
    _, server = make_cluster()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    c = client(server)
    out = c.chat.completions.create(
        model="tiny-model", messages=messages, max_tokens=12, stream=stream
    )
    if stream:
        chunks = list(out)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    else:
        text = out.choices[0].message.content
        assert out.usage.prompt_tokens == len(tok.encode_chat(messages))
    assert text == expected(tok, 12)


def test_stop_string_ends_request_and_aborts_decode(make_cluster, tok):
    fakes, server = make_cluster()
    out = client(server).completions.create(
        model="tiny-model", prompt="x", max_tokens=30, stop=["fox", "never"]
    )
    assert out.choices[0].text == "The quick brown " and out.choices[0].finish_reason == "stop"
    assert wait_for(lambda: any(n == "d0" for n, _ in fakes.aborts))
    assert wait_for(lambda: fakes.used_pages("d0") == 0)


def test_eos_ends_request_with_stop(make_cluster, tok):
    fakes, server = make_cluster()
    fakes.script = tok.encode("Hello world") + [tok.eos_token_ids[0]] + tok.encode(" more")
    out = client(server).completions.create(model="tiny-model", prompt="x", max_tokens=30)
    assert out.choices[0].text == "Hello world" and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(tok.encode("Hello world")) + 1


def test_tokens_before_first_token_keep_order(make_cluster, tok):
    fakes, server = make_cluster()
    fakes.tokens_before_first = True
    out = client(server).completions.create(model="tiny-model", prompt="x", max_tokens=6)
    assert out.choices[0].text == expected(tok, 6)


@pytest.mark.parametrize(
    "body,status,param",
    [
        (b"{not json", 400, None),
        ({"prompt": "x", "max_tokens": "5"}, 422, "max_tokens"),
        (
            {"prompt": "x", "stream_options": {"include_usag": True}},
            422,
            "stream_options.include_usag",
        ),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
        ({"prompt": "x", "n": 17}, 400, "n"),
        ({"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
        ({"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "word " * 600}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"max_tokens": 5}, 422, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_bad_input_gets_openai_error_body(make_cluster, body, status, param):
    _, server = make_cluster()
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/completions", timeout=5, **kwargs)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_bad_chat_messages(make_cluster):
    _, server = make_cluster()
    for body, status in [
        ({"messages": []}, 422),
        ({"messages": [{"role": "user"}], "tools": [{"type": "function"}]}, 400),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400),  # the template refuses it
        ({"messages": [{"role": "user", "content": 5}]}, 422),
    ]:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=5)
        assert r.status_code == status, body
        assert "error" in r.json()


def test_no_room_is_503_with_retry_after(make_cluster):
    fakes, server = make_cluster()
    fakes.refuse.add("d0")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert "no free KV pages" in r.json()["error"]["message"]
    assert metric(server, "duet_rejections_total", reason="no_decode_room") == 1


def test_too_many_queued_requests_is_503(make_cluster):
    fakes, server = make_cluster(max_queued_requests=1)
    fakes.prefill_delay_s = 2.0
    c = client(server)
    first = c.completions.create(model="tiny-model", prompt="x", max_tokens=3, stream=True)
    with pytest.raises(openai.APIStatusError) as err:
        c.completions.create(model="tiny-model", prompt="x", max_tokens=3)
    assert err.value.status_code == 503
    assert err.value.response.headers["Retry-After"]
    first.close()


def test_node_death_ends_stream_with_error_event(make_cluster, tok):
    fakes, server = make_cluster()
    fakes.token_interval_s = 0.05
    stream = client(server).completions.create(
        model="tiny-model", prompt="x", max_tokens=200, stream=True
    )
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for i, _ in enumerate(stream):
            if i == 2:
                fakes.silent.add("d0")
    assert "d0" in str(err.value.message) and "decode" in str(err.value.message)
    assert time.monotonic() - t0 < 5  # node_timeout_s is 0.8 s: detected fast, no hang
    assert metric(server, "duet_node_up", node="d0", role="decode") == 0
    assert httpx.get(server.url + "/health").status_code == 503
    fakes.silent.clear()  # heartbeats resume: the node is back
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200)


def test_node_request_error_ends_stream(make_cluster):
    fakes, server = make_cluster()
    fakes.fail_stages.add("decode")
    stream = client(server).completions.create(
        model="tiny-model", prompt="x", max_tokens=5, stream=True
    )
    with pytest.raises(openai.APIError, match="fake decode failure"):
        list(stream)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
    assert r.status_code == 500 and r.json()["error"]["code"] == "failed_at_decode"
    assert metric(server, "duet_request_failures_total", stage="decode") == 2


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_on_both_nodes(make_cluster, stream):
    fakes, server = make_cluster()
    fakes.token_interval_s = 0.05
    body = {"prompt": "x", "max_tokens": 200, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=5) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 4:
                    assert fakes.used_pages("d0") > 0
                    break  # closing the response drops the connection mid-stream
    else:

        def post():
            try:
                httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
            except httpx.TimeoutException:
                pass

        t = threading.Thread(target=post)
        t.start()
        t.join()
    assert wait_for(lambda: {n for n, _ in fakes.aborts} == {"p0", "d0"})
    assert wait_for(lambda: fakes.used_pages("d0") == 0)
    assert wait_for(lambda: metric(server, "duet_requests_total", outcome="aborted") == 1)


def test_concurrent_requests_spread_over_prefill_nodes(make_cluster, tok):
    fakes, server = make_cluster(num_prefill=2)
    fakes.prefill_delay_s = 0.05
    c = client(server)
    texts = [None] * 16

    def run(i):
        stream = c.completions.create(
            model="tiny-model", prompt="x" * (i + 1), max_tokens=5, stream=True
        )
        texts[i] = "".join(ch.choices[0].text for ch in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert texts == [expected(tok, 5)] * 16
    assert fakes.prefill_count["p0"] > 0 and fakes.prefill_count["p1"] > 0
    assert (
        metric(server, "duet_node_requests_total", node="p0", role="prefill")
        == (fakes.prefill_count["p0"])
    )
    assert metric(server, "duet_sla_attainment_ratio") > 0


def test_a_bug_while_streaming_still_ends_with_an_error_event(make_cluster, monkeypatch):
    """An unexpected exception in the router's own streaming code (here the detokenizer) ends
    the stream with an error event, not a cut connection, and the request is aborted."""
    from router.text import TextStream

    fakes, server = make_cluster()

    def broken(self, ids, is_last=False):
        raise RuntimeError("detokenizer bug")

    monkeypatch.setattr(TextStream, "push", broken)
    body = {"model": "tiny-model", "prompt": "hi", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=20) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["message"] == "internal error while streaming" and error["type"] == "server_error"
    deadline = time.monotonic() + 10
    while fakes.used_pages("d0") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fakes.used_pages("d0") == 0 and not server.router.requests

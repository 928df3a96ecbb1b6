"""API keys and limits at the gateway, over fake nodes (router/auth.py, router/guard.py).

Keys: missing / wrong / right, the 401 body, open /health, /metrics open or keyed, the key file
and its rules. Limits: body size (Content-Length and chunked), prompt tokens, max_tokens, and
concurrent requests per key, whose slot must come back after a completion, an error and a client
disconnect. Requests are held open by the fakes (a slow decode), never by sleeping."""

import dataclasses

import httpx
import openai
import pytest
from router_fakes import fake_config, start_cluster, stop_all, wait_for

import router.auth
from control.cluster_config import ClusterConfig, SecurityConfig
from control.errors import ConfigError
from router.__main__ import build_app
from router.auth import ApiKeys, KeyLimiter, read_key_file

KEYS = ("sk-alpha", "sk-beta")
SCRIPT_TEXT = "One two three four five six seven eight nine ten."


@pytest.fixture
def make_cluster(model_dir, tok):
    """make_cluster(security=dict(...), **router_cfg) -> (FakeCluster, RouterServer)."""
    started = []

    def factory(security=None, **router_cfg):
        cfg = fake_config(**router_cfg)
        cfg = dataclasses.replace(
            cfg, security=dataclasses.replace(cfg.security, **(security or {}))
        )
        return start_cluster(cfg, tok.encode(SCRIPT_TEXT), tok.eos_token_ids[0], model_dir, started)

    yield factory
    stop_all(started)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=20)


def post(server, body, key: str | None = KEYS[0], path="/v1/completions", **kwargs):
    headers = bearer(key) if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=10, **kwargs)


def metric(server, name: str, key: str | None = None, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    headers = bearer(key) if key else {}
    text = httpx.get(server.url + "/metrics", headers=headers, timeout=5).text
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == f"{name}{{{want}}}":
            return float(value)
    return 0.0


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


# ---- keys ----------------------------------------------------------------------------------------
def test_missing_wrong_and_right_key(make_cluster):
    _, server = make_cluster(security={"api_keys": KEYS})
    body = {"model": "tiny-model", "prompt": "Hi", "max_tokens": 3}
    for headers, what in [
        ({}, "missing"),
        (bearer("sk-wrong"), "incorrect"),
        (bearer("sk-alph"), "incorrect"),  # a prefix of a key
        ({"authorization": "Basic c2stYWxwaGE="}, "missing"),
        ({"authorization": "Bearer"}, "missing"),
    ]:
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=5)
        error = assert_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        assert error["type"] == "invalid_request_error" and error["param"] is None
        assert what in error["message"] and "sk-" not in error["message"]  # never echoes a key
    for key in KEYS:  # every key works, scheme case-insensitive
        r = httpx.post(
            server.url + "/v1/completions",
            json=body,
            timeout=10,
            headers={"authorization": f"bearer {key}"},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    out = client(server, KEYS[1]).completions.create(model="tiny-model", prompt="Hi", max_tokens=2)
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-nope").chat.completions.create(
            model="tiny-model", messages=[{"role": "user", "content": "Hi"}]
        )
    assert metric(server, "duet_rejections_total", reason="unauthorized") == 6


def test_every_path_but_health_needs_the_key(make_cluster):
    _, server = make_cluster(security={"api_keys": KEYS})
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert "duet_ttft_seconds" in httpx.get(server.url + "/metrics").text  # open by default
    for path in ["/v1/models", "/v1/nope", "/docs"]:
        assert_error(httpx.get(server.url + path), 401, "invalid_api_key")
    models = httpx.get(server.url + "/v1/models", headers=bearer(KEYS[0])).json()["data"]
    assert [m["id"] for m in models] == ["tiny-model"]
    assert_error(httpx.get(server.url + "/v1/nope", headers=bearer(KEYS[0])), 404)


def test_metrics_need_key(make_cluster):
    _, server = make_cluster(security={"api_keys": KEYS, "metrics_need_key": True})
    assert_error(httpx.get(server.url + "/metrics"), 401, "invalid_api_key")
    assert "duet_ttft_seconds" in httpx.get(server.url + "/metrics", headers=bearer(KEYS[1])).text
    assert httpx.get(server.url + "/health").status_code == 200  # never keyed


def test_open_gateway_without_keys(make_cluster):
    _, server = make_cluster()
    r = post(server, {"prompt": "Hi", "max_tokens": 2}, key=None)
    assert r.status_code == 200
    assert post(server, {"prompt": "Hi", "max_tokens": 2}, key="anything").status_code == 200


def test_key_file_with_comments(make_cluster, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# team A\nsk-file-1\n\n   # indented comment\n  sk-file-2  \n#sk-commented\n")
    _, server = make_cluster(security={"api_key_file": str(keys)})
    for key in ("sk-file-1", "sk-file-2"):
        assert post(server, {"prompt": "Hi", "max_tokens": 2}, key=key).status_code == 200
    for key in ("#sk-commented", "sk-commented", "#"):
        assert_error(post(server, {"prompt": "Hi"}, key=key), 401, "invalid_api_key")


def test_key_file_rules(tmp_path, monkeypatch):
    (tmp_path / "keys.txt").write_text("k1\n# c\nk2\n")
    monkeypatch.chdir(tmp_path)  # a relative path resolves against the working directory
    assert read_key_file("keys.txt") == ["k1", "k2"]
    with pytest.raises(ConfigError, match="cannot read"):
        read_key_file("missing.txt")
    (tmp_path / "empty.txt").write_text("# only comments\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        read_key_file("empty.txt")
    (tmp_path / "spaces.txt").write_text("two words\n")
    with pytest.raises(ConfigError, match="spaces.txt:1"):
        read_key_file("spaces.txt")
    with pytest.raises(ConfigError, match="one word"):
        ApiKeys.load(SecurityConfig(api_keys=("ok", "")))


def test_key_file_and_inline_keys_are_refused(tmp_path):
    (tmp_path / "keys.txt").write_text("sk-file\n")
    security = SecurityConfig(api_key_file=str(tmp_path / "keys.txt"), api_keys=("sk-inline",))
    with pytest.raises(ConfigError, match="must not be in clear in the TOML"):
        ApiKeys.load(security)
    config = tmp_path / "cluster.toml"  # and the router refuses to start on such a config
    config.write_text(
        f'[security]\napi_key_file = "{tmp_path / "keys.txt"}"\napi_keys = ["sk-inline"]\n'
        '[[prefill]]\nname = "p"\ncontrol_port = 17101\n'
        '[[decode]]\nname = "d"\ncontrol_port = 17201\nkv_port = 17301\n'
    )
    with pytest.raises(ConfigError, match="must not be in clear"):
        build_app(ClusterConfig.load(config))


def test_match_compares_every_key(monkeypatch):
    keys = ApiKeys(["a1", "b22", "c333"])
    calls = []
    real = router.auth.hmac.compare_digest
    monkeypatch.setattr(
        router.auth.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b)
    )
    for presented, want in [(b"a1", 0), (b"c333", 2), (b"b2", None), (b"", None), (b"\xff", None)]:
        calls.clear()
        assert keys.match(presented) == want
        assert len(calls) == 3  # no early exit on a hit or a miss
    assert ApiKeys([]).is_open and ApiKeys([]).match(b"x") is None


def test_key_limiter():
    limiter = KeyLimiter(2)
    assert limiter.acquire(0) and limiter.acquire(0) and not limiter.acquire(0)
    assert limiter.acquire(1) and limiter.num_active() == 3
    limiter.release(0)
    assert limiter.acquire(0) and limiter.num_active(0) == 2
    unlimited = KeyLimiter(0)
    assert all(unlimited.acquire(0) for _ in range(1000))


# ---- limits --------------------------------------------------------------------------------------
def test_body_size_limit(make_cluster):
    _, server = make_cluster(security={"api_keys": KEYS}, max_body_bytes=2048)
    big = b'{"prompt": "' + b"x" * 4000 + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, headers=bearer(KEYS[0]))
    error = assert_error(r, 413, "body_too_large")
    assert "Content-Length is 4014" in error["message"] and "2048 bytes" in error["message"]

    def chunked():  # no Content-Length: the bytes read are counted
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers=bearer(KEYS[0]))
    assert "more than 2048 bytes" in assert_error(r, 413, "body_too_large")["message"]
    under = {"prompt": "x", "max_tokens": 2, "user": "u" * 1500}
    assert post(server, under).status_code == 200
    assert metric(server, "duet_rejections_total", reason="body_too_large") == 2


def test_prompt_and_max_tokens_limits(make_cluster):
    _, server = make_cluster(security={"api_keys": KEYS}, max_prompt_tokens=8, max_tokens_limit=32)
    long_prompt = "one two three four five six seven eight nine ten eleven"
    error = assert_error(post(server, {"prompt": long_prompt}), 400, "prompt_too_long")
    assert "at most 8" in error["message"] and error["param"] == "prompt"
    chat = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2}
    assert_error(post(server, chat, path="/v1/chat/completions"), 400, "prompt_too_long")
    assert post(server, {"prompt": "one two", "max_tokens": 32}).status_code == 200
    error = assert_error(post(server, {"prompt": "one", "max_tokens": 33}), 400)
    assert "[1, 32]" in error["message"] and error["param"] == "max_tokens"
    assert metric(server, "duet_rejections_total", reason="prompt_too_long") == 2


@pytest.mark.parametrize("keys", [KEYS, ()], ids=["keys", "open"])
def test_per_key_concurrency_429_and_release_on_disconnect(make_cluster, keys):
    """A stream held open by a slow decode takes the key's only slot: the key's next request is
    a 429, another key is served; the client hangs up and the slot comes back. Without keys,
    every client shares one anonymous slot count."""
    fakes, server = make_cluster(security={"api_keys": keys}, max_concurrent_per_key=1)
    fakes.token_interval_s = 3600.0  # after the first token the decode node goes quiet
    limiter = server.app.state.limiter
    key = keys[0] if keys else None
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100, "stream": True}
    headers = bearer(key) if key else {}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=chat, headers=headers, timeout=10
    ) as held:
        lines = held.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk: the request is running
        assert limiter.num_active() == 1
        r = post(server, {"prompt": "Hi", "max_tokens": 1}, key=key)
        error = assert_error(r, 429, "too_many_requests")
        assert "at most 1 unfinished" in error["message"] and error["type"] == "rate_limit_error"
        assert r.headers["retry-after"] == "1"
        if keys:  # another key has its own slots
            assert post(server, {"prompt": "Hi", "max_tokens": 1}, key=keys[1]).status_code == 200
    # leaving the block hung up mid-stream: the router aborts the request, the slot comes back
    assert wait_for(lambda: limiter.num_active() == 0)
    assert post(server, {"prompt": "Hi", "max_tokens": 1}, key=key).status_code == 200
    assert metric(server, "duet_rejections_total", reason="too_many_per_key") == 1


def test_per_key_slot_released_after_completion_and_errors(make_cluster):
    """The slot is given back before the last byte of a response leaves, so the next request
    right after any response finds it free: no waiting, no race."""
    fakes, server = make_cluster(security={"api_keys": KEYS}, max_concurrent_per_key=1)
    limiter = server.app.state.limiter
    for stream in (False, True, False, True):
        r = post(server, {"prompt": "Hi", "max_tokens": 4, "stream": stream})
        assert r.status_code == 200 and limiter.num_active() == 0
    fakes.fail_stages.add("decode")  # a node fails the request mid-way
    assert_error(post(server, {"prompt": "Hi", "max_tokens": 4}), 500, "failed_at_decode")
    assert limiter.num_active() == 0
    r = post(server, {"prompt": "Hi", "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and "fake decode failure" in r.text
    assert limiter.num_active() == 0
    fakes.fail_stages.clear()
    fakes.refuse.add("d0")  # refused before starting: 503
    assert_error(post(server, {"prompt": "Hi"}), 503)
    fakes.refuse.clear()
    assert_error(post(server, {"prompt": "Hi", "max_tokens": 0}), 400)  # refused by validation
    assert_error(post(server, {"prompt": "Hi", "stop": 5}), 422)
    assert limiter.num_active() == 0
    assert post(server, {"prompt": "Hi", "max_tokens": 2}).status_code == 200

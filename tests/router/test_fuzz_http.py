"""HTTP fuzzing of the gateway over fake nodes: generated requests across every endpoint (raw
bytes, invalid UTF-8, recursive JSON, OpenAI fields with wrong types and absurd values, unknown
fields, deep nesting, unicode edge cases, odd methods and paths; tools, tool choices, template
kwargs, n > 1, structured output, the Responses API) never get a 5xx while the nodes are
healthy, and the router serves a valid request afterwards with nothing left held.

The count is `DUET_FUZZ_EXAMPLES` (total over this module, default 400: under a minute); the
full run is `DUET_FUZZ_EXAMPLES=10000 python -m pytest tests/router/test_fuzz_http.py`.
Generation is derandomized (seeded from each test's source, no example database): two runs of
one tree send the same requests.
"""

import collections
import dataclasses
import os
import time

import httpx
import pytest
from http_fuzz import (
    check_response,
    json_document_requests,
    nesting_and_unicode_requests,
    openai_requests,
    raw_requests,
)
from hypothesis import HealthCheck, given, settings
from router_fakes import FakeCluster, RouterServer, fake_config

from control.tokenizer import Tokenizer
from tinymodel.make import ensure_tiny_model

NUM_EXAMPLES = int(os.environ.get("DUET_FUZZ_EXAMPLES", "400"))
SHARES = {"raw": 0.2, "json": 0.2, "openai": 0.45, "nesting": 0.15}
KEYS = ["fuzz-key-1", "fuzz-key-2"]
STATS = {"requests": 0, "statuses": collections.Counter(), "seconds": 0.0}


@pytest.fixture(scope="module")
def cluster():
    """Fake nodes that answer at once (tokens without delay) and a router with keys and every
    limit set, so both rejections and full completions are exercised."""
    cfg = fake_config(
        reasoning_parser="deepseek_r1",  # the chat and Responses paths with both parsers on
        tool_parser="hermes",
        max_tokens_limit=16,
        max_body_bytes=1024 * 1024,
        max_prompt_tokens=128,
        max_concurrent_per_key=4,
    )
    cfg = dataclasses.replace(
        cfg,
        security=dataclasses.replace(cfg.security, api_keys=tuple(KEYS)),
        decode=tuple(dataclasses.replace(d, num_pages=256) for d in cfg.decode),
    )
    model_dir = str(ensure_tiny_model())
    tok = Tokenizer(model_dir)
    fakes = FakeCluster(cfg, tok.encode("Fuzzing never ends."), eos_id=tok.eos_token_ids[0])
    fakes.token_interval_s = 0.0
    fakes.start()
    server = RouterServer(cfg, model_dir)
    server.start()
    # A connection per request: a kept-alive one can be closed by the server's idle timeout just
    # as the next request goes out on it (a reset that is the client's race, not the server's).
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=server.url, timeout=30, limits=no_reuse) as client:
        yield fakes, server, client
    server.stop()
    fakes.stop()


def _settings(share: str):
    return settings(
        max_examples=max(1, int(NUM_EXAMPLES * SHARES[share])),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


def _send_and_check(client, req) -> None:
    t0 = time.monotonic()
    resp = req.send(client)
    STATS["seconds"] += time.monotonic() - t0
    STATS["requests"] += 1
    STATS["statuses"][resp.status_code] += 1
    check_response(req, resp)


def _assert_still_serving(cluster) -> None:
    fakes, server, client = cluster
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    body = {"model": "tiny-model", "prompt": "still alive?", "max_tokens": 4}
    r = client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert client.get("/health").json()["status"] == "ok"
    assert server.app.state.limiter.num_active() == 0  # every slot came back
    assert not server.router.requests  # nothing left unfinished in the router


def test_a_valid_n_2_request_completes_over_the_fakes(cluster):
    """n = 2 is a valid value the fuzzer also sends: the fakes fork it (FirstToken with the
    fork's first token, each fork decoding on its own), so it ends with two choices, not a
    5xx (which, before the fakes forked, only a 429 from the concurrency limit could hide)."""
    _, _, client = cluster
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    body = {"messages": [{"role": "user", "content": ""}], "n": 2, "max_tokens": 3}
    r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1]
    _assert_still_serving(cluster)


def test_fuzz_raw_requests(cluster):
    @_settings("raw")
    @given(req=raw_requests(KEYS))
    def run(req):
        _send_and_check(cluster[2], req)

    run()
    _assert_still_serving(cluster)


def test_fuzz_json_documents(cluster):
    @_settings("json")
    @given(req=json_document_requests(KEYS))
    def run(req):
        _send_and_check(cluster[2], req)

    run()
    _assert_still_serving(cluster)


def test_fuzz_openai_fields(cluster):
    @_settings("openai")
    @given(req=openai_requests(KEYS))
    def run(req):
        _send_and_check(cluster[2], req)

    run()
    _assert_still_serving(cluster)


def test_fuzz_nesting_and_unicode(cluster):
    @_settings("nesting")
    @given(req=nesting_and_unicode_requests(KEYS))
    def run(req):
        _send_and_check(cluster[2], req)

    run()
    _assert_still_serving(cluster)


def test_cluster_healthy_after_fuzz(cluster):
    fakes, server, _ = cluster
    _assert_still_serving(cluster)
    assert fakes.used_pages("d0") == 0  # no reservation leaked on the decode node
    statuses = dict(sorted(STATS["statuses"].items()))
    print(
        f"\nfuzz: {STATS['requests']} requests in {STATS['seconds']:.1f} s of HTTP time; "
        f"statuses {statuses}"
    )
    assert STATS["requests"] >= NUM_EXAMPLES * 0.9
    assert 200 in statuses and all(s < 500 for s in statuses)

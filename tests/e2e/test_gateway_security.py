"""End to end: API keys at a real cluster's gateway (`duet up --config` with `[security]
api_key_file`), and a burst of fuzzed requests against the real router and nodes, after which
the cluster still serves and is healthy."""

import time

import httpx
import openai
import pytest
from e2e_helpers import cluster_shorthand, start_cluster
from http_fuzz import (
    check_response,
    fuzz_settings,
    json_document_requests,
    nesting_and_unicode_requests,
    openai_requests,
    raw_requests,
)
from hypothesis import given
from hypothesis import strategies as st

from deploy.local_cluster import dump_toml

KEY = "sk-e2e-right-key"
NUM_FUZZ = 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("keys")
    key_file = workdir / "api_keys.txt"
    key_file.write_text(f"# the e2e client's key\n\n{KEY}\n")
    raw = cluster_shorthand(1, 1)
    raw["router"].update(max_tokens_limit=16, max_prompt_tokens=128, max_body_bytes=1 << 20)
    raw["security"] = {"api_key_file": str(key_file)}
    config = workdir / "cluster.toml"
    config.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(config)], tmp_path_factory)
    yield up
    up.stop()


def _client(cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_openai_client_with_right_and_wrong_key(cluster):
    good = _client(cluster, KEY)
    assert [m.id for m in good.models.list().data] == ["tiny-model"]
    out = good.completions.create(model="tiny-model", prompt="Hello", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    chat = good.chat.completions.create(
        model="tiny-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.choices[0].message.role == "assistant"
    bad = _client(cluster, "sk-e2e-wrong-key")
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny-model", prompt="Hello", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(cluster.url + "/health", timeout=10).json()["status"] == "ok"  # no key
    assert cluster.metric("duet_rejections_total", reason="unauthorized") == 3


def test_fuzz_burst_then_still_serving(cluster):
    keys = [KEY]
    requests = st.one_of(
        raw_requests(keys),
        json_document_requests(keys),
        openai_requests(keys),
        nesting_and_unicode_requests(keys),
    )
    statuses = []
    with httpx.Client(base_url=cluster.url, timeout=120) as http:

        @fuzz_settings(NUM_FUZZ)
        @given(req=requests)
        def run(req):
            resp = req.send(http)
            statuses.append(resp.status_code)
            check_response(req, resp)

        run()
    assert len(statuses) >= NUM_FUZZ and 200 in statuses
    out = _client(cluster, KEY).completions.create(
        model="tiny-model", prompt="Still there?", max_tokens=4, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    health = httpx.get(cluster.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and all(
        n["status"] == "ready" for n in health["nodes"].values()
    )
    used = lambda: cluster.metric("duet_kv_pages_used", node="decode-0", role="decode")  # noqa: E731
    deadline = time.monotonic() + 10  # the figure comes with the node's next heartbeat
    while used() != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert used() == 0, "decode pages still held after the burst"

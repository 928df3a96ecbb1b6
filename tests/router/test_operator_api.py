"""The operator's view against fake nodes (no model): `GET /v1/cluster`, `duet status` (table,
--json, an unreachable router, API keys), the `x-request-id` header and the router's one JSON
log line per request end."""

import dataclasses
import json
import logging
import threading

import httpx
import pytest
from router_fakes import fake_config, start_cluster, stop_all, wait_for

from control.cluster_config import ClusterConfig, SecurityConfig
from control.version import package_version
from deploy.cli import main as duet
from deploy.local_cluster import dump_toml, free_port

SCRIPT_TEXT = "The quick brown fox jumps over the lazy dog, again and again and again."
API_KEY = "operator-key-1"


@pytest.fixture
def make_cluster(model_dir, tok):
    """make_cluster(num_prefill, num_decode, api_keys=()) -> (cfg, FakeCluster, RouterServer)."""
    started = []

    def factory(num_prefill=1, num_decode=1, api_keys=()):
        cfg = fake_config(num_prefill, num_decode)
        cfg = dataclasses.replace(cfg, security=SecurityConfig(api_keys=tuple(api_keys)))
        ids, eos = tok.encode(SCRIPT_TEXT), tok.eos_token_ids[0]
        fakes, server = start_cluster(cfg, ids, eos, model_dir, started)
        # healthy once one node of each role is ready: wait for all of them
        assert wait_for(lambda: httpx.get(server.url + "/health").json()["status"] == "ok")
        return cfg, fakes, server

    yield factory
    stop_all(started)


def write_toml(cfg: ClusterConfig, path) -> str:
    """The config as a TOML file (what `duet status --config` reads)."""
    raw = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    path.write_text(dump_toml(raw))
    assert ClusterConfig.load(path) == cfg
    return str(path)


def cluster_json(server, **headers) -> dict:
    r = httpx.get(server.url + "/v1/cluster", headers=headers, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def slow_stream(server, fakes, **headers):
    """A streamed completion held open for a while (the caller closes it)."""
    fakes.token_interval_s = 0.05
    body = {"prompt": "x", "max_tokens": 200, "stream": True}
    return httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=10
    )


# ---- GET /v1/cluster ---------------------------------------------------------------------------
def test_cluster_lists_every_configured_node_with_pages_from_heartbeats(make_cluster):
    cfg, fakes, server = make_cluster(num_prefill=2)
    view = cluster_json(server)
    assert view["version"] == package_version() and view["ratio"] == "2P1D"
    assert view["is_serving"] is True
    assert view["router"]["url"] == server.url
    nodes = {n["name"]: n for n in view["nodes"]}
    assert [n["name"] for n in view["nodes"]] == ["p0", "p1", "d0"]
    for node in (*cfg.prefill, *cfg.decode):
        entry = nodes[node.name]
        assert entry["address"] == node.control_endpoint
        assert entry["status"] == "ready" and entry["error"] is None
        assert entry["threads"] == node.threads and entry["device"] == "cpu"
        assert entry["quantization"] == "bf16" and entry["draining"] is False
        assert entry["lm_head"] == "none"  # quant_lm_head is off by default
        assert entry["attention"] == "none"  # quant_attention unset: quant's, "none"
        # a fresh age: a node silent past node_timeout_s (+ a watchdog period) would be dead
        assert 0 <= entry["last_heartbeat_s"] < cfg.timeouts.node_timeout_s + 0.5
    assert [nodes[p]["role"] for p in ("p0", "p1", "d0")] == ["prefill", "prefill", "decode"]
    assert nodes["d0"]["kv_endpoint"] == cfg.decode[0].kv_endpoint
    assert nodes["p0"]["kv_endpoint"] is None and nodes["p0"]["kv_pages"] is None
    assert nodes["d0"]["kv_pages"] == {"used": 0, "free": 64, "total": 64}
    assert nodes["d0"]["page_size"] == 16 and nodes["d0"]["ranks"] == 1

    with slow_stream(server, fakes) as r:
        lines = r.iter_lines()
        next(lines)  # the request runs: its pages are reserved on d0
        used = fakes.used_pages("d0")
        assert used > 0

        def heartbeat_shows_pages():
            pages = {n["name"]: n for n in cluster_json(server)["nodes"]}["d0"]["kv_pages"]
            return pages == {"used": used, "free": 64 - used, "total": 64}

        assert wait_for(heartbeat_shows_pages)
        d0 = {n["name"]: n for n in cluster_json(server)["nodes"]}["d0"]
        assert d0["queue"]["running"] == 1 and d0["active"] == 1


def test_cluster_needs_the_api_key(make_cluster):
    _, _, server = make_cluster(api_keys=[API_KEY])
    r = httpx.get(server.url + "/v1/cluster", timeout=5)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert cluster_json(server, Authorization=f"Bearer {API_KEY}")["ratio"] == "1P1D"


# ---- duet status -------------------------------------------------------------------------------
def test_status_table_and_json(make_cluster, tmp_path, capsys):
    cfg, _, server = make_cluster(num_prefill=2)
    config = write_toml(cfg, tmp_path / "cluster.toml")
    assert duet(["status", "--config", config]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"duet-serve {package_version()}, router {server.url}: 2P1D")
    header, rows = lines[1].split(), [line.split() for line in lines[2:]]
    assert header[:4] == ["NAME", "ROLE", "STATUS", "ADDRESS"] and header[-1] == "VERSION"
    assert [row[:3] for row in rows] == [
        ["p0", "prefill", "ready"],
        ["p1", "prefill", "ready"],
        ["d0", "decode", "ready"],
    ]
    assert rows[2][3:5] == [cfg.decode[0].control_endpoint, cfg.decode[0].kv_endpoint]
    assert "0/64/64" in rows[2]
    # columns line up: every row's cells start where the header's do
    starts = [lines[1].index(h) for h in ("ROLE", "STATUS", "ADDRESS")]
    for line in lines[2:]:
        assert all(line[s - 2 : s] == "  " and line[s] != " " for s in starts)

    assert duet(["status", "--config", config, "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert [(n["name"], n["role"], n["status"]) for n in view["nodes"]] == [
        ("p0", "prefill", "ready"),
        ("p1", "prefill", "ready"),
        ("d0", "decode", "ready"),
    ]
    assert view["nodes"][2]["kv_pages"]["total"] == 64


def test_status_shows_a_dead_node_and_its_error(make_cluster, tmp_path, capsys):
    cfg, fakes, server = make_cluster(num_prefill=2)
    fakes.silent.add("p1")  # no more heartbeats: dead after node_timeout_s (0.8 s)

    def p1():
        return {n["name"]: n for n in cluster_json(server)["nodes"]}["p1"]

    assert wait_for(lambda: p1()["status"] == "dead")
    assert p1()["error"] and p1()["last_heartbeat_s"] > cfg.timeouts.node_timeout_s
    assert duet(["status", "--config", write_toml(cfg, tmp_path / "c.toml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[2:5]][1] == ["p1", "prefill", "dead"]
    assert lines[-1] == f"p1: {p1()['error']}"


def test_status_unreachable_router_is_one_line_and_exit_1(tmp_path, capsys):
    cfg = fake_config()  # nothing listens on its router port
    config = write_toml(cfg, tmp_path / "cluster.toml")
    assert duet(["status", "--config", config]) == 1
    out, err = capsys.readouterr()
    url = f"http://{cfg.router.host}:{cfg.router.port}"
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"error: cannot reach the router at {url}")
    assert duet(["status", "--config", config, "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert capsys.readouterr().err.startswith("error: cannot reach the router at http://127.0.0.1:")


def test_status_takes_the_configs_api_key_or_the_given_one(make_cluster, tmp_path, capsys):
    cfg, _, server = make_cluster(api_keys=[API_KEY])
    config = write_toml(cfg, tmp_path / "cluster.toml")
    assert duet(["status", "--config", config, "--json"]) == 0  # the config's key
    assert json.loads(capsys.readouterr().out)["ratio"] == "1P1D"
    assert duet(["status", "--config", config, "--api-key", "wrong"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused the API key (401)" in err


# ---- x-request-id ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_request_id_header_equals_the_body_id(make_cluster, path):
    _, _, server = make_cluster()
    chat = path.endswith("chat/completions")
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    r = httpx.post(server.url + path, json={**body, "max_tokens": 3}, timeout=10)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == r.json()["id"]
    assert r.json()["id"].startswith("chatcmpl-" if chat else "cmpl-")
    with httpx.stream(
        "POST", server.url + path, json={**body, "max_tokens": 3, "stream": True}, timeout=10
    ) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert {c["id"] for c in chunks} == {s.headers["x-request-id"]}


def test_client_request_id_is_used_and_checked(make_cluster):
    _, fakes, server = make_cluster()
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers={"x-request-id": "t-1"})
    assert r.json()["id"] == "cmpl-t-1" and r.headers["x-request-id"] == "cmpl-t-1"
    for bad in ("has space", "x" * 129, "a~1"):
        r = httpx.post(url, json={"prompt": "hi"}, headers={"x-request-id": bad}, timeout=5)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_id"
    with slow_stream(server, fakes, **{"x-request-id": "dup"}) as s:
        lines = s.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        r = httpx.post(url, json={"prompt": "hi"}, headers={"x-request-id": "dup"}, timeout=5)
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_request_id"
        assert r.headers["x-request-id"] == "cmpl-dup"
    # once it ended the id is free again
    assert wait_for(lambda: not server.router.requests)
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers={"x-request-id": "dup"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-dup"


# ---- the request-end log line ------------------------------------------------------------------
def request_lines(caplog, request_id: str) -> list[dict]:
    return [
        json.loads(r.getMessage())
        for r in caplog.records
        if r.name == "router.requests" and json.loads(r.getMessage())["request_id"] == request_id
    ]


def test_request_end_log_line_of_a_finished_request(make_cluster, caplog):
    caplog.set_level(logging.INFO, logger="router.requests")
    _, _, server = make_cluster()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5})
    out = r.json()
    assert wait_for(lambda: request_lines(caplog, out["id"]))
    (line,) = request_lines(caplog, out["id"])
    assert line["event"] == "request_end" and line["outcome"] == "finished"
    assert line["finish_reason"] == "length" and line["stage"] is None and line["error"] is None
    assert line["prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert line["completion_tokens"] == 5
    assert 0 < line["ttft_s"] <= line["e2e_s"] and line["tpot_s"] > 0
    assert (line["prefill_node"], line["decode_node"], line["migrations"]) == ("p0", "d0", 0)


def test_request_end_log_lines_of_aborted_and_failed_requests(make_cluster, caplog):
    caplog.set_level(logging.INFO, logger="router.requests")
    _, fakes, server = make_cluster()
    with slow_stream(server, fakes) as s:
        request_id = s.headers["x-request-id"]
        for i, _ in enumerate(s.iter_lines()):
            if i == 4:
                break  # closing the response drops the connection mid-stream
    assert wait_for(lambda: request_lines(caplog, request_id))
    (line,) = request_lines(caplog, request_id)
    assert line["outcome"] == "aborted" and line["stage"] == "client"
    assert line["finish_reason"] is None and line["completion_tokens"] >= 1
    assert line["ttft_s"] > 0 and line["e2e_s"] >= line["ttft_s"]
    assert (line["prefill_node"], line["decode_node"]) == ("p0", "d0")

    fakes.fail_stages.add("decode")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 500
    request_id = r.headers["x-request-id"]
    assert wait_for(lambda: request_lines(caplog, request_id))
    (line,) = request_lines(caplog, request_id)
    assert line["outcome"] == "failed" and line["stage"] == "decode"
    assert line["error"] == "fake decode failure"


def test_request_end_log_line_of_a_rejected_request(make_cluster, caplog):
    caplog.set_level(logging.INFO, logger="router.requests")
    _, fakes, server = make_cluster()
    fakes.refuse.add("d0")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 503
    request_id = r.headers["x-request-id"]
    (line,) = request_lines(caplog, request_id)
    assert line["outcome"] == "rejected" and line["stage"] == "admission"
    assert line["ttft_s"] is None and line["completion_tokens"] == 0


def test_log_lines_are_bare_json_when_configured(make_cluster):
    import io

    from router import request_log

    stream = io.StringIO()
    logger = logging.getLogger("router.requests")
    handlers, level = list(logger.handlers), logger.level
    request_log.configure(stream)
    try:
        _, _, server = make_cluster()
        ids = []

        def post():
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
            ids.append(r.json()["id"])

        threads = [threading.Thread(target=post) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wait_for(lambda: stream.getvalue().count("\n") == 3)
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = True
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert sorted(r["request_id"] for r in records) == sorted(ids)


def test_status_names_an_int8_lm_head_beside_the_weights():
    from deploy.status import render

    node = dict(name="d0", role="decode", status="ready", address="a", kv_endpoint="k")
    node.update(device="cpu", threads=1, quantization="int8", lm_head="int8", page_size=16)
    node.update(ranks=1, kv_pages=None, error=None, draining=False, last_heartbeat_s=0.1)
    node.update(queue={"waiting": 0, "running": 0, "queued_tokens": None}, version="v")
    view = dict(version="v", router={"url": "u"}, ratio="0P1D", dtype="bfloat16")
    view.update(is_serving=True, nodes=[node, {**node, "name": "d1", "lm_head": "none"}])
    with_head, without = render(view).splitlines()[2:]
    assert " int8+int8 head " in with_head
    assert " int8 " in without and "head" not in without


def test_status_names_an_attention_scheme_apart_from_the_default():
    """The WEIGHTS column adds the attention projections' scheme where it is not the node's
    `quant`'s default ("int8" under "int4", else `quant` itself)."""
    from deploy.status import render

    node = dict(name="d0", role="decode", status="ready", address="a", kv_endpoint="k")
    node.update(device="cpu", threads=1, quantization="int4", lm_head="none", page_size=16)
    node.update(ranks=1, kv_pages=None, error=None, draining=False, last_heartbeat_s=0.1)
    node.update(queue={"waiting": 0, "running": 0, "queued_tokens": None}, version="v")
    nodes = [
        {**node, "attention": "none", "dtype": "bfloat16"},
        {**node, "name": "d1", "attention": "int8"},
        {**node, "name": "d2", "attention": "int4", "lm_head": "int8"},
        {**node, "name": "d3", "quantization": "bf16", "attention": "int8"},
    ]
    view = dict(version="v", router={"url": "u"}, ratio="0P4D", dtype="bfloat16")
    view.update(is_serving=True, nodes=nodes)
    rows = render(view).splitlines()[2:]
    assert " int4+bf16 attn " in rows[0]
    assert " int4 " in rows[1] and "attn" not in rows[1]
    assert " int4+int4 attn+int8 head " in rows[2]
    assert " bf16+int8 attn " in rows[3]

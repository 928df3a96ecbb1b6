"""The operator's view of a real 2P1D `duet up`: `duet status` (a subprocess, reading the router
address from the cluster's TOML) lists three ready nodes; every metric the Grafana dashboard
reads is in the live /metrics; a request's id is in its response header, in the router's JSON
request-end line and in the decode node's abort line."""

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from e2e_helpers import free_port, free_port_pair, start_cluster, wait_until

from control.version import package_version
from deploy.grafana import load_dashboard, missing_metrics
from deploy.local_cluster import dump_toml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """deploy/configs/2p1d.toml on free loopback ports; `up.config` is the TOML `duet up`
    wrote for its children (the port it was given included)."""
    raw = tomllib.loads((DEPLOY / "configs" / "2p1d.toml").read_text())
    raw["router"]["control_port"] = free_port()
    raw["prefill"][0]["control_port"] = free_port_pair()
    raw["decode"][0].update(name="decode-0", control_port=free_port(), kv_port=free_port())
    config = tmp_path_factory.mktemp("cfg") / "2p1d.toml"
    config.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(config)], tmp_path_factory)
    up.config = re.search(r"duet up: \S+ cluster, config (\S+)", up.log()).group(1)
    r = httpx.post(
        up.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120
    )
    assert r.status_code == 200  # the histograms have samples from here on
    # the decode node's heartbeat after that request shows its pages free again
    used = lambda: up.metric("duet_kv_pages_used", node="decode-0", role="decode")  # noqa: E731
    assert wait_until(lambda: used() == 0, 30)
    yield up
    up.stop()


def duet_status(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "deploy.cli", "status", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_status_lists_three_ready_nodes(cluster):
    done = duet_status("--config", cluster.config, "--json")
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["ratio"] == "2P1D" and view["is_serving"] and view["router"]["url"] == cluster.url
    nodes = [(n["name"], n["role"], n["status"]) for n in view["nodes"]]
    assert nodes == [
        ("prefill-0", "prefill", "ready"),
        ("prefill-1", "prefill", "ready"),
        ("decode-0", "decode", "ready"),
    ]
    for node in view["nodes"]:
        assert node["version"] == package_version() and node["quantization"] == "bf16"
        assert node["last_heartbeat_s"] is not None and node["last_heartbeat_s"] < 5
    decode = view["nodes"][2]
    assert decode["kv_pages"]["total"] == 2048 and decode["kv_pages"]["used"] == 0
    assert decode["kv_endpoint"].startswith("tcp://127.0.0.1:")

    table = duet_status("--config", cluster.config)
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()[2:]
    assert [row.split()[:3] for row in rows] == [list(n) for n in nodes]


def test_dashboard_metrics_are_all_in_the_live_metrics(cluster):
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    assert missing_metrics(load_dashboard(), text) == {}


def test_request_id_in_header_router_log_and_decode_log(cluster):
    body = {"prompt": "Tell me a story", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as r:
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # decoding: then the client goes away
    assert request_id.startswith("cmpl-")

    def router_line():
        for line in cluster.log().splitlines():
            if line.startswith("{") and request_id in line:
                return json.loads(line)
        return None

    assert wait_until(router_line, 30), cluster.log()[-3000:]
    record = router_line()
    assert record["outcome"] == "aborted" and record["decode_node"] == "decode-0"
    assert record["prefill_node"] in ("prefill-0", "prefill-1")
    assert wait_until(
        lambda: re.search(rf"decode-0 INFO request {request_id}: aborted", cluster.log()), 30
    ), cluster.log()[-3000:]

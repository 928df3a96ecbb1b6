"""SLA admission through HTTP on a real local 1P1D cluster (tiny model): with a TTFT SLA no
prefill can meet and `admission = "reject"` the router answers 503 with Retry-After and an
OpenAI error body naming the SLA; nothing reaches the nodes, and /metrics counts the refusal."""

from pathlib import Path

import httpx
import pytest
from e2e_helpers import free_port, start_cluster, wait_until

from deploy.local_cluster import dump_toml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    raw = tomllib.loads((DEPLOY / "configs" / "1p1d.toml").read_text())
    raw["sla"].update(ttft_ms=0.001, admission="reject")
    raw["router"]["control_port"] = free_port()
    raw["prefill"][0]["control_port"] = free_port()
    raw["decode"][0].update(control_port=free_port(), kv_port=free_port())
    config = tmp_path_factory.mktemp("cfg") / "1p1d-sla.toml"
    config.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(config)], tmp_path_factory)
    yield up
    up.stop()


def test_a_ttft_sla_no_node_can_meet_is_rejected_with_503(cluster):
    before = cluster.metric("duet_rejections_total", reason="sla")
    r = httpx.post(
        cluster.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60
    )
    assert r.status_code == 503
    assert int(r.headers["Retry-After"]) >= 1
    error = r.json()["error"]
    assert error["code"] == "sla_unmet"
    assert "TTFT SLA cannot be met now" in error["message"]
    assert "ttft_ms = 0.001" in error["message"]
    assert "predicted time to first token" in error["message"]
    assert cluster.metric("duet_rejections_total", reason="sla") == before + 1
    # Nothing was dispatched: the nodes never saw the request.
    assert cluster.metric("duet_node_requests_total", node="prefill", role="prefill") == 0
    # The nodes are fine and keep reporting (the refusal is the SLA's, not a fault).
    assert wait_until(lambda: cluster.metric("duet_node_up", node="prefill", role="prefill"), 30)

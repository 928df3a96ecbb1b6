"""deploy/probe.py against stand-ins on loopback: listening sockets for `live`, a fake router's
/health for `ready` and `router-live`, and the pod-name lookup of the node. (A real cluster:
tests/e2e/test_probe_cluster.py.)"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from control.cluster_config import ClusterConfig, RouterConfig
from control.errors import ConfigError
from deploy import probe
from deploy.k8s_cluster import cluster_toml, k8s_cluster
from deploy.local_cluster import dump_toml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeRouter:
    """GET /health answers `status` with `body` (JSON) on a loopback port."""

    def __init__(self):
        self.status, self.body = 200, {"status": "ok", "nodes": {}}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                data = json.dumps(fake.body).encode() if fake.body is not None else b"<html>"
                self.send_response(fake.status if self.path == "/health" else 404)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_router():
    router = FakeRouter()
    yield router
    router.close()


def _config(tmp_path, router_port: int, control: int, kv: int, prefill: int) -> str:
    raw = {
        "router": {"port": router_port, "control_port": _closed_port()},
        "prefill": [{"name": "p", "control_port": prefill}],
        "decode": [{"name": "d", "control_port": control, "kv_port": kv}],
    }
    path = tmp_path / "cluster.toml"
    path.write_text(dump_toml(raw))
    return str(path)


def _run(capsys, *argv) -> tuple[int, str]:
    status = probe.main(list(argv))
    return status, capsys.readouterr().out.strip()


def test_live_needs_every_socket_of_the_node(tmp_path, capsys):
    control, kv = _listener(), _listener()
    config = _config(tmp_path, _closed_port(), control.getsockname()[1], kv.getsockname()[1], 1)
    assert _run(capsys, "--config", config, "--node", "d", "live")[0] == 0
    kv.close()  # the KV receiver gone, the control socket still there: not alive
    status, out = _run(capsys, "--config", config, "--node", "d", "live")
    assert status == 1 and out.startswith("failed: node d: nothing accepts on 127.0.0.1:")
    control.close()


@pytest.mark.parametrize(
    "entry,status,verdict",
    [
        ({"status": "ready"}, 200, 0),
        ({"status": "ready"}, 503, 0),  # the router lacks a pair, this node is fine
        ({"status": "draining"}, 200, "the router reports it draining"),
        ({"status": "dead", "error": "no heartbeat for 5 s"}, 503, "dead (no heartbeat for 5 s)"),
        ({"status": "starting"}, 503, "reports it starting"),
        (None, 200, "the router does not list it"),
    ],
)
def test_ready_is_the_routers_view_of_the_node(
    tmp_path, capsys, fake_router, entry, status, verdict
):
    config = _config(tmp_path, fake_router.port, 1, 2, 3)
    fake_router.status = status
    fake_router.body = {
        "status": "x",
        "nodes": {"d": entry} if entry else {"p": {"status": "ready"}},
    }
    code, out = _run(capsys, "--config", config, "--node", "d", "ready")
    if verdict == 0:
        assert code == 0 and out == "node d: ready"
    else:
        assert code == 1 and out.startswith("failed: node d: ") and verdict in out


def test_ready_fails_without_a_router(tmp_path, capsys):
    config = _config(tmp_path, _closed_port(), 1, 2, 3)
    code, out = _run(capsys, "--config", config, "--node", "p", "ready")
    assert code == 1 and "does not answer" in out


def test_router_live_is_any_answer_from_health(tmp_path, capsys, fake_router):
    config = _config(tmp_path, fake_router.port, 1, 2, 3)
    for status in (200, 503):
        fake_router.status = status
        assert _run(capsys, "--config", config, "router-live")[0] == 0
    fake_router.body = None  # not JSON: still an answer
    assert _run(capsys, "--config", config, "router-live")[0] == 0
    fake_router.close()
    code, out = _run(capsys, "--config", config, "router-live")
    assert code == 1 and "does not answer" in out


def test_bad_config_or_node_is_status_2(tmp_path, capsys):
    assert _run(capsys, "--config", str(tmp_path / "missing.toml"), "live")[0] == 2
    config = _config(tmp_path, 1, 2, 3, 4)
    code, out = _run(capsys, "--config", config, "--node", "nope", "live")
    assert code == 2 and out.startswith("error: ")


def test_the_node_is_found_by_the_pods_hostname():
    raw = {"prefill": [{"name": "p", "replicas": 2}], "decode": [{"name": "decode"}]}
    text = cluster_toml(k8s_cluster(ClusterConfig.from_dict(raw), "ns"), "test")
    cluster = ClusterConfig.from_dict(tomllib.loads(text))  # as the pod reads it
    assert probe.find_node(cluster, "p-1").name == "p-1"
    assert probe.find_node(cluster, "decode-0").name == "decode"  # one pod serves node "decode"
    with pytest.raises(ConfigError, match="named after this pod"):
        probe.find_node(cluster, "decode-1")


@pytest.mark.parametrize(
    "bind,host,expected",
    [
        ("0.0.0.0", "router.ns.svc", "127.0.0.1"),
        ("", "10.1.2.3", "10.1.2.3"),
        ("10.0.0.5", "router.ns.svc", "10.0.0.5"),
    ],
)
def test_local_sockets_are_reached_on_the_bind_address(bind, host, expected):
    assert probe.local_host(RouterConfig(host=host, bind_host=bind)) == expected

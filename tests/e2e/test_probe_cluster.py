"""The Kubernetes probes (`python -m deploy.probe`, deploy/k8s) against a real `duet up` 1P1D
cluster: every check passes on a serving cluster; a hung node (SIGSTOP) stays `live` (the
kernel still accepts its connections: the documented limit of that check) but stops being
`ready` once the router declares it dead, and is `ready` again after SIGCONT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from e2e_helpers import free_port, start_cluster, wait_until

from deploy.local_cluster import dump_toml

NODE_TIMEOUT_S = 2.0  # the router declares a silent node dead after this long


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(the running `duet up`, the path of a TOML that names its real addresses)."""
    raw = {
        "timeouts": {"node_timeout_s": NODE_TIMEOUT_S},
        "router": {"host": "127.0.0.1", "control_port": free_port()},
        "prefill": [{"name": "prefill", "control_port": free_port()}],
        "decode": [{"name": "decode", "control_port": free_port(), "kv_port": free_port()}],
    }
    work = tmp_path_factory.mktemp("probe")
    (work / "up.toml").write_text(dump_toml(raw))
    up = start_cluster(["--config", str(work / "up.toml")], tmp_path_factory)
    raw["router"]["port"] = up.port  # `duet up --port` moved the HTTP port
    (work / "probe.toml").write_text(dump_toml(raw))
    yield up, str(work / "probe.toml")
    up.stop()


def _probe(config: str, check: str, node: str | None = None) -> subprocess.CompletedProcess:
    """The probe as the kubelet runs it: a fresh process, its exit status and its one line."""
    argv = [sys.executable, "-m", "deploy.probe", "--config", config, check]
    if node:
        argv += ["--node", node]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def test_every_probe_passes_on_a_serving_cluster(cluster):
    up, config = cluster
    assert wait_until(lambda: _probe(config, "ready", "decode").returncode == 0, 60)
    for node in ("prefill", "decode"):
        for check in ("live", "ready"):
            result = _probe(config, check, node)
            assert result.returncode == 0, result.stdout + result.stderr
    assert _probe(config, "router-live").returncode == 0


def test_a_hung_node_stays_live_but_is_not_ready(cluster):
    up, config = cluster
    pid = up.child_pids["decode"]
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: _probe(config, "ready", "decode").returncode == 1, 30)
        result = _probe(config, "ready", "decode")
        assert "the router reports it dead" in result.stdout
        assert _probe(config, "live", "decode").returncode == 0  # what `live` cannot see
        assert _probe(config, "ready", "prefill").returncode == 0
        assert _probe(config, "router-live").returncode == 0  # /health answers 503: alive
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: _probe(config, "ready", "decode").returncode == 0, 60)

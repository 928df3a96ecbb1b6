"""Nodes that join a running `duet up` cluster and leave it (`duet node`, router.membership):
a decode node that is not in the config joins, is listed in /v1/cluster, gets the request that
comes while the configured one is busy (its output is `duet generate`'s), drains on SIGTERM and
is forgotten; a node with another KV
layout (a float32 cluster config against a bfloat16 cluster) is refused, with the reason in
the router's log and in its own, and stops."""

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from e2e_helpers import free_port, generate_reference, start_cluster, wait_until

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from deploy.local_cluster import dump_toml

PROMPT = "Once upon a time there was"
MAX_NEW = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    up = start_cluster(["--prefill", "1", "--decode", "1", "--threads", "1"], tmp_path_factory)
    up.config = Path(re.search(r"config (\S+cluster\.toml)", up.log()).group(1))
    yield up
    up.stop()


def _join(config: Path, name: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deploy.cli", "node", "--role", "decode", "--config"]
    cmd += [str(config), "--name", name, "--control-port", str(free_port())]
    cmd += ["--kv-port", str(free_port())]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115


def _nodes(cluster) -> dict[str, dict]:
    body = httpx.get(cluster.url + "/v1/cluster", timeout=10).json()
    return {n["name"]: n for n in body["nodes"]}


def _complete(cluster, prompt=PROMPT) -> str:
    out = cluster.client().completions.create(
        model="tiny-model", prompt=prompt, max_tokens=MAX_NEW, temperature=0.0
    )
    return out.choices[0].text


def test_a_node_joins_serves_drains_and_is_forgotten(cluster, tmp_path):
    proc = _join(cluster.config, "decode-j", tmp_path / "join.log")
    try:
        assert wait_until(lambda: _nodes(cluster).get("decode-j", {}).get("status") == "ready", 120)
        entry = _nodes(cluster)["decode-j"]
        assert entry["joined"] is True and entry["role"] == "decode"
        want = generate_reference("bfloat16", MAX_NEW, prompt=PROMPT, extra=("--threads", "1"))
        # A long stream holds pages on decode-0 (equal nodes go by name): the next request
        # finds more room on the joined node. (The stream decodes 400 tokens while that one
        # goes through: the margin grows with a slower machine, as both slow down alike.)
        stream = cluster.client().completions.create(
            model="tiny-model",
            prompt="hold on",
            max_tokens=400,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            next(iter(stream))  # it is decoding on decode-0 now
            assert _complete(cluster) == want["text"]
        finally:
            stream.close()
        served = lambda node: cluster.metric("duet_node_requests_total", node=node, role="decode")  # noqa: E731
        assert (served("decode-0"), served("decode-j")) == (1, 1)
        proc.terminate()  # SIGTERM: drain, then stop
        assert proc.wait(timeout=60) == 0
        assert wait_until(lambda: "decode-j" not in _nodes(cluster), 30)
        assert _complete(cluster) == want["text"]  # the configured nodes serve on
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "node decode-j (decode) joined" in cluster.log()
    assert "node decode-j (decode) left the cluster" in cluster.log()


def test_a_node_of_another_kv_layout_is_refused(cluster, tmp_path):
    raw = tomllib.loads(cluster.config.read_text())
    raw["dtype"] = "float32"  # its KV rows would be float32: no bfloat16 node could take them
    other = tmp_path / "float32.toml"
    other.write_text(dump_toml(raw))
    log = tmp_path / "refused.log"
    proc = _join(other, "decode-f32", log)
    try:
        assert proc.wait(timeout=120) == 0  # it stops when told
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "the router refused this node" in log.read_text()
    assert "node decode-f32 (decode) may not join" in cluster.log()
    assert "decode-f32" not in _nodes(cluster)

"""`duet up` config handling and the launch scripts' command lines (no cluster is started)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from control.cluster_config import ClusterConfig
from control.errors import ConfigError
from deploy.local_cluster import dump_toml, parse_args, resolve_config
from tinymodel.make import ensure_tiny_model

try:
    import tomllib
except ModuleNotFoundError:
    import tomli as tomllib

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _load(raw: dict) -> ClusterConfig:
    return ClusterConfig.from_dict(tomllib.loads(dump_toml(raw)))  # through the written file


def test_shorthand_builds_xpyd_on_distinct_ports():
    raw = resolve_config(parse_args(["--prefill", "2", "--decode", "3", "--port", "18080"]))
    cfg = _load(raw)
    assert cfg.ratio == "2P3D" and cfg.router.port == 18080
    assert cfg.model == str(ensure_tiny_model()) and cfg.dtype == "bfloat16"
    assert [n.name for n in cfg.prefill] == ["prefill-0", "prefill-1"]
    ports = [cfg.router.control_port, *(n.control_port for n in (*cfg.prefill, *cfg.decode))]
    ports += [n.kv_port for n in cfg.decode]
    assert len(set(ports)) == len(ports)


def test_config_file_with_overrides_keeps_replicas():
    args = ["--config", str(DEPLOY / "configs" / "2p1d.toml"), "--port", "18081", "--dtype",
            "float32"]  # fmt: skip
    cfg = _load(resolve_config(parse_args(args)))
    assert cfg.ratio == "2P1D" and cfg.router.port == 18081 and cfg.dtype == "float32"
    assert [n.name for n in cfg.prefill] == ["prefill-0", "prefill-1"]


def test_no_weights_cache_reaches_every_node():
    raw = resolve_config(parse_args(["--prefill", "2", "--no-weights-cache"]))
    cfg = _load(raw)
    assert not any(n.weights_cache for n in (*cfg.prefill, *cfg.decode))
    assert all(n.weights_cache for n in _load(resolve_config(parse_args([]))).decode)


def test_dump_toml_escapes_strings():
    raw = {"model": 'a "quoted" \\ path é', "router": {"port": 1}, "prefill": [{"name": "p"}]}
    assert tomllib.loads(dump_toml(raw)) == raw


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--config", "x.toml", "--prefill", "2"], "not with --config"),
        (["--prefill", "0"], "at least 1"),
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--config", "/nonexistent.toml"], "cannot read"),
    ],
)
def test_bad_options_are_one_line_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        resolve_config(parse_args(argv))


def test_duet_up_error_exits_1(capsys):
    from deploy.cli import main

    assert main(["up", "--model", "/nonexistent/model"]) == 1
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("script", ["launch_router.sh", "launch_prefill.sh", "launch_decode.sh"])
def test_launch_scripts_need_their_arguments(script):
    r = subprocess.run(["bash", str(DEPLOY / script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr


def test_launch_script_passes_config_and_node():
    config = str(DEPLOY / "configs" / "1p1d.toml")
    r = subprocess.run(
        ["bash", str(DEPLOY / "launch_decode.sh"), config, "no-such-node"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert r.returncode == 2 and "no node named 'no-such-node'" in r.stderr

"""bench-sweep with the fake server standing in for `duet up` (started per config as a
subprocess, health polled until ready, stopped with Ctrl-C afterwards)."""

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest
from bench_fakes import FakeBehavior, ServerThread, make_app
from test_bench_serve import check_png

from bench import sweep
from control.errors import DuetError
from tinymodel.make import ensure_tiny_model

FAKE_UP = (sys.executable, str(Path(__file__).with_name("bench_fakes.py")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, port: int) -> Path:
    base = free_port()  # node ports are never bound by the fake; they must only differ
    path.write_text(f"""
[sla]
ttft_ms = 500
tpot_ms = 20
[router]
port = {port}
control_port = {base + 1}
[[prefill]]
name = "p"
control_port = {base + 2}
[[decode]]
name = "d"
control_port = {base + 3}
kv_port = {base + 4}
""")
    return path


def test_sweep_two_configs(tmp_path):
    configs = [write_config(tmp_path / f"{name}.toml", free_port()) for name in ("c1", "c2")]
    out = tmp_path / "out"
    model = str(ensure_tiny_model())
    argv = ["--config", str(configs[0]), "--config", str(configs[1]), "--label", "1P1D",
            "--label", "2P1D", "--rates", "10,40", "--out", str(out), "--model", model,
            "--num-prompts", "6", "--input-len", "5", "--output-len", "3", "--no-progress", "--no-plots"]  # fmt: skip
    assert sweep.main(argv, up_command=FAKE_UP) == 0

    result = json.loads((out / "sweep.json").read_text())
    assert result["axis"] == "request rate (req/s)"
    assert set(result["runs"]) == {"1P1D", "2P1D"}
    for label, points in result["runs"].items():
        assert [p["x"] for p in points] == [10.0, 40.0]
        for p in points:
            s = p["summary"]
            assert s["completed"] == 6 and s["failed"] == 0
            assert s["sla"] == {"ttft_ms": 500.0, "tpot_ms": 20.0}  # from the config file
            assert (out / label / f"rate-{p['x']:g}" / "requests.jsonl").is_file()
        log = (out / label / "cluster.log").read_text()
        assert f"model {model}" in log  # --model reached the launcher
        pid = int(log.split("pid ")[1].split()[0])
        with pytest.raises(ProcessLookupError):  # the cluster was stopped and reaped
            os.kill(pid, 0)
    check_png(out / "sweep.png")


def test_sweep_launcher_failure_is_one_clear_error(tmp_path):
    config = write_config(tmp_path / "c.toml", free_port())
    argv = ["--config", str(config), "--rates", "1", "--out", str(tmp_path / "o")]
    failing = (sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)")
    with pytest.raises(DuetError, match="exited with 3 before the cluster was ready: no model"):
        sweep.main(argv, up_command=failing)


def test_sweep_refuses_options_it_sets(tmp_path):
    config = write_config(tmp_path / "c.toml", free_port())
    with pytest.raises(DuetError, match="--url"):
        sweep.main(["--config", str(config), "--rates", "1", "--url", "http://x"])


def _alive(pid: int) -> bool:
    """Running (a killed grandchild may linger as a zombie until init reaps it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_hung_launcher_and_its_children_are_killed(tmp_path, monkeypatch):
    # A launcher that ignores Ctrl-C and whose child runs in a session of its own, as
    # `duet up`'s children do: only the logged pid can reach that child.
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "child = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "print(f'duet up: started decode (pid {child.pid})', flush=True)\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(sweep, "STOP_TIMEOUT_S", 0.5)
    app, _ = make_app(FakeBehavior())
    with ServerThread(app) as server:
        cluster = sweep.Cluster(
            [sys.executable, "-c", script],
            server.url + "/health",
            tmp_path / "cluster.log",
            timeout_s=10,
        )
        with cluster:
            deadline = time.monotonic() + 10
            while "pid" not in (tmp_path / "cluster.log").read_text():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            launcher = cluster.proc.pid
    child = int((tmp_path / "cluster.log").read_text().split("pid ")[1].split(")")[0])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child) and not _alive(launcher)

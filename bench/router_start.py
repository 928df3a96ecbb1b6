"""The router process's start: seconds from launch to its first `/health` answer, and its
resident memory then (VmRSS, and the peak VmHWM), with no node up (a gateway's own cost).

    python -m bench.router_start [--model DIR] [--repeats 5] [--tree DIR ...]

Each `--tree` is a checkout of the project (default: this one) whose router is started with
that folder as its working directory, so two trees (before and after a change) are measured
in one interleaved run: tree A, tree B, tree A, ... Medians per tree, and each tree's ratio to
the first.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from control.builtin_model import ensure_builtin_model

START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(path: Path, model: str) -> None:
    path.write_text(
        f'model = "{model}"\n'
        "[security]\ninsecure = true\n"
        f'[router]\nhost = "127.0.0.1"\nport = {_free_port()}\n'
        f"control_port = {_free_port()}\n"
        f'[[prefill]]\nname = "p0"\nhost = "127.0.0.1"\ncontrol_port = {_free_port()}\n'
        f'[[decode]]\nname = "d0"\nhost = "127.0.0.1"\ncontrol_port = {_free_port()}\n'
        f"kv_port = {_free_port()}\n"
    )


def _status_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def _loaded(pid: int, names: tuple[str, ...]) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [name for name in names if name in maps]


def start_once(tree: Path, config: Path, model: str) -> dict:
    """One router start from `tree`: seconds to the first /health answer, memory then."""
    port = int(config.read_text().split("port = ")[1].split()[0])
    env = dict(os.environ, PYTHONPATH=str(tree))
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "--config", str(config), "--model", model],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the router from {tree} exited with {proc.returncode}")
            if time.perf_counter() - started > START_TIMEOUT_S:
                raise RuntimeError(f"the router from {tree} did not answer /health")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0)
            except urllib.error.HTTPError:  # 503 while no node is up: it answers
                break
            except OSError:
                time.sleep(0.01)
                continue
            break
        seconds = time.perf_counter() - started
        memory = _status_kib(proc.pid)
        loaded = _loaded(proc.pid, ("libtorch", "_C.cpython"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "start_s": seconds,
        "rss_mb": memory["VmRSS"] / 1024,
        "hwm_mb": memory["VmHWM"] / 1024,
        "loaded": loaded,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router_start", description=__doc__)
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tree", action="append", help="a checkout to start the router from")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = args.model or str(ensure_builtin_model())
    trees = [Path(t).resolve() for t in (args.tree or [Path(__file__).resolve().parent.parent])]
    runs: dict[Path, list[dict]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for tree in trees:  # interleaved: A, B, A, B, ...
                config = Path(tmp) / "cluster.toml"
                _config(config, model)
                runs[tree].append(start_once(tree, config, model))
    summary = {}
    for tree, samples in runs.items():
        summary[str(tree)] = {
            key: statistics.median(s[key] for s in samples)
            for key in ("start_s", "rss_mb", "hwm_mb")
        } | {"loaded": samples[-1]["loaded"]}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    first = summary[str(trees[0])]
    print(f"router start, median of {args.repeats} interleaved runs (no node up)")
    for tree, row in summary.items():
        print(
            f"  {tree}: {row['start_s']:.2f} s to /health "
            f"(x{row['start_s'] / first['start_s']:.2f}), RSS {row['rss_mb']:.0f} MB "
            f"(x{row['rss_mb'] / first['rss_mb']:.2f}), peak {row['hwm_mb']:.0f} MB, "
            f"libraries: {', '.join(row['loaded']) or 'no torch, no kernels'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

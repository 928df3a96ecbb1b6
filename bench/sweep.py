"""`duet bench-sweep`: bench-serve at several request rates (or concurrencies) against clusters
it starts itself, one cluster config after another, and one chart comparing them.

For each `--config FILE`: start `duet up --config FILE [--model DIR]` (its output goes to
OUT/<label>/cluster.log), poll GET /health on the config's router until every node is ready, run
`bench-serve` once per rate (outputs in OUT/<label>/rate-<R>/; meanwhile /metrics is polled for
the decode streams running at once, `bench.occupancy`), stop the cluster (SIGINT, the
Ctrl-C `duet up` handles; SIGTERM then SIGKILL to its process group if it lingers). Then write
OUT/sweep.json and OUT/sweep.png (goodput, p99 TTFT, p99 TPOT against the rate).

Arguments it does not know are passed to every bench-serve run (--num-prompts, --input-len,
--output-len, --dataset, --seed, --ttft-ms, ...):

    duet bench-sweep --config deploy/configs/1p1d.toml --config deploy/configs/2p1d.toml \\
        --rates 0.5,1,2,4 --num-prompts 32 --input-len 512 --output-len 128 --out sweep-out
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench import serve
from bench.occupancy import OccupancyWatcher
from control.cluster_config import ClusterConfig
from control.errors import ConfigError, DuetError

DUET_UP = (sys.executable, "-m", "deploy.cli", "up")
POLL_S = 0.5
STOP_TIMEOUT_S = 30.0
# bench-serve options the sweep sets itself.
RESERVED = ("--url", "--config", "--out", "--request-rate", "--max-concurrency", "--tokenizer")


class Cluster:
    """A cluster started by a subprocess (`duet up`) and stopped on exit, whatever happens."""

    def __init__(self, cmd: Sequence[str], health_url: str, log_path: Path, timeout_s: float):
        self.cmd = list(cmd)
        self.health_url = health_url
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Cluster:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # Its own session: the whole process group can be signalled if `duet up` lingers.
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log_tail(self, lines: int = 5) -> str:
        """The last `lines` lines of the cluster's log joined by " | " (0: all of them)."""
        try:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return " | ".join(tail)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DuetError(
                    f"`{' '.join(self.cmd)}` exited with {self.proc.returncode} "
                    f"before the cluster was ready: {self._log_tail()}"
                )
            try:
                if _is_healthy(httpx.get(self.health_url, timeout=2.0, trust_env=False)):
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(POLL_S)
        raise DuetError(
            f"the cluster was not ready within {self.timeout_s:g} s "
            f"({self.health_url}); log: {self.log_path}"
        )

    def stop(self) -> None:
        """SIGINT (Ctrl-C, which `duet up` handles by stopping its children) and wait; if it
        hangs, SIGTERM then SIGKILL its process group and SIGKILL the children it logged."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill_group(proc, signal.SIGTERM)
                try:
                    proc.wait(10.0)
                except subprocess.TimeoutExpired:
                    self._kill_group(proc, signal.SIGKILL)
                    proc.wait(10.0)
                # Its children run in sessions of their own; they would keep the ports the
                # next config needs.
                for pid in re.findall(r"\(pid (\d+)\)", self._log_tail(0)):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(pid), signal.SIGKILL)
        self._kill_group(proc, signal.SIGKILL)  # anything left in its process group

    @staticmethod
    def _kill_group(proc: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _is_healthy(resp: httpx.Response) -> bool:
    """200, and every node ready when the body says (duet's router answers 200 "degraded"
    while some nodes are still loading)."""
    if resp.status_code != 200:
        return False
    try:
        return resp.json().get("status", "ok") == "ok"
    except (ValueError, AttributeError):
        return True


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers: {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duet bench-sweep",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="Other options (--num-prompts, --input-len, --output-len, --dataset, --ttft-ms, "
        "...) are passed to every bench-serve run; see `duet bench-serve --help`.",
        allow_abbrev=False,
    )
    p.add_argument("--config", action="append", required=True, help="cluster config (repeat)")
    p.add_argument("--label", action="append", help="a name per config (default: file stem)")
    axis = p.add_mutually_exclusive_group(required=True)
    axis.add_argument("--rates", type=_floats, help="request rates, e.g. 0.5,1,2,inf")
    axis.add_argument("--concurrencies", type=_floats, help="fixed concurrencies, e.g. 1,8")
    p.add_argument("--model", help="checkpoint dir: `duet up --model` and the tokenizer")
    p.add_argument("--out", default="bench-results/sweep", help="output folder")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="s to wait for /health")
    return p


def _labels(configs: list[str], labels: list[str] | None) -> list[str]:
    if labels and len(labels) != len(configs):
        raise ConfigError("give one --label per --config")
    names = labels or [Path(c).stem for c in configs]
    if len(set(names)) != len(names):  # two configs with the same file name
        names = [f"{n}-{i}" for i, n in enumerate(names)]
    return names


def _point_argv(args, config: str, point: float, out: Path, serve_argv: list[str]) -> list[str]:
    argv = ["--config", config, "--out", str(out), *serve_argv]
    if args.rates:
        argv += ["--request-rate", str(point)]
    else:
        argv += ["--max-concurrency", str(int(point))]
    if args.model:
        argv += ["--tokenizer", args.model]
    return argv


def run_sweep(
    args: argparse.Namespace, serve_argv: list[str], up_command: Sequence[str] = DUET_UP
) -> dict[str, list[dict[str, Any]]]:
    """Run every (config, point); returns label -> [{"x": rate or concurrency, "summary"}]."""
    out = Path(args.out)
    points = args.rates or args.concurrencies
    results: dict[str, list[dict[str, Any]]] = {}
    for config, label in zip(args.config, _labels(args.config, args.label), strict=True):
        cfg = ClusterConfig.load(config)
        cmd = [*up_command, "--config", config] + (["--model", args.model] if args.model else [])
        health = f"http://{cfg.router.host}:{cfg.router.port}/health"
        results[label] = []
        tokenizer = serve.load_tokenizer(args.model or cfg.model or None)  # once per config
        with Cluster(cmd, health, out / label / "cluster.log", args.startup_timeout):
            for point in points:
                name = f"{'rate' if args.rates else 'concurrency'}-{point:g}"
                argv = _point_argv(args, config, point, out / label / name, serve_argv)
                point_args = serve.resolve(serve.build_parser().parse_args(argv))
                metrics = f"http://{cfg.router.host}:{cfg.router.port}/metrics"
                with OccupancyWatcher(metrics) as watcher:
                    summary = serve.run(point_args, tokenizer)
                summary["decode_running"] = watcher.summary()
                results[label].append({"x": point, "summary": summary})
                print(f"{label} {name}: {_brief(summary)}", flush=True)
    return results


def _brief(s: dict[str, Any]) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    return (
        f"{s['completed']}/{s['num_requests']} ok, goodput {s['goodput']:.3f} req/s, "
        f"p99 TTFT {ms(s['ttft_ms']['p99'])} ms, p99 TPOT {ms(s['tpot_ms']['p99'])} ms, "
        f"{s['output_throughput']:.1f} out tok/s, decode streams peak "
        f"{s.get('decode_running', {}).get('peak', 0):g}"
    )


def main(argv: list[str] | None = None, up_command: Sequence[str] = DUET_UP) -> int:
    args, serve_argv = build_parser().parse_known_args(argv)
    clash = [a for a in serve_argv if a.split("=")[0] in RESERVED]
    if clash:
        raise ConfigError(f"bench-sweep sets {', '.join(clash)} itself; use its own options")
    if args.concurrencies and any(c != int(c) for c in args.concurrencies):
        raise ConfigError("--concurrencies must be whole numbers")
    serve.resolve(serve.build_parser().parse_args(["--url", "http://x", *serve_argv]))  # validate
    results = run_sweep(args, serve_argv, up_command)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    axis = "request rate (req/s)" if args.rates else "max concurrency"
    safe = {
        k: [{**p, "x": str(p["x"]) if math.isinf(p["x"]) else p["x"]} for p in v]
        for k, v in results.items()
    }
    (out / "sweep.json").write_text(json.dumps({"axis": axis, "runs": safe}, indent=2) + "\n")
    from bench.plots import plot_sweep

    plot_sweep(results, out / "sweep.png", axis)
    print(f"results: {out}")
    return 0

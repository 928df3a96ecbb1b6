"""A cluster on packed weights, measured: start time, memory, and recovery from a node's death.

    python -m bench.pack_serving --config FILE [--model DIR] [--kill decode-0] [--json]

Starts `duet up --config FILE` (the weights cache on, as by default; `bench.sweep.Cluster`
starts and stops it), and reports:
- start s: from launch to the router's /health saying every node is ready (a cold start builds
  the pack; run again for a warm one, the pack mapped with the page cache hot);
- memory: the sum over every node and rank process (the launcher's children and theirs) of
  their PSS (`/proc/PID/smaps_rollup`: each shared page counted once over all of them), beside
  the bytes of the packs they map, and each process's PSS;
- recovery s: from SIGKILL of `--kill`'s process to the first completion served again (the
  supervisor restarts it; it maps the pack again).
Then stops the cluster. Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx

from bench.sweep import DUET_UP, Cluster
from control.cluster_config import ClusterConfig

GB = 1e9


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (ranks are children of their rank 0)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        out += frontier
    return out


def _rollup(pid: int) -> dict[str, int]:
    """smaps_rollup's kB fields of `pid` ({} if it is gone)."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return fields


def _name(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in cmd if w]
    node = words[words.index("--node") + 1] if "--node" in words else ""
    rank = words[words.index("--rank") + 1] if "--rank" in words else ""
    module = next((w for w in words if w.endswith(("_node", "router", ".ranks"))), words[-1])
    return f"{module} {node}{'[' + rank + ']' if rank else ''}".strip()


def memory(launcher: int, packs: list[Path]) -> dict:
    procs = [p for p in _children(launcher) if _rollup(p)]
    rows = {f"{_name(p)} ({p})": _rollup(p) for p in procs}
    pss = sum(r.get("Pss", 0) for r in rows.values()) * 1024
    return {
        "processes": len(rows),
        "pss_sum_gb": pss / GB,
        "pss_file_gb": sum(r.get("Pss_File", 0) for r in rows.values()) * 1024 / GB,
        "pss_anon_gb": sum(r.get("Pss_Anon", 0) for r in rows.values()) * 1024 / GB,
        "pack_gb": sum(p.stat().st_size for p in packs) / GB,
        "per_process_pss_gb": {k: r.get("Pss", 0) * 1024 / GB for k, r in rows.items()},
    }


def _serves(url: str, model: str) -> bool:
    try:
        r = httpx.post(
            url + "/v1/completions",
            timeout=120,
            json={"model": model, "prompt": "Hello", "max_tokens": 2},
        )
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pack_serving", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--model", help="checkpoint dir (default: the config's)")
    p.add_argument("--kill", default="decode-0", help="the node to SIGKILL ('' = none)")
    p.add_argument("--log", default="pack-serving.log", help="duet up's output")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for ready")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    router = ClusterConfig.load(args.config).router
    url = f"http://{router.host}:{router.port}"
    cmd = [*DUET_UP, "--config", args.config, *(["--model", args.model] if args.model else [])]
    result: dict = {}
    start = time.monotonic()
    with Cluster(cmd, url + "/health", Path(args.log), args.timeout) as cluster:
        result["start_s"] = time.monotonic() - start
        text = Path(args.log).read_text(errors="replace")
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        result["built_pack"] = "INFO building " in text
        packs = sorted({Path(p) for p in re.findall(r"weights: pack (\S+) \(", text)})
        result["packs"] = [str(p) for p in packs]
        assert _serves(url, model), "the cluster does not serve"
        result["memory"] = memory(cluster.proc.pid, packs)
        if args.kill:
            victim = int(re.search(rf"started {re.escape(args.kill)} \(pid (\d+)\)", text).group(1))
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            while not _serves(url, model):
                time.sleep(0.1)
            result["recovery_s"] = time.monotonic() - killed
    if args.json:
        print(json.dumps(result))
    else:
        mem = result["memory"]
        print(
            f"start {result['start_s']:.1f} s ({'pack built' if result['built_pack'] else 'pack mapped'})"
        )
        print(
            f"PSS sum {mem['pss_sum_gb']:.2f} GB over {mem['processes']} processes (file "
            f"{mem['pss_file_gb']:.2f}, anon {mem['pss_anon_gb']:.2f}); packs {mem['pack_gb']:.2f} GB"
        )
        for name, gb in mem["per_process_pss_gb"].items():
            print(f"  {name}: {gb:.2f} GB")
        if "recovery_s" in result:
            print(f"SIGKILL of {args.kill} to serving again: {result['recovery_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

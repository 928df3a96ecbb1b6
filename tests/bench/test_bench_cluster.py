"""bench-sweep and bench-serve against a real tiny-model cluster started with `duet up` (1P1D on
free loopback ports): every request counted, fixed output lengths honoured (ignore_eos), the
server's usage matching the prompts sent, the cluster gone afterwards."""

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from test_bench_serve import check_png

from bench import sweep

pytest.importorskip("deploy.local_cluster")
from deploy.local_cluster import free_ports  # noqa: E402


def test_sweep_against_tiny_cluster(tmp_path):
    # Five distinct ports (picked one at a time, two of them once came out equal).
    ports = free_ports(5)
    config = tmp_path / "1p1d.toml"
    config.write_text(f"""
[sla]
ttft_ms = 5000
tpot_ms = 1000
[router]
port = {ports[0]}
control_port = {ports[1]}
[[prefill]]
name = "prefill"
control_port = {ports[2]}
[[decode]]
name = "decode"
control_port = {ports[3]}
kv_port = {ports[4]}
""")
    out = tmp_path / "out"
    argv = ["--config", str(config), "--concurrencies", "1,4", "--out", str(out),
            "--startup-timeout", "240", "--num-prompts", "8", "--input-len", "16",
            "--output-len", "8", "--no-progress"]  # fmt: skip
    assert sweep.main(argv) == 0

    runs = json.loads((out / "sweep.json").read_text())["runs"]["1p1d"]
    assert [p["x"] for p in runs] == [1.0, 4.0]
    for point in runs:
        folder = out / "1p1d" / f"concurrency-{point['x']:g}"
        records = [
            json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()
        ]
        failed = [(r["error"], r["error_message"]) for r in records if not r["ok"]]
        assert len(records) == 8 and not failed, failed
        assert point["summary"]["completed"] == 8
        for r in records:
            assert r["usage_reported"]
            assert r["output_len"] == 8, r  # ignore_eos: exactly max_tokens
            assert r["prompt_len"] == 16 + 1, r  # the server tokenized our 16 tokens, plus bos
        p99 = np.percentile([r["ttft_s"] * 1e3 for r in records], 99)
        assert point["summary"]["ttft_ms"]["p99"] == pytest.approx(p99)
        check_png(folder / "latency_cdf.png")
    check_png(out / "sweep.png")

    log = (out / "1p1d" / "cluster.log").read_text()
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", log)]
    assert len(pids) == 3  # router, prefill, decode
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], log[-2000:]


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False

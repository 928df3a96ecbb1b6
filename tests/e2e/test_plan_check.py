"""`duet plan`'s recommendation, checked: profile the tiny model on this machine, write the
recommended cluster, start it with `duet up` and drive it with bench-serve at the planned rate;
the SLA attainment measured must be within MARGIN of the one predicted.

The SLA here is loose enough for a shared 2-core CI machine (the prediction is then ~100 % and
so must the measurement be); the planner's accuracy where attainment falls off is measured by
the benchmark in the README (bench model, rates past saturation), not in CI."""

import json
import socket

from bench import sweep
from deploy import plan

MARGIN = 0.1
RATE = 2.0


def free_block(size: int) -> int:
    """The first port of `size` consecutive free loopback ports."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + size >= 65536:
            continue
        socks = []
        try:
            for port in range(base, base + size):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no block of free ports")


def test_planned_cluster_meets_its_predicted_attainment(tmp_path, capsys):
    config = tmp_path / "planned.toml"
    sla = ["--sla-ttft-ms", "3000", "--sla-tpot-ms", "300"]
    workload = ["--input-len", "64", "--output-len", "16"]
    argv = [*sla, *workload, "--rate", str(RATE), "--threads", "1", "--cores-per-host", "2",
            "--max-batch", "16", "--repeats", "2", "--port", str(free_block(8)),
            "--write-config", str(config)]  # fmt: skip
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    chosen = next(line for line in out.splitlines() if line[:1].isdigit())
    predicted = float(chosen.split()[-3].rstrip("%")) / 100  # the "SLA ok" column
    assert chosen.startswith("1P1D")  # the only layout of 1-thread nodes on 2 cores

    results = tmp_path / "sweep"
    sweep_argv = ["--config", str(config), "--rates", str(RATE), "--num-prompts", "16",
                  *workload, "--out", str(results), "--startup-timeout", "240",
                  "--no-progress"]  # fmt: skip
    assert sweep.main(sweep_argv) == 0
    summary = json.loads((results / "sweep.json").read_text())["runs"]["planned"][0]["summary"]
    assert summary["completed"] == 16
    assert abs(summary["sla_attainment"] - predicted) <= MARGIN, (summary, chosen)

"""End to end: a tensor-parallel prefill node whose rank 1 runs "on another host" (`rank_hosts`,
`group_port`, gloo): rank 0 at 127.0.0.1 under `duet up`, rank 1 at 127.0.0.3 started by its
own launch script, as on a second machine (loopback addresses: no traffic leaves this one),
with the cluster's key file, with which it authenticates to rank 0's rendezvous.

Greedy outputs equal `duet generate`'s; every socket rank 1 listens on is on its own address;
rank 0 SIGKILLed is restarted by the launcher and rank 1, still running, serves the new rank 0
(outputs equal again); rank 1 outlives the cluster's stop, waiting for its next rank 0, and a
signal stops it."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from e2e_helpers import (
    UpProcess,
    cluster_shorthand,
    free_port,
    generate_reference,
)
from e2e_helpers import wait_until as _wait
from listeners import listening_sockets

from control.security import write_key_file
from deploy.local_cluster import dump_toml

ROOT = Path(__file__).resolve().parents[2]
RANK_HOST = "127.0.0.3"
PROMPTS = [[(5 * i + 7) % 290 + 5 for i in range(40)], [9, 8, 7, 6, 5, 4, 3]]
MAX_NEW = 8


def _outputs(up) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        r = httpx.post(
            up.url + "/v1/completions",
            timeout=120,
            json={
                "model": "tiny-model",
                "prompt": prompt,
                "max_tokens": MAX_NEW,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    return texts


def test_a_rank_on_another_host_serves_rank_0_and_its_restart(tmp_path):
    raw = cluster_shorthand(1, 1)
    raw["dtype"] = "float32"
    raw["prefill"][0].update(
        ranks=2, rank_hosts=[RANK_HOST], group_port=free_port(), all_reduce="gloo", chunk_size=16
    )
    # One key file for the cluster, as every host of a real one has: rank 1 authenticates to
    # rank 0's rendezvous with it (`runtime.rank_store`).
    write_key_file(tmp_path / "cluster.key")
    raw["security"] = {"curve_key_file": str(tmp_path / "cluster.key")}
    config = tmp_path / "elsewhere.toml"
    config.write_text(dump_toml(raw))
    refs = [
        generate_reference("float32", MAX_NEW, prompt_ids=p, extra=("--ignore-eos",))["text"]
        for p in PROMPTS
    ]
    up = UpProcess(["--config", str(config)], tmp_path / "up.log")
    rank_log = open(tmp_path / "rank1.log", "w")  # noqa: SIM115 - closed below
    rank = subprocess.Popen(
        ["bash", str(ROOT / "deploy" / "launch_prefill_rank.sh"), str(config), "prefill-0", "1"],
        stdout=rank_log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHON": sys.executable},
    )
    rank_text = lambda: (tmp_path / "rank1.log").read_text()  # noqa: E731
    try:
        up.wait_ready()
        assert _outputs(up) == refs
        listening = listening_sockets(rank.pid)
        assert listening and {addr for addr, _ in listening} == {RANK_HOST}, listening
        os.kill(up.child_pids["prefill-0"], signal.SIGKILL)
        ready = lambda: up.log().count("node prefill-0 (prefill) is ready") >= 2  # noqa: E731
        assert _wait(ready, 180), up.log()[-3000:]
        assert "restarted prefill-0" in up.log()
        assert _outputs(up) == refs  # the new rank 0 with the same rank 1
        assert rank_text().count("rank 1 ready") == 2, rank_text()
        assert rank.poll() is None
        up.stop()
        assert _wait(lambda: "waiting for rank 0" in rank_text().rsplit("rank 1 ready", 1)[1], 60)
        assert rank.poll() is None  # it waits for the next rank 0
        rank.send_signal(signal.SIGINT)
        assert rank.wait(timeout=30) == -signal.SIGINT
    finally:
        up.stop()
        if rank.poll() is None:
            rank.kill()
            rank.wait()
        rank_log.close()

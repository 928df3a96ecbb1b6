"""Graceful drain: SIGTERM on a node makes it take nothing new, finish what it holds and exit 0;
the launcher starts it again. A rolling restart of every node of a 2P1D cluster under a steady
load completes with zero failed requests (requests arriving while the only decode node is away
wait for it, within the reserve timeout)."""

from __future__ import annotations

import os
import signal
import threading

import openai

from deploy.local_cluster import dump_toml
from tests.e2e.e2e_helpers import cluster_shorthand, start_cluster
from tests.e2e.e2e_helpers import wait_until as _wait
from tests.faults.fault_helpers import all_ready, child_pids, decode_pages_used

TIMEOUTS = {"heartbeat_s": 0.25, "node_timeout_s": 5.0, "reserve_s": 90.0, "drain_s": 30.0}


class Load:
    """`workers` threads, each sending one streaming completion after another until `stop`."""

    def __init__(self, up, workers: int = 4):
        self.up = up
        self.num_ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._work, args=(i,)) for i in range(workers)]
        for t in self.threads:
            t.start()

    def _work(self, i: int) -> None:
        client = openai.OpenAI(
            base_url=self.up.url + "/v1", api_key="none", max_retries=0, timeout=120
        )
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                stream = client.completions.create(
                    model="tiny-model",
                    prompt=f"Worker {i} request {n}: the river",
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                )
                finish = None
                for chunk in stream:
                    finish = chunk.choices[0].finish_reason or finish
                outcome = (
                    None if finish in ("stop", "length") else f"ended without finish: {finish}"
                )
            except openai.APIError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            with self._lock:
                if outcome is None:
                    self.num_ok += 1
                else:
                    self.errors.append(outcome)

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(150)
        assert not any(t.is_alive() for t in self.threads), "a client hung"


def _drain_and_restart(up, load: Load, name: str) -> None:
    """SIGTERM `name`; it exits 0, the launcher starts it again, the cluster serves again."""
    assert _wait(lambda: load.num_ok >= 4, 60)  # load is flowing
    pid = child_pids(up)[name]
    exits = up.log().count(f"{name} exited with status 0")
    os.kill(pid, signal.SIGTERM)
    assert _wait(lambda: up.log().count(f"{name} exited with status 0") > exits, 60)
    assert _wait(lambda: child_pids(up)[name] != pid and all_ready(up), 120)
    served = load.num_ok
    assert _wait(lambda: load.num_ok > served + 4, 60)


def test_rolling_restart_under_load_fails_no_request(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "2p1d.toml"
    raw = cluster_shorthand(2, 1)
    raw["dtype"] = "float32"
    raw["timeouts"] = TIMEOUTS
    path.write_text(dump_toml(raw))
    up = start_cluster(["--config", str(path)], tmp_path_factory)
    try:
        load = Load(up)
        try:
            for name in ("prefill-0", "prefill-1", "decode-0"):
                _drain_and_restart(up, load, name)
        finally:
            load.stop()
        assert load.errors == [], load.errors[:5]
        assert load.num_ok > 12
        log = up.log()
        assert all(f"{n} INFO SIGTERM: draining" in log for n in ("prefill-0", "decode-0"))
        assert _wait(lambda: decode_pages_used(up) == [0.0], 30)
    finally:
        up.stop()

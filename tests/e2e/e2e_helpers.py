"""Helpers for the e2e tests: `duet up` as a subprocess on free loopback ports, reading its
/metrics, finding leftover processes, and the `duet generate --json` reference.

The test modules keep one cluster per module (a module-scoped fixture): starting one costs a
few seconds of model loading per role.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from deploy.local_cluster import shorthand_config

READY_TIMEOUT_S = 240.0  # three to four processes load torch and the model on 2 shared cores
STOP_TIMEOUT_S = 30.0


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port never handed out before in this test process (two configs of one test
    must not share a port just because the OS reused a freed one)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT and port + 1 not in _HANDED_OUT and port - 1 not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _ports_of(raw: dict) -> list[int]:
    return [
        v
        for section in (raw["router"], *raw["prefill"], *raw["decode"])
        for k, v in section.items()
        if k.endswith("port")
    ]


def cluster_shorthand(num_prefill: int, num_decode: int) -> dict:
    """`shorthand_config` (one thread a node) on ports no other config of this test process
    holds, all of them registered as handed out: its ports are free when picked but then
    released, so a later `free_port()` (`UpProcess`'s own `--port`) could otherwise get one."""
    for _ in range(50):
        raw = shorthand_config(num_prefill, num_decode, port=free_port(), threads=1)
        ports = _ports_of(raw)[1:]  # the router's HTTP port came from free_port()
        if not any(p + d in _HANDED_OUT for p in ports for d in (-1, 0, 1)):
            _HANDED_OUT.update(ports)
            return raw
    raise RuntimeError("no free ports for a shorthand config")


def free_port_pair() -> int:
    """A port p with p and p + 1 both free (a config's `replicas = 2` takes p + i)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


class UpProcess:
    """`python -m deploy.cli up --port P ARGS...`, output to a log file; `env` adds variables to
    this process's environment for it (the launcher passes its environment to every node)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "deploy.cli", "up", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.child_pids: dict[str, int] = {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.log()
            if "duet up: ready at" in text:
                self.child_pids = {
                    name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", text)
                }
                return
            if self.proc.poll() is not None:
                pytest.fail(f"duet up exited with {self.proc.returncode}:\n{text[-4000:]}")
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"duet up was not ready in {READY_TIMEOUT_S:g} s:\n{self.log()[-4000:]}")

    def interrupt(self) -> int:
        """Ctrl-C: SIGINT to the launcher only; returns its exit status."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.interrupt()
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in self.child_pids.values():  # never leave a child behind, even on failure
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120
        )

    def greedy(self, prompt, max_tokens: int, ignore_eos: bool = True):
        """One greedy completion of `prompt` (text or token ids), `max_tokens` long when
        `ignore_eos`: the openai client's Completion."""
        return self.client().completions.create(
            model="tiny-model",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": ignore_eos},
        )

    def metric(self, name: str, router_url: str = "", **labels: str) -> float:
        """A sample of the router's /metrics (`router_url`'s: another router of the cluster)."""
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        key = f"{name}{{{want}}}" if want else name
        url = router_url or self.url
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            sample, _, value = line.rpartition(" ")
            if sample == key:
                return float(value)
        return 0.0


def start_cluster(
    args: list[str], tmp_path_factory, env: dict[str, str] | None = None, port: int | None = None
) -> UpProcess:
    log = tmp_path_factory.mktemp("duet-up") / "up.log"
    up = UpProcess(args, log, env, port)
    up.wait_ready()
    return up


def wait_until(cond, timeout_s: float) -> bool:
    """Polls `cond()` until true (True) or `timeout_s` passed (False); an HTTP error while
    polling (a router restarting) counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (the cluster's private config path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline and alive(int(entry.name)):
                pids.append(int(entry.name))
    return pids


def generate_reference(
    dtype: str,
    max_new: int,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    extra: tuple[str, ...] = (),
    model: str | None = None,
) -> dict:
    """`duet generate --json` (greedy unless `extra` says otherwise; `model`: the checkpoint,
    default the built-in tiny model), run in this process through the CLI's own main:
    {"token_ids": [...], "text": "..."}."""
    from deploy.cli import main

    args = ["generate", "--json", "--dtype", dtype, "--max-new-tokens", str(max_new), *extra]
    if model is not None:
        args += ["--model", model]
    if prompt is not None:
        args += ["--prompt", prompt]
    else:
        args += ["--prompt-ids", ",".join(map(str, prompt_ids))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    return json.loads(out.getvalue())

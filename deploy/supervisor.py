"""The children of `duet up`, supervised: one that dies is started again with backoff while the
others keep serving (the router fails over or retries the requests it held).

A child that exits on its own (a crash, SIGKILL, a drained node exiting 0) is restarted after
1 s, then 2, 4, ... up to 30 s for repeated deaths; a child that stayed up for `STABLE_S` starts
over at 1 s. Only `stop()` ends children for good.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0  # up this long: the next death restarts after the first backoff again


@dataclass
class Child:
    name: str
    cmd: list[str]
    stop_signal: int  # what `stop` sends it
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    num_restarts: int = 0
    num_quick_deaths: int = 0  # deaths in a row, each within STABLE_S of the start before
    restart_at: float | None = None  # set while dead: when it starts again


class Supervisor:
    """Starts, watches and restarts child processes. Not thread-safe: one loop calls `poll`."""

    def __init__(
        self,
        env: dict[str, str],
        preexec_fn: Callable[[], None] | None = None,
        say: Callable[[str], None] = lambda line: print(f"duet up: {line}", flush=True),
    ):
        self.env = env
        self.preexec_fn = preexec_fn
        self.say = say
        self.children: dict[str, Child] = {}

    def start(self, name: str, cmd: list[str], stop_signal: int = signal.SIGINT) -> None:
        child = self.children.setdefault(name, Child(name, cmd, stop_signal))
        child.proc = subprocess.Popen(
            cmd, env=self.env, stdin=subprocess.DEVNULL, preexec_fn=self.preexec_fn
        )
        child.started_at = time.monotonic()
        child.restart_at = None
        verb = "restarted" if child.num_restarts else "started"
        self.say(f"{verb} {name} (pid {child.proc.pid})")

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children.values() if c.proc is not None}

    def exited(self) -> list[tuple[str, int]]:
        """(name, status) of the children that exited and are not started again yet."""
        return [
            (c.name, c.proc.returncode)
            for c in self.children.values()
            if c.proc is not None and c.proc.poll() is not None
        ]

    def poll(self, now: float | None = None) -> None:
        """Schedules a restart for each child that died and starts those that are due."""
        now = time.monotonic() if now is None else now
        for child in self.children.values():
            if child.restart_at is None and child.proc is not None:
                status = child.proc.poll()
                if status is None:
                    continue
                if now - child.started_at >= STABLE_S:
                    child.num_quick_deaths = 0
                delay = BACKOFF_S[min(child.num_quick_deaths, len(BACKOFF_S) - 1)]
                child.num_quick_deaths += 1
                child.restart_at = now + delay
                self.say(f"{child.name} exited with status {status}; restarting in {delay:g} s")
            if child.restart_at is not None and now >= child.restart_at:
                child.num_restarts += 1
                self.start(child.name, child.cmd, child.stop_signal)

    def stop(self, grace_s: float) -> None:
        """Its stop signal to every child (SIGINT: a node stops at once, without draining),
        SIGKILL to those still running after `grace_s`; waits for all."""
        running = [c for c in self.children.values() if c.proc and c.proc.poll() is None]
        for child in running:
            child.proc.send_signal(child.stop_signal)
        deadline = time.monotonic() + grace_s
        for child in running:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{child.name} did not stop in {grace_s:g} s; killing it")
                child.proc.kill()
                child.proc.wait(timeout=5)

"""`duet up --autoscale`: the router starts and drains node processes on its host as the load
asks (`router.autoscale_policy` decides; this module reads the signals and acts through a
`Launcher`: `LocalLauncher` here, or on Kubernetes `router.k8s_launcher.K8sLauncher`, which
scales each role's pool Deployment instead).

Every `interval_s` it reads, from the router's own state: per role the ready nodes, the prompt
tokens queued on the prefill nodes and the share of the decode nodes' KV pages held for
requests, and the SLA attainment of the requests that finished within the window. A node it
starts is a joining node (`python -m prefill_node|decode_node --join`, as `duet node` starts
one) named `auto-<role>-<n>` on free ports of this host, a child of the router whose output goes
to the router's; the router admits it like any other (`router.membership`). A node it drains
gets SIGTERM: it takes nothing new, finishes what it holds, stops, and the router forgets it, so
scaling down loses no request. Each decision is one log line, and `/metrics` has
`duet_autoscale_nodes{role}` (nodes it runs) and `duet_autoscale_decisions_total{role,
direction}`. When the router stops, the nodes it started stop with it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Counter, Gauge

from control.cluster_config import AutoscaleConfig
from router.autoscale_policy import ROLES, Attainment, AutoscalePolicy, Decision, RoleSignals
from router.nodes import NodeStatus

log = logging.getLogger("router")

STOP_WAIT_S = 10.0  # a started node's time to stop when the router stops, then SIGKILL


@dataclass
class _Started:
    name: str
    role: str
    proc: subprocess.Popen
    draining: bool = False


class Launcher(Protocol):
    """Where the autoscaler's nodes come from: node processes on this host (`LocalLauncher`) or
    a role's pool Deployment (`router.k8s_launcher.K8sLauncher`)."""

    def counts(self, role: str, ready: set[str]) -> tuple[int, int]:
        """(nodes it started that are not ready yet, ready ones it may drain), given the
        names of the role's ready nodes."""

    def running(self, role: str) -> int:
        """The nodes of `role` it runs (the `duet_autoscale_nodes` gauge)."""

    def start(self, role: str) -> str:
        """Starts one more node of `role`; says which (a log line's words)."""

    def drain(self, role: str, ready: set[str]) -> str:
        """Drains one of its ready nodes of `role`; says which."""

    def reap(self) -> None:
        """Forgets nodes that have ended."""

    def close(self) -> None:
        """The router stops."""


class LocalLauncher:
    """Starts joining nodes as child processes of this one (the cluster config's file), named
    `auto-<role>-<n>`, and drains the newest first."""

    def __init__(self, config_path: str, model_dir: str | None, host: str = "127.0.0.1"):
        self.config_path = config_path
        self.model_dir = model_dir
        self.host = host
        self.started: list[_Started] = []
        self._count = 0

    def _mine(self, role: str) -> list[_Started]:
        return [s for s in self.started if s.role == role and not s.draining]

    def counts(self, role: str, ready: set[str]) -> tuple[int, int]:
        mine = self._mine(role)
        return sum(s.name not in ready for s in mine), sum(s.name in ready for s in mine)

    def running(self, role: str) -> int:
        return sum(s.role == role for s in self.started)

    def start(self, role: str) -> str:
        self._count += 1
        name = f"auto-{role}-{self._count}"
        ports = _free_ports(self.host, 2 if role == "decode" else 1)
        cmd = [sys.executable, "-m", f"{role}_node", "--config", self.config_path]
        cmd += ["--node", name, "--join", "--control-port", str(ports[0])]
        if role == "decode":
            cmd += ["--kv-port", str(ports[1])]
        if self.model_dir:
            cmd += ["--model", self.model_dir]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.started.append(_Started(name, role, proc))
        return f"{name} (pid {proc.pid})"

    def drain(self, role: str, ready: set[str]) -> str:
        victim = [s for s in self._mine(role) if s.name in ready][-1]  # the newest
        victim.draining = True
        victim.proc.send_signal(signal.SIGTERM)
        return f"{victim.name} (pid {victim.proc.pid})"

    def reap(self) -> None:
        """Forgets started nodes whose process ended (drained, or failed to start)."""
        for s in [s for s in self.started if s.proc.poll() is not None]:
            self.started.remove(s)
            how = "stopped" if s.draining else f"exited with {s.proc.returncode}"
            log.info("autoscale: %s %s", s.name, how)

    def close(self) -> None:
        """Stops every node it started (they fail what they hold: the router is stopping)."""
        for s in self.started:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + STOP_WAIT_S
        for s in self.started:
            try:
                s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
        self.started.clear()


class Autoscaler:
    def __init__(self, router, launcher: Launcher, cfg: AutoscaleConfig):
        self.router = router
        self.launcher = launcher
        self.cfg = cfg
        self.policy = AutoscalePolicy(cfg)
        self._has_served = False
        # (time, finished, within the SLA, within its TTFT, within its TPOT)
        self._finished: deque[tuple[float, int, int, int, int]] = deque()
        registry = router.metrics.registry
        self.nodes_gauge = Gauge(
            "duet_autoscale_nodes", "Nodes the autoscaler runs", ["role"], registry=registry
        )
        self.decisions = Counter(
            "duet_autoscale_decisions",
            "Autoscaling decisions",
            ["role", "direction"],
            registry=registry,
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                self.step(time.monotonic())
            except Exception:  # never let a bug here stop the router's other work
                log.exception("autoscaler error")

    def step(self, now: float) -> list[Decision]:
        """Reads the signals, decides, acts; returns what it decided. Nothing before the
        cluster first serves: the config's nodes are still starting."""
        self.launcher.reap()
        if not self._has_served:
            self._has_served = self.router.is_serving
            if not self._has_served:
                return []
        decisions = self.policy.decide(self.signals(), self.attainment(now), now)
        for decision in decisions:
            log.info("autoscale: %s %+d (%s)", decision.role, decision.delta, decision.reason)
            self.decisions.labels(decision.role, "up" if decision.delta > 0 else "down").inc()
            if decision.delta > 0:
                which = self.launcher.start(decision.role)
                log.info("autoscale: started %s", which)
            else:
                ready = {n.name for n in self.router.nodes.ready(decision.role)}
                log.info("autoscale: draining %s", self.launcher.drain(decision.role, ready))
        for role in ROLES:
            self.nodes_gauge.labels(role).set(self.launcher.running(role))
        return decisions

    def signals(self) -> dict[str, RoleSignals]:
        nodes = self.router.nodes
        out = {}
        for role in ROLES:
            ready = nodes.ready(role)
            starting, drainable = self.launcher.counts(role, {n.name for n in ready})
            if role == "prefill":
                load = sum(n.queued_tokens for n in ready) / max(len(ready), 1)
            else:
                total = sum(n.total_pages for n in ready)
                load = sum(n.total_pages - n.free_pages for n in ready) / max(total, 1)
            # the config's nodes restarting count as starting: they come back by themselves
            restarting = sum(n.status == NodeStatus.STARTING for n in nodes.of_role(role))
            out[role] = RoleSignals(
                ready=len(ready),
                starting=starting + restarting,
                drainable=drainable,
                load=load,
            )
        return out

    def attainment(self, now: float) -> Attainment | None:
        """The requests finished within the window: the shares that met the SLA and each of
        its parts (None when none finished)."""
        m = self.router.metrics
        self._finished.append((now, m.num_finished, m.num_sla_met, m.num_ttft_met, m.num_tpot_met))
        while self._finished and now - self._finished[0][0] > self.cfg.window_s:
            self._finished.popleft()
        _, finished0, met0, ttft0, tpot0 = self._finished[0]
        finished = m.num_finished - finished0
        if not finished:
            return None
        return Attainment(
            (m.num_sla_met - met0) / finished,
            (m.num_ttft_met - ttft0) / finished,
            (m.num_tpot_met - tpot0) / finished,
        )

    def close(self) -> None:
        self.launcher.close()


def _free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free now (held open together, so none is picked twice)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()

"""The ranks of one node (a decode node's EP/DP ranks, a prefill node's tensor-parallel ranks):
how rank 0 starts the others, where they meet, and the gloo group they talk over.

Rank 0 is the process the router knows (`python -m decode_node|prefill_node`): it starts ranks
1..R-1 as child processes (`spawn_ranks`) that die with it, and the ranks join a gloo group
through a store rank 0 serves on a free port, which only the node's ranks can use
(`runtime.rank_store`). The store and the group's own sockets listen
on one address, the node's `group_host` (its bound address, or its `host` when it binds every
interface; see `rendezvous_listener`), which rank 0 passes to the others: torch alone would bind
the store to every interface and gloo to whatever the machine's hostname resolves to (often
127.0.0.1). Roles never import each other, so this lives in runtime/.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from control.errors import ConfigError
from control.security import CurveSecurity
from runtime.rank_store import AuthStore, StoreServer, group_token, new_run_token

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 600.0  # ranks load their shards in parallel; the slowest must make it
GLOO_BACKEND = "duet_gloo"  # gloo bound to the node's group_host (`gloo_on`)


def collective_timeout_s(node_timeout_s: float) -> float:
    """How long a collective may wait for a peer before the rank gives up."""
    return max(10.0, 2.0 * node_timeout_s)


class RankGroup:
    """The node's gloo group: tiny control collectives on top of `torch.distributed`.

    `rendezvous` is, on rank 0, the listening socket of the group's store (`rendezvous_listener`;
    the store takes it over), on the other ranks its (host, port). Every rank's gloo sockets
    listen on that host too, or on `bind_host` (a rank on another host: its own address)."""

    def __init__(
        self,
        rank: int,
        world: int,
        rendezvous: socket.socket | tuple[str, int],
        timeout_s: float,
        bind_host: str | None = None,
        *,
        node: str = "",
        security: CurveSecurity | None = None,
    ):
        """`node` and `security` (the cluster's CURVE keys, None: plain) make the group's token
        and secure its store (`runtime.rank_store`)."""
        wait = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        token = group_token(node, security)
        self.server = None
        if rank == 0:
            host, port = rendezvous.getsockname()[:2]
            self.server = StoreServer(rendezvous, token, security)
        else:
            host, port = rendezvous
        self.store = AuthStore(f"tcp://{host}:{port}", token, security, wait)
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = gloo_on(bind_host or host)
        try:
            dist.init_process_group(
                backend, store=self.store, rank=rank, world_size=world, timeout=timeout
            )
        except BaseException:
            self._close_store()
            raise
        self.rank, self.world = rank, world

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank (others pass None)."""
        size = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(size, 0)
        n = int(size.item())
        if n == 0:
            return b""
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, 0)
        return buf.numpy().tobytes()

    def all_gather(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (same length everywhere), by rank."""
        mine = torch.tensor(row, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine)
        return [r.tolist() for r in rows]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._close_store()

    def _close_store(self) -> None:
        self.store.close()
        if self.server is not None:
            self.server.close()


def gloo_on(host: str) -> str:
    """The name of a `torch.distributed` backend that is gloo with its sockets on `host`,
    registered in this process. Plain "gloo" listens wherever the machine's hostname resolves
    (127.0.0.1 on many hosts, a public address on others), and takes no address but an
    interface name in GLOO_SOCKET_IFNAME; this one is the same ProcessGroupGloo on a device
    made for `host`."""

    def create(store, rank: int, world: int, timeout: datetime.timedelta):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, world, options)

    dist.Backend.register_backend(GLOO_BACKEND, create, devices=["cpu"])
    return GLOO_BACKEND


def rendezvous_listener(cfg) -> socket.socket:
    """Rank 0's listening socket for the group's store, on `cfg.group_host` at its
    `group_port` (a prefill node's; else a free port) (`cfg`: a node config with `ranks`).

    A node that binds every interface may name in `host` an address that is not this machine's
    (a load balancer's, a DNS name that does not resolve yet): its ranks, all on this machine,
    then meet on 127.0.0.1 (logged). A `bind_host` that is not this machine's is a ConfigError."""
    hosts = [cfg.group_host, *(["127.0.0.1"] if cfg.binds_every_interface else [])]
    if getattr(cfg, "rank_hosts", ()):  # ranks elsewhere reach rank 0 at its host only
        hosts = hosts[:1]
    port = getattr(cfg, "group_port", 0)
    errors = []
    for host in hosts:
        sock = socket.socket()
        # A fixed group_port: a restarted rank 0 listens again at once (TIME_WAIT aside).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:  # socket.gaierror too: a name that does not resolve
            sock.close()
            errors.append(f"{host}: {exc.strerror or exc}")
            continue
        if errors:
            log.warning(
                "the ranks of %s meet on %s (cannot listen on %s)", cfg.name, host, errors[0]
            )
        sock.listen(2 * cfg.ranks)
        return sock
    raise ConfigError(
        f"node {cfg.name}: the ranks cannot listen on {'; '.join(errors)}; set bind_host "
        f"to this machine's address on the cluster network"
    )


class RankZero:
    """Rank 0's side of a node's ranks, as its role's `__main__` loads and builds it: the
    --config and --model of its command line (the ranks it starts get the same), the
    rendezvous listener, the ranks it started, and their end when the node fails to build."""

    def __init__(self, argv: list[str] | None):
        p = argparse.ArgumentParser(add_help=False)
        p.add_argument("--config")
        p.add_argument("--model")
        self.args, _ = p.parse_known_args(argv)
        self.children: list[subprocess.Popen] = []
        self.listener: socket.socket | None = None  # the group's store is served on it

    def start_ranks(self, module: str, cfg, spawn: bool = True) -> None:
        """Listens for the ranks (`rendezvous_listener`) and, with `spawn`, starts ranks
        1..R-1 (`python -m <module>`) on this machine to meet there."""
        self.listener = rendezvous_listener(cfg)
        if spawn:
            new_run_token()  # this run's ranks inherit it; no other process has it
            where = self.listener.getsockname()[:2]
            self.children = spawn_ranks(
                module, self.args.config, cfg.name, cfg.ranks, where, self.args.model
            )

    def kill_children(self) -> None:
        for proc in self.children:
            proc.kill()


def spawn_ranks(
    module: str,
    config: str,
    node: str,
    world: int,
    rendezvous: tuple[str, int],
    model_dir: str | None,
):
    """Starts ranks 1..world-1 (`python -m <module> ... --rank r`, parsed by `rank_args`) as
    children that get SIGTERM if this process dies; they join the group at rank 0's
    `rendezvous` (host, port)."""
    host, port = rendezvous
    cmd = [sys.executable, "-m", module, "--config", config, "--node", node,
           "--dist-host", host, "--dist-port", str(port)]  # fmt: skip
    if model_dir:
        cmd += ["--model", model_dir]
    return [
        subprocess.Popen(
            [*cmd, "--rank", str(r)], stdin=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        for r in range(1, world)
    ]


def die_with_parent() -> None:
    """In a rank before exec: SIGTERM when rank 0 dies, however it dies (a rank alone would
    wait for its peers until the collective timeout)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def reap_children(children: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Waits for the ranks rank 0 started, killing the ones still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for proc in children:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def rank_args(module: str, argv: list[str] | None) -> argparse.Namespace:
    """The command line `spawn_ranks` gives a rank: --config --node --rank --dist-host
    --dist-port [--model] (a prefill rank on another host, started by hand, has no --dist-*:
    it meets rank 0 where the config says)."""
    p = argparse.ArgumentParser(prog=f"python -m {module}")
    p.add_argument("--config", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--dist-host")
    p.add_argument("--dist-port", type=int)
    p.add_argument("--model")
    return p.parse_args(argv)

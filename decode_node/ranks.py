"""A decode node of `ranks` > 1 processes: data-parallel attention, expert-parallel MoE.

Rank 0 is the process the router knows (`python -m decode_node`): it binds the control socket,
starts ranks 1..R-1 as child processes (`python -m decode_node.ranks ... --rank r`), and the
ranks join a gloo group through a TCP store rank 0 serves on a free port. The store and the
group's own sockets listen on one address, the node's `group_host` (its bound address, or its
`host` when it binds every interface; see `rendezvous_listener`), which rank 0 passes to the
others: torch alone would bind the store to every interface and gloo to whatever the machine's
hostname resolves to (often 127.0.0.1).

Every rank owns its own KV pool and ZmqReceiver (rank 0 at the config's `kv_port`, the others on
free ports: `kv_port + r` could be another node's port; all bound on `bind_host` and advertised
at `host`), its own scheduler, and a PUSH socket to the router for its ReserveReply / StepTokens
/ RequestError messages (they carry the request id, not the sender). One step, on every rank in
lockstep:
1. control: rank 0 drains the router's messages and broadcasts them as msgpack (protocol
   frames, no pickle), each Reserve tagged with the rank it chose (fewest context tokens in
   flight among the ranks with room for it), Aborts for every rank, and the stop flag;
2. each rank applies its share, drains its KV events, expires, schedules its batch;
3. stats: all_gather of a few ints per rank (batch size, free pages, tokens in flight, ...),
   which rank 0 uses for the next picks, its waits and the node's heartbeat;
4. if any rank has a batch, every rank runs the forward: its own batch, or `idle_step` (the
   MoE exchanges with no tokens of its own), so the collectives always match.

A rank that dies breaks the next collective (its sockets close; a hung one hits the group's
timeout): the survivors fail what they hold (RequestError) and the node reports NodeFailed.
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

import msgpack
import torch
import torch.distributed as dist

from decode_node.expert_parallel import ExpertParallel, check_shardable, expert_shard
from decode_node.node import MAX_DRAIN, DecodeNode
from decode_node.scheduler import DecodeState
from engine import protocol
from engine.cluster_config import ClusterConfig, DecodeNodeConfig
from engine.errors import ConfigError
from engine.protocol import Abort, Heartbeat, NodeFailed, Reserve

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 600.0  # ranks load their shards in parallel; the slowest must make it
GLOO_BACKEND = "duet_gloo"  # gloo bound to the node's group_host (`_gloo_on`)
# Per-rank stats gathered every step (int64).
BATCH, FREE_PAGES, IN_FLIGHT, AWAITING, READY, RUNNING, KV_BYTES, DROPPED = range(8)
PREEMPTED = 8  # on-demand decode KV: requests the rank preempted, cumulative
MTP_DRAFTED, MTP_ACCEPTED, MTP_EMITTED, MTP_STEPS = 9, 10, 11, 12  # MTP counters, cumulative
NUM_STATS = 13


def collective_timeout_s(node_timeout_s: float) -> float:
    """How long a collective may wait for a peer before the rank gives up."""
    return max(10.0, 2.0 * node_timeout_s)


class RankGroup:
    """The node's gloo group: tiny control collectives on top of `torch.distributed`.

    `rendezvous` is, on rank 0, the listening socket of the group's store (`rendezvous_listener`;
    the store takes it over), on the other ranks its (host, port). Every rank's gloo sockets
    listen on that host too."""

    def __init__(
        self, rank: int, world: int, rendezvous: socket.socket | tuple[str, int], timeout_s: float
    ):
        wait = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        if rank == 0:
            (host, port), fd = rendezvous.getsockname()[:2], rendezvous.detach()
            store = dist.TCPStore(
                host, port, world, is_master=True, timeout=wait, master_listen_fd=fd
            )
        else:
            host, port = rendezvous
            store = dist.TCPStore(host, port, world, is_master=False, timeout=wait)
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = _gloo_on(host)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
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


class RankDecodeNode(DecodeNode):
    """One rank of a multi-rank decode node (rank 0 also holds the router's inbox)."""

    forward_errors_are_fatal = True
    supports_overlap = False

    def __init__(self, name, model, cfg, timeouts, inbox, outbox, receiver, group: RankGroup,
                 ep: ExpertParallel, children: list[subprocess.Popen] | None = None,
                 sla=None):  # fmt: skip
        super().__init__(name, model, cfg, timeouts, inbox, outbox, receiver, sla)
        self.rank, self.num_ranks = group.rank, group.world
        self.group, self.ep = group, ep
        if self.speculative is not None:  # MTP: the same MTP exchanges on every rank a step
            ep.mtp_passes = cfg.mtp_tokens
            self.speculative.ep = ep
        self.children = children or []
        self._stats = [[0] * NUM_STATS for _ in range(group.world)]
        self._stopped = False
        self._orphan_reason = ""  # rank 0: the lease lapsed or the router changed; all ranks drop
        self.num_reserved = 0  # Reserve messages this rank was given

    def ready_info(self):
        info = super().ready_info()
        info["num_pages"] = self.pool.num_pages * self.num_ranks
        return info

    def run(self) -> None:
        try:
            while not self._stopped:
                self.step()
        except BaseException as exc:  # a peer died or hung: fail what this rank holds, re-raise
            if isinstance(exc, Exception):
                self.report_failure(exc)
            self.close(f"decode rank {self.rank} failed: {type(exc).__name__}: {exc}")
            self._reap_children()
            raise
        log.info("rank %d: %d requests reserved here", self.rank, self.num_reserved)
        self.close("the decode node is shutting down")
        self.group.close()
        self._reap_children()

    def step(self) -> None:
        # 1. Control from rank 0.
        control = self.group.broadcast_bytes(self._plan() if self.rank == 0 else None)
        body = msgpack.unpackb(control, raw=False) if control else {"msgs": [], "stop": False}
        for target, frame in body["msgs"]:
            if target in (-1, self.rank):
                msg = protocol.decode(frame)
                self.num_reserved += isinstance(msg, Reserve)
                self._handle(msg)
        if body.get("orphan"):
            DecodeNode._orphan_all(self, body["orphan"])
        stop = bool(body["stop"])
        self.is_stopping = self.is_stopping or stop
        # 2. KV events, expiry, this rank's batch.
        for event in self.receiver.poll(0.0):
            self._on_transfer(event)
        for request in self.scheduler.expire(time.monotonic()):
            self._error(request.request_id, "decode", f"decode timed out: {request.error}")
        # Preemption (on-demand KV) is this rank's own business: its scheduler drops requests
        # before the stats, so the BATCH figure below, which decides the forward, is exact.
        batch = [] if stop else self.scheduler.schedule(self.batch_cap())
        self._report_preempted()
        # 3. Everyone's stats; 4. the forward, on every rank if any rank has work.
        self._stats = self.group.all_gather(self._local_stats(len(batch)))
        if any(row[BATCH] for row in self._stats):
            if batch:
                self._decode(batch)
            else:
                self.ep.idle_step()
        if self.rank == 0:
            self._maybe_heartbeat()
        self._stopped = stop

    # ---- rank 0: planning ------------------------------------------------------------------
    def _plan(self) -> bytes:
        stats = self._stats
        if any(row[READY] + row[RUNNING] for row in stats):
            wait = 0.0
        elif any(row[AWAITING] for row in stats):
            wait = 0.001
        else:
            wait = min(0.05, self.timeouts.heartbeat_s)
        free = [row[FREE_PAGES] for row in stats]
        in_flight = [row[IN_FLIGHT] for row in stats]
        msgs, num_handled = [], 0
        msg = self.inbox.recv(wait)
        while msg is not None:
            if isinstance(msg, Reserve) and not (self.is_stopping or self.is_draining):
                rank = self._pick_rank(msg, free, in_flight)
                msgs.append([rank, protocol.encode(msg)])
            elif isinstance(msg, Abort):
                msgs.append([-1, protocol.encode(msg)])
            else:  # Shutdown sets is_stopping; a Reserve while stopping/draining is refused here
                self._handle(msg)
            num_handled += 1
            msg = self.inbox.recv(0.0) if num_handled < MAX_DRAIN else None
        now = time.monotonic()
        if self.lease.lapsed(now):
            self._orphan_all(f"no word from the router for {self.timeouts.lease_s:g} s")
        held = sum(row[AWAITING] + row[READY] + row[RUNNING] for row in stats)
        if self.is_draining and (not held or now >= self._drain_deadline):
            self.is_stopping = True
        orphan, self._orphan_reason = self._orphan_reason, ""
        body = {"msgs": msgs, "stop": self.is_stopping, "orphan": orphan}
        return msgpack.packb(body, use_bin_type=True)

    def _orphan_all(self, reason: str) -> None:
        """On rank 0 (the only one that hears the router): every rank drops its requests at
        the next step, from the plan."""
        self._orphan_reason = reason

    def _pick_rank(self, msg: Reserve, free: list[int], in_flight: list[int]) -> int:
        """The rank with the fewest context tokens in flight among those with room (else the
        one with the most free pages, which refuses with its reason); updates the estimates.
        Room is what the reservation takes now, by the scheduler's rule (on_demand or
        worst_case)."""
        max_new = msg.sampling.get("max_new_tokens", 1)
        max_new = max_new if isinstance(max_new, int) and max_new > 0 else 1
        n = msg.sampling.get("n", 1)
        n = n if isinstance(n, int) and 0 < n <= len(msg.fork_ids) + 1 else 1
        need = self.scheduler.pages_for(msg.prompt_len, max_new, n)
        fits = [r for r in range(self.num_ranks) if free[r] >= need]
        if fits:
            rank = min(fits, key=lambda r: (in_flight[r], r))
        else:
            rank = max(range(self.num_ranks), key=lambda r: (free[r], -r))
        free[rank] -= need
        in_flight[rank] += msg.prompt_len
        return rank

    def _local_stats(self, batch_size: int) -> list[int]:
        requests = self.scheduler.requests
        kv = self.receiver.stats()
        row = [0] * NUM_STATS
        row[BATCH] = batch_size
        row[FREE_PAGES] = self.pool.allocator.num_free
        row[IN_FLIGHT] = sum(r.prompt_len + len(r.output_ids) for r in requests)
        row[AWAITING] = sum(r.state == DecodeState.AWAITING_KV for r in requests)
        row[READY] = sum(r.state == DecodeState.READY for r in requests)
        row[RUNNING] = sum(r.state == DecodeState.RUNNING for r in requests)
        row[KV_BYTES], row[DROPPED] = kv.bytes_written, kv.num_dropped
        row[PREEMPTED] = self.scheduler.num_preempted
        if self.speculative is not None:
            s = self.speculative.stats
            row[MTP_DRAFTED : MTP_STEPS + 1] = s.drafted, s.accepted, s.emitted, s.request_steps
        return row

    def _maybe_heartbeat(self) -> None:
        """The node's heartbeat: the sums over ranks of the last gathered stats."""
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.timeouts.heartbeat_s
        total = [sum(col) for col in zip(*self._stats, strict=True)]
        self.outbox.send(
            Heartbeat(
                self.name, "decode",
                num_waiting=total[AWAITING] + total[READY], num_running=total[RUNNING],
                free_pages=total[FREE_PAGES], total_pages=self.pool.num_pages * self.num_ranks,
                page_size=self.pool.page_size, kv_bytes_received=total[KV_BYTES],
                kv_chunks_dropped=total[DROPPED], num_malformed=self.inbox.num_malformed,
                stage_ms=self.stage_times.means(), draining=self.is_draining,
                num_preempted=total[PREEMPTED],
                timing_samples=self.timing_samples.take(),
                **self._mtp_totals(total),
            )
        )  # fmt: skip

    def _mtp_totals(self, total: list[int]) -> dict[str, int]:
        if self.speculative is None:
            return {}
        return dict(mtp_drafted=total[MTP_DRAFTED], mtp_accepted=total[MTP_ACCEPTED],
                    mtp_emitted=total[MTP_EMITTED], mtp_request_steps=total[MTP_STEPS])  # fmt: skip

    def _reap_children(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.children:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _gloo_on(host: str) -> str:
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


# ---- building a rank -------------------------------------------------------------------------
def build_rank(cluster: ClusterConfig, cfg: DecodeNodeConfig, model, rank: int,
               rendezvous: socket.socket | tuple[str, int], inbox, outbox, children=None,
               security=None) -> RankDecodeNode:  # fmt: skip
    """Joins the group (`rendezvous` as in RankGroup), installs expert parallelism, binds this
    rank's KV receiver (CURVE with `security`, an engine.security.CurveSecurity; plain with
    None)."""
    from kvtransfer import ZmqReceiver, make_fingerprint

    timeout = collective_timeout_s(cluster.timeouts.node_timeout_s)
    group = RankGroup(rank, cfg.ranks, rendezvous, timeout)
    try:
        ep = ExpertParallel(model, rank, cfg.ranks)
        mcfg = model.cfg
        pool = model.new_kv_pool(cfg.num_pages, cfg.page_size)
        fingerprint = make_fingerprint(
            mcfg.fingerprint(), model.num_kv_layers, mcfg.kv_row_width, model.dtype
        )
        endpoint = cfg.kv_bind_endpoint if rank == 0 else f"tcp://{cfg.listen_host}:0"
        receiver = ZmqReceiver(
            pool, fingerprint, endpoint, advertise_host=cfg.host, security=security
        )
    except Exception:
        group.close()
        raise
    return RankDecodeNode(cfg.name, model, cfg, cluster.timeouts, inbox, outbox, receiver, group,
                          ep, children, cluster.sla)  # fmt: skip


def shard_of(cluster: ClusterConfig, cfg: DecodeNodeConfig, model_dir: str | None, rank: int):
    """This rank's expert range (ConfigError if the model has fewer experts than ranks)."""
    from engine.config import ModelConfig
    from engine.tiny_model import ensure_tiny_model

    mcfg = ModelConfig.from_model_dir(model_dir or cluster.model or str(ensure_tiny_model()))
    check_shardable(mcfg.n_routed_experts, cfg.ranks)
    return expert_shard(mcfg.n_routed_experts, rank, cfg.ranks)


def rendezvous_listener(cfg: DecodeNodeConfig) -> socket.socket:
    """Rank 0's listening socket for the group's store, on a free port of `cfg.group_host`.

    A node that binds every interface may name in `host` an address that is not this machine's
    (a load balancer's, a DNS name that does not resolve yet): its ranks, all on this machine,
    then meet on 127.0.0.1 (logged). A `bind_host` that is not this machine's is a ConfigError."""
    hosts = [cfg.group_host, *(["127.0.0.1"] if cfg.binds_every_interface else [])]
    errors = []
    for host in hosts:
        sock = socket.socket()
        try:
            sock.bind((host, 0))
        except OSError as exc:  # socket.gaierror too: a name that does not resolve
            sock.close()
            errors.append(f"{host}: {exc.strerror or exc}")
            continue
        if errors:
            log.warning("the decode ranks meet on %s (cannot listen on %s)", host, errors[0])
        sock.listen(2 * cfg.ranks)
        return sock
    raise ConfigError(
        f"node {cfg.name}: the decode ranks cannot listen on {'; '.join(errors)}; set bind_host "
        f"to this machine's address on the cluster network"
    )


def spawn_ranks(config: str, node: str, world: int, rendezvous: tuple[str, int],
                model_dir: str | None):  # fmt: skip
    """Starts ranks 1..world-1 as children that get SIGTERM if this process dies; they join the
    group at rank 0's `rendezvous` (host, port)."""
    host, port = rendezvous
    cmd = [sys.executable, "-m", "decode_node.ranks", "--config", config, "--node", node,
           "--dist-host", host, "--dist-port", str(port)]  # fmt: skip
    if model_dir:
        cmd += ["--model", model_dir]
    return [
        subprocess.Popen(
            [*cmd, "--rank", str(r)], stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )  # fmt: skip
        for r in range(1, world)
    ]


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


# ---- ranks 1..R-1 ----------------------------------------------------------------------------
def worker_main(argv: list[str] | None = None) -> int:
    """`python -m decode_node.ranks --config F --node N --rank R --dist-host H --dist-port P
    [--model DIR]`
    (started by rank 0; 0 after a clean stop, 1 on failure, reported to the router)."""
    from engine.messaging import PushSocket
    from engine.node_process import load_model
    from engine.security import cluster_security

    p = argparse.ArgumentParser(prog="python -m decode_node.ranks")
    p.add_argument("--config", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--dist-host", required=True)
    p.add_argument("--dist-port", type=int, required=True)
    p.add_argument("--model")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.node}[{args.rank}] %(levelname)s %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops rank 0, which stops us
    try:
        cluster = ClusterConfig.load(args.config)
        cfg = cluster.node(args.node)
        if not isinstance(cfg, DecodeNodeConfig) or not 0 < args.rank < cfg.ranks:
            raise ConfigError(f"node {args.node!r} has no decode rank {args.rank}")
        who = f"node {args.node} rank {args.rank}"
        security = cluster_security(cluster.security, args.config, who)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    outbox = PushSocket(cluster.router.control_endpoint, security=security)
    status = 0
    try:
        shard = shard_of(cluster, cfg, args.model, args.rank)
        model = load_model(cluster, cfg, args.model, expert_range=shard)
        rendezvous = (args.dist_host, args.dist_port)
        node = build_rank(
            cluster, cfg, model, args.rank, rendezvous, None, outbox, security=security
        )
        log.info("rank %d ready: experts %s, KV %s", args.rank, shard, node.receiver.endpoint)
        node.run()
    except Exception as exc:  # a broken peer, a bad shard: the node is unhealthy
        log.error("rank %d failed: %s", args.rank, exc)
        outbox.send(
            NodeFailed(cfg.name, "decode", f"rank {args.rank}: {type(exc).__name__}: {exc}")
        )
        status = 1
    outbox.linger(1.0)
    outbox.close()
    return status


if __name__ == "__main__":
    sys.exit(worker_main())

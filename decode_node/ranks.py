"""A decode node of `ranks` > 1 processes: data-parallel attention, expert-parallel MoE.

Rank 0 is the process the router knows (`python -m decode_node`): it binds the control socket,
starts ranks 1..R-1 as child processes (`python -m decode_node.ranks ... --rank r`), and the
ranks join a gloo group (`runtime.rank_group`: where they meet, how they die with rank 0).

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

import logging
import signal
import socket
import subprocess
import sys
import time

import msgpack

from control import protocol
from control.cluster_config import ClusterConfig, DecodeNodeConfig
from control.errors import ConfigError
from control.protocol import Abort, Heartbeat, NodeFailed, Reserve
from decode_node.expert_parallel import ExpertParallel, check_shardable, expert_shard
from decode_node.node import DecodeNode
from decode_node.scheduler import DecodeState
from runtime.node_loop import MAX_DRAIN
from runtime.rank_group import RankGroup, collective_timeout_s, rank_args, reap_children

log = logging.getLogger(__name__)

# Per-rank stats gathered every step (int64).
BATCH, FREE_PAGES, IN_FLIGHT, AWAITING, READY, RUNNING, KV_BYTES, DROPPED = range(8)
PREEMPTED = 8  # on-demand decode KV: requests the rank preempted, cumulative
MTP_DRAFTED, MTP_ACCEPTED, MTP_EMITTED, MTP_STEPS = 9, 10, 11, 12  # MTP counters, cumulative
NUM_STATS = 13


class RankDecodeNode(DecodeNode):
    """One rank of a multi-rank decode node (rank 0 also holds the router's inbox)."""

    forward_errors_are_fatal = True
    supports_overlap = False

    def __init__(
        self,
        name,
        model,
        cfg,
        timeouts,
        inbox,
        outbox,
        receiver,
        group: RankGroup,
        ep: ExpertParallel,
        children: list[subprocess.Popen] | None = None,
        sla=None,
    ):
        super().__init__(name, model, cfg, timeouts, inbox, outbox, receiver, sla)
        self.rank, self.num_ranks = group.rank, group.world
        self.group, self.ep = group, ep
        if self.speculative is not None:  # MTP: the same MTP exchanges on every rank a step
            ep.mtp_passes = cfg.mtp_tokens
            self.speculative.ep = ep
        self.children = children or []
        self._stats = [[0] * NUM_STATS for _ in range(group.world)]
        self._stopped = False
        # Rank 0: routers whose lease lapsed or who restarted, [replica, reason] each: every
        # rank drops their requests.
        self._orphans: list[list] = []
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
                self.dispatch(msg)
        for replica, reason in body.get("orphans", []):
            self.abort_all(reason, replica)
        stop = bool(body["stop"])
        self.is_stopping = self.is_stopping or stop
        # 2. KV events, expiry, this rank's batch.
        for event in self.receiver.poll(0.0):
            self.on_transfer(event)
        for request in self.scheduler.expire(time.monotonic()):
            self.report_error(request.request_id, "decode", f"decode timed out: {request.error}")
        # Preemption (on-demand KV) is this rank's own business: its scheduler drops requests
        # before the stats, so the BATCH figure below, which decides the forward, is exact.
        batch = [] if stop else self.scheduler.schedule(self.batch_cap())
        self.report_preempted()
        # 3. Everyone's stats; 4. the forward, on every rank if any rank has work.
        self._stats = self.group.all_gather(self._local_stats(len(batch)))
        if any(row[BATCH] for row in self._stats):
            if batch:
                self.decode_batch(batch)
            else:
                self.ep.idle_step()
        if self.rank == 0:
            self.maybe_heartbeat()
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
                self.dispatch(msg)
            num_handled += 1
            msg = self.inbox.recv(0.0) if num_handled < MAX_DRAIN else None
        self.check_lease_and_drain(time.monotonic())
        orphans, self._orphans = self._orphans, []
        body = {"msgs": msgs, "stop": self.is_stopping, "orphans": orphans}
        return msgpack.packb(body, use_bin_type=True)

    def orphan(self, replica: int, reason: str) -> None:
        """On rank 0 (the only one that hears the router): every rank drops router `replica`'s
        requests at the next step, from the plan."""
        self._orphans.append([replica, reason])

    def num_held(self) -> int:
        """The requests of all ranks, as last gathered."""
        return sum(row[AWAITING] + row[READY] + row[RUNNING] for row in self._stats)

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

    def heartbeat(self) -> Heartbeat:
        """The node's heartbeat: the sums over ranks of the last gathered stats."""
        total = [sum(col) for col in zip(*self._stats, strict=True)]
        return Heartbeat(
            self.name,
            "decode",
            num_waiting=total[AWAITING] + total[READY],
            num_running=total[RUNNING],
            free_pages=total[FREE_PAGES],
            total_pages=self.pool.num_pages * self.num_ranks,
            page_size=self.pool.page_size,
            kv_bytes_received=total[KV_BYTES],
            kv_chunks_dropped=total[DROPPED],
            num_malformed=self.inbox.num_malformed,
            stage_ms=self.stage_times.means(),
            draining=self.is_draining,
            num_preempted=total[PREEMPTED],
            timing_samples=self.timing_samples.take(),
            **self._mtp_totals(total),
        )

    def _mtp_totals(self, total: list[int]) -> dict[str, int]:
        if self.speculative is None:
            return {}
        return dict(
            mtp_drafted=total[MTP_DRAFTED],
            mtp_accepted=total[MTP_ACCEPTED],
            mtp_emitted=total[MTP_EMITTED],
            mtp_request_steps=total[MTP_STEPS],
        )

    def _reap_children(self) -> None:
        reap_children(self.children)


# ---- building a rank -------------------------------------------------------------------------
def build_rank(
    cluster: ClusterConfig,
    cfg: DecodeNodeConfig,
    model,
    rank: int,
    rendezvous: socket.socket | tuple[str, int],
    inbox,
    outbox,
    children=None,
    security=None,
) -> RankDecodeNode:
    """Joins the group (`rendezvous` as in RankGroup), installs expert parallelism, binds this
    rank's KV receiver (CURVE with `security`, a control.security.CurveSecurity; plain with
    None)."""
    from control.security import kv_link
    from kvtransfer import ZmqReceiver, make_fingerprint

    timeout = collective_timeout_s(cluster.timeouts.node_timeout_s)
    group = RankGroup(rank, cfg.ranks, rendezvous, timeout, node=cfg.name, security=security)
    try:
        ep = ExpertParallel(model, rank, cfg.ranks)
        mcfg = model.cfg
        pool = model.new_kv_pool(cfg.num_pages, cfg.page_size)
        fingerprint = make_fingerprint(
            mcfg.fingerprint(), model.num_kv_layers, mcfg.kv_row_width, model.dtype
        )
        endpoint = cfg.kv_bind_endpoint if rank == 0 else f"tcp://{cfg.listen_host}:0"
        kv_security, seal = kv_link(cluster.security, security)
        receiver = ZmqReceiver(
            pool, fingerprint, endpoint, advertise_host=cfg.host, security=kv_security, seal=seal
        )
    except Exception:
        group.close()
        raise
    return RankDecodeNode(
        cfg.name,
        model,
        cfg,
        cluster.timeouts,
        inbox,
        outbox,
        receiver,
        group,
        ep,
        children,
        cluster.sla,
    )


def shard_of(cluster: ClusterConfig, cfg: DecodeNodeConfig, model_dir: str | None, rank: int):
    """This rank's expert range (ConfigError if the model has fewer experts than ranks)."""
    from control.model_config import ModelConfig
    from runtime.node_process import model_dir_of

    mcfg = ModelConfig.from_model_dir(model_dir_of(cluster, model_dir))
    check_shardable(mcfg.n_routed_experts, cfg.ranks)
    return expert_shard(mcfg.n_routed_experts, rank, cfg.ranks)


# ---- ranks 1..R-1 ----------------------------------------------------------------------------
def worker_main(argv: list[str] | None = None) -> int:
    """`python -m decode_node.ranks --config F --node N --rank R --dist-host H --dist-port P
    [--model DIR]`
    (started by rank 0; 0 after a clean stop, 1 on failure, reported to the router)."""
    from control.router_links import connect_routers
    from control.security import cluster_security
    from runtime.node_process import load_model

    args = rank_args("decode_node.ranks", argv)
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
        if args.dist_host is None or args.dist_port is None:
            raise ConfigError("a decode rank is started by its rank 0 (--dist-host/--dist-port)")
        who = f"node {args.node} rank {args.rank}"
        security = cluster_security(cluster.security, args.config, who)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    outbox = connect_routers(cluster.router.control_endpoints, security)
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

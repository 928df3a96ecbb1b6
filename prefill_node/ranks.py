"""A prefill node of `ranks` > 1 processes: tensor parallelism, `parallel = "tp"`
(`model.tensor_parallel`) or "tp_sp" (sequence-split, `model.sequence_parallel`).

Rank 0 (`python -m prefill_node`) is the node the router knows: its loop schedules, samples and
streams the KV as a one-rank node does. Before each forward it broadcasts the batch (the
ForwardBatch's tensors as msgpack: no pickle) to ranks 1..R-1 (`python -m prefill_node.ranks
... --rank r`), which run the same forward on their shard of the model. Its collectives ("tp":
the all-reduces after o_proj and the MLP; "tp_sp": the all-gather of the latents) give every
rank the same latent KV rows, which every rank writes at the same slots of its own pool (of
the same size): the attention of a later chunk, or of a prompt whose prefix rank 0's cache holds,
finds on every rank the rows it needs. The other ranks drop their logits.

Between forwards rank 0 broadcasts a tick at least every TICK_S, so a rank waiting for the next
batch never reaches the group's timeout, and a stop when it stops.

A rank that dies: rank 0's watchdog (a thread that polls its children) aborts the shared-memory
all-reduce, so every rank's wait ends at once (a gloo all-reduce fails by itself once the dead
rank's sockets close; a hung rank hits the group's timeout). The failed forward is fatal on rank
0: NodeFailed, then its requests' errors, which the router moves to another prefill node. Ranks
1..R-1 die with rank 0 (`runtime.rank_group.die_with_parent`).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import msgpack
import torch

from control.cluster_config import ClusterConfig, PrefillNodeConfig
from control.errors import ConfigError
from model.batch import ForwardBatch
from model.sequence_parallel import install_sequence_parallel
from model.tensor_parallel import gloo_all_reduce, install_tensor_parallel, shm_all_reduce
from prefill_node.node import PrefillNode
from runtime.rank_group import RankGroup, collective_timeout_s, rank_args, reap_children

log = logging.getLogger(__name__)

TICK_S = 1.0  # the longest rank 0 leaves the other ranks without a broadcast
WATCH_S = 0.1  # how often rank 0's watchdog looks at its children
BATCH_TENSORS = ("input_ids", "positions", "new_lens", "prefix_lens", "page_table", "slots",
                 "prefix_slots", "extra_logit_index")  # fmt: skip
DTYPES = {str(t): t for t in (torch.int32, torch.int64)}


# ---- the wire between the ranks --------------------------------------------------------------
def encode_forward(batch: ForwardBatch, op: str = "forward") -> bytes:
    """`op`: "forward", "forward_hidden" (the main forward that keeps its hidden states) or
    "mtp" (the MTP layer over them: speculative decoding's first draft)."""
    tensors = {}
    for name in BATCH_TENSORS:
        t = getattr(batch, name)
        if t is not None:
            t = t.contiguous()
            tensors[name] = [str(t.dtype), list(t.shape), t.numpy().tobytes()]
    return msgpack.packb({"op": op, "is_decode": batch.is_decode, "tensors": tensors})


def decode_forward(body: dict) -> ForwardBatch:
    fields = {}
    for name, (dtype, shape, raw) in body["tensors"].items():
        if name not in BATCH_TENSORS or dtype not in DTYPES:
            raise ValueError(f"rank 0 sent an unknown batch field {name!r} ({dtype})")
        if raw:
            fields[name] = torch.frombuffer(bytearray(raw), dtype=DTYPES[dtype]).reshape(shape)
        else:  # (frombuffer takes no empty buffer)
            fields[name] = torch.empty(shape, dtype=DTYPES[dtype])
    return ForwardBatch(is_decode=bool(body["is_decode"]), **fields)


TICK = msgpack.packb({"op": "tick"})
STOP = msgpack.packb({"op": "stop"})


# ---- joining the group -----------------------------------------------------------------------
def join_tensor_parallel(
    cluster: ClusterConfig,
    cfg: PrefillNodeConfig,
    model,
    rank: int,
    rendezvous,
    comm=None,
    security=None,
) -> tuple[RankGroup, object]:
    """Joins the node's group (`rendezvous` as in RankGroup; its store secured with `security`,
    the cluster's CURVE keys, or None) and, unless `comm` is the
    collectives of an earlier session (a rank on another host meets each rank 0 anew), makes
    `model`, this rank's shard, run its scheme (cfg.parallel: "tp" all-reduces, "tp_sp" runs
    sequence-split) over cfg.all_reduce ("shm" or "gloo"); returns the group and the
    collectives."""
    timeout = collective_timeout_s(cluster.timeouts.node_timeout_s)
    bind = cfg.hosts_of_ranks[rank]
    group = RankGroup(rank, cfg.ranks, rendezvous, timeout, bind, node=cfg.name, security=security)
    if comm is not None:  # gloo on the default group: the new group's, from now on
        return group, comm
    try:
        if cfg.all_reduce == "shm":
            comm = shm_all_reduce(rank, cfg.ranks, timeout_s=timeout)
        else:
            comm = gloo_all_reduce()
        if cfg.parallel == "tp_sp":
            install_sequence_parallel(model, comm)
        else:
            install_tensor_parallel(model, comm)
    except BaseException:
        group.close()
        raise
    return group, comm


# ---- rank 0 ----------------------------------------------------------------------------------
class RankPrefillNode(PrefillNode):
    """Rank 0 of a tensor-parallel prefill node: a PrefillNode whose forwards the other ranks
    run beside it."""

    forward_errors_are_fatal = True

    def __init__(self, *args, group: RankGroup, all_reduce, children: list[subprocess.Popen]):
        super().__init__(*args)
        self.group, self.all_reduce, self.children = group, all_reduce, children
        self._last_broadcast = time.monotonic()
        self.watchdog = RankWatchdog(children, all_reduce.abort)

    def ready_info(self):
        return {**super().ready_info(), "ranks": self.group.world}

    def run(self) -> None:
        self.watchdog.start()
        try:
            super().run()
        except BaseException:
            self._stop_children(kill=True)
            raise
        else:
            try:
                self._broadcast(STOP)
            except Exception as exc:  # a rank gone already: nothing left to stop cleanly
                log.warning("the ranks did not take the stop: %s", exc)
                self._stop_children(kill=True)
            else:
                self._stop_children(kill=False)
        finally:
            self.group.close()

    def step(self) -> None:
        super().step()
        if time.monotonic() - self._last_broadcast >= TICK_S:
            self._broadcast(TICK)

    # The forward hooks: each runs on every rank.
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self._on_every_rank("forward", batch, super().forward, batch)

    def forward_with_hidden(self, batch: ForwardBatch):
        return self._on_every_rank("forward_hidden", batch, super().forward_with_hidden, batch)

    def forward_mtp(self, batch: ForwardBatch, hidden: torch.Tensor):
        return self._on_every_rank("mtp", batch, super().forward_mtp, batch, hidden)

    def _on_every_rank(self, op: str, batch: ForwardBatch, forward, *args):
        """Sends the other ranks `op` over `batch`, then runs `forward(*args)` here."""
        self._broadcast(encode_forward(batch, op))
        try:
            return forward(*args)
        except Exception as exc:
            if self.watchdog.finding:
                raise RuntimeError(f"{self.watchdog.finding} ({exc})") from exc
            raise

    def _broadcast(self, payload: bytes) -> None:
        self.group.broadcast_bytes(payload)
        self._last_broadcast = time.monotonic()

    def _stop_children(self, kill: bool) -> None:
        self.watchdog.stop()  # their exits are expected from here on
        if kill:
            for proc in self.children:
                proc.kill()
        reap_children(self.children)


class RankWatchdog:
    """A thread of rank 0 that polls its children every WATCH_S: the first to exit (before
    `stop`) is the finding, and `abort` (the collectives': the shared-memory one ends every
    rank's wait at once; gloo's waits fail by themselves when the dead rank's sockets close)
    is called."""

    def __init__(self, children: list[subprocess.Popen], abort: Callable[[], None]):
        self.children, self.abort = children, abort
        self.finding = ""
        self._watching = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rank-watchdog", daemon=True)

    def start(self) -> None:
        self._watching.set()
        self._thread.start()

    def stop(self) -> None:
        self._watching.clear()

    def _watch(self) -> None:
        while self._watching.is_set():
            for r, proc in enumerate(self.children, start=1):
                code = proc.poll()
                if code is not None and self._watching.is_set():
                    self.finding = f"prefill rank {r} exited with status {code}"
                    log.error("%s: aborting the group", self.finding)
                    self.abort()
                    self._watching.clear()
                    return
            time.sleep(WATCH_S)


# ---- ranks 1..R-1 ----------------------------------------------------------------------------
def follow(model, pool, group: RankGroup) -> int:
    """Runs rank 0's forwards on this rank's shard until its stop; the forwards run. The MTP
    layer runs over this rank's own hidden states of the forward before it: the same as rank
    0's, all-reduced."""
    num_forwards, hidden = 0, None
    while True:
        body = msgpack.unpackb(group.broadcast_bytes(None), raw=False)
        op = body["op"]
        if op == "stop":
            return num_forwards
        if op == "forward":
            model.forward(decode_forward(body), pool)
        elif op == "forward_hidden":
            _, hidden = model.forward_with_hidden(decode_forward(body), pool)
        elif op == "mtp":
            model.forward_mtp(decode_forward(body), hidden, pool)
        else:  # a tick
            continue
        num_forwards += 1


def worker_main(argv: list[str] | None = None) -> int:
    """`python -m prefill_node.ranks --config F --node N --rank R [--dist-host H --dist-port P]
    [--model DIR]`. Started by rank 0 (--dist-*): one session, 0 after rank 0's stop, 1 on
    failure (rank 0 reports the node). Started on another host (`rank_hosts`; by
    `deploy/launch_prefill_rank.sh`): it serves every rank 0 that comes (a restarted one
    too), until a signal stops it."""
    from control.placement import place_rank
    from control.security import cluster_security
    from runtime.node_process import load_model

    args = rank_args("prefill_node.ranks", argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.node}[{args.rank}] %(levelname)s %(message)s",
    )
    spawned = args.dist_host is not None
    try:
        cluster = ClusterConfig.load(args.config)
        cfg = cluster.node(args.node)
        if not isinstance(cfg, PrefillNodeConfig) or not 0 < args.rank < cfg.ranks:
            raise ConfigError(f"node {args.node!r} has no prefill rank {args.rank}")
        if not spawned and not cfg.rank_hosts:
            raise ConfigError(
                f"node {args.node}: rank {args.rank} is started by rank 0 unless the node names "
                "rank_hosts"
            )
        place_rank(cfg, args.rank)
        security = cluster_security(cluster.security, args.config, f"{args.node} rank {args.rank}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Spawned: Ctrl-C stops rank 0, which stops this rank. Elsewhere: a signal stops it at
    # once, even inside a collective (nothing of a session outlives it).
    signal.signal(signal.SIGINT, signal.SIG_IGN if spawned else signal.SIG_DFL)
    try:
        model = load_model(
            cluster, cfg, args.model, tensor_parallel=(args.rank, cfg.ranks), parallel=cfg.parallel
        )
        pool = model.new_kv_pool(cfg.num_pages, cfg.page_size)
    except Exception as exc:
        log.error("rank %d could not load its shard: %s", args.rank, exc)
        return 1
    if spawned:
        rendezvous = (args.dist_host, args.dist_port)
        return _session(cluster, cfg, model, pool, args.rank, rendezvous, None, security)[0]
    comm = None  # installed in the first session, the gloo collectives of every later one
    while True:  # rank 0's restarts: each is a new session at the same rendezvous
        log.info("rank %d: waiting for rank 0 at %s:%d", args.rank, cfg.host, cfg.group_port)
        rendezvous = (cfg.host, cfg.group_port)
        status, comm = _session(cluster, cfg, model, pool, args.rank, rendezvous, comm, security)
        if status:
            time.sleep(1.0)  # a failed session: rank 0 restarts (with backoff) before the next


def _session(
    cluster, cfg, model, pool, rank: int, rendezvous, comm, security
) -> tuple[int, object]:
    """Meets rank 0, runs its forwards until its stop (status 0) or a failure (1); returns the
    status and the collectives (None if it never joined)."""
    try:
        group, comm = join_tensor_parallel(cluster, cfg, model, rank, rendezvous, comm, security)
    except Exception as exc:  # rank 0 fails to meet this rank and reports the node
        log.error("rank %d could not join rank 0: %s", rank, exc)
        return 1, comm
    log.info("rank %d ready", rank)
    try:
        num_forwards = follow(model, pool, group)
    except Exception as exc:  # a broken peer: rank 0 fails the node (or is gone already)
        log.error("rank %d failed: %s", rank, exc)
        return 1, comm
    finally:
        group.close()
    log.info("rank %d: %d forwards", rank, num_forwards)
    return 0, comm


if __name__ == "__main__":
    sys.exit(worker_main())

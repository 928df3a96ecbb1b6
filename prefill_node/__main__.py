"""`python -m prefill_node --config FILE --node NAME [--model DIR]`: start one prefill node
(the process shell, signals and READY/FAILED reporting are in runtime/node_process.py).

With `ranks = R > 1` this process is rank 0 of a tensor-parallel node: it starts ranks 1..R-1
(`prefill_node.ranks`) before loading its own shard, so the ranks load in parallel; with
`rank_hosts` they are started on their hosts and come to its group_port."""

from __future__ import annotations

import sys

from control.cluster_config import ClusterConfig, PrefillNodeConfig
from runtime.node_process import load_model, model_dir_of, run_node_process
from runtime.rank_group import RankZero


def _build(
    cluster: ClusterConfig,
    cfg: PrefillNodeConfig,
    model,
    inbox,
    outbox,
    security,
    ranks: dict | None = None,
):
    """The node; `ranks` (rank 0 of R > 1: group, all_reduce, children) makes it rank 0."""
    from control.security import kv_link
    from kvtransfer import ZmqSender
    from kvtransfer.faults import inject, plan_from_env
    from prefill_node.node import PrefillNode

    faults = plan_from_env()  # tests only: None unless DUET_KV_FAULTS is set (logged loudly)

    # A full send queue blocks the loop (back-pressure) for at most this long; beyond it the
    # decode node counts as gone. It stays inside the router's node timeout, so a dead decode
    # node never makes this healthy prefill node look dead too.
    send_timeout = min(cluster.timeouts.transfer_s, cluster.timeouts.node_timeout_s / 2)
    kv_security, _ = kv_link(cluster.security, security)  # sealing: each Prefill carries a key
    args = (cfg.name, model, cfg, cluster.timeouts, inbox, outbox, lambda: inject(
        ZmqSender(cfg.name, send_timeout=send_timeout, security=kv_security), faults
    ))  # fmt: skip
    if ranks is None:
        return PrefillNode(*args)
    from prefill_node.ranks import RankPrefillNode

    return RankPrefillNode(*args, **ranks)


class _Rank0(RankZero):
    """Loader and builder of the node's process: pinned to its cores (`control.placement`); with
    R > 1 ranks, rank 0 that starts the others and joins their group."""

    def load(self, cluster: ClusterConfig, cfg: PrefillNodeConfig, model_dir: str | None):
        from control.placement import place_rank

        if cfg.ranks == 1:
            place_rank(cfg, 0)
            return load_model(cluster, cfg, model_dir)
        from control.model_config import ModelConfig
        from model.sharding import check_tensor_parallel

        model_dir = model_dir_of(cluster, model_dir)
        mcfg = ModelConfig.from_model_dir(model_dir)
        check_tensor_parallel(mcfg, cfg.ranks, cfg.parallel)  # before spawning
        # With rank_hosts each rank is started on its host and comes to the listener.
        self.start_ranks("prefill_node.ranks", cfg, spawn=not cfg.rank_hosts)
        place_rank(cfg, 0)  # after the spawn: the ranks start with every core this one has
        return load_model(
            cluster, cfg, model_dir, tensor_parallel=(0, cfg.ranks), parallel=cfg.parallel
        )

    def build(self, cluster: ClusterConfig, cfg: PrefillNodeConfig, model, inbox, outbox, security):
        if cfg.ranks == 1:
            return _build(cluster, cfg, model, inbox, outbox, security)
        from prefill_node.ranks import join_tensor_parallel

        try:
            group, all_reduce = join_tensor_parallel(
                cluster, cfg, model, 0, self.listener, security=security
            )
            ranks = {"group": group, "all_reduce": all_reduce, "children": self.children}
            return _build(cluster, cfg, model, inbox, outbox, security, ranks)
        except BaseException:
            self.kill_children()
            raise


def main(argv: list[str] | None = None) -> int:
    rank0 = _Rank0(argv)
    return run_node_process("prefill", PrefillNodeConfig, rank0.build, argv, load=rank0.load)


if __name__ == "__main__":
    sys.exit(main())

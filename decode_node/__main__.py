"""`python -m decode_node --config FILE --node NAME [--model DIR]`: start one decode node
(the process shell, signals and READY/FAILED reporting are in runtime/node_process.py).

With `ranks = R > 1` this process is rank 0: it starts ranks 1..R-1 (`decode_node.ranks`)
before loading its own expert shard, so the ranks load in parallel."""

from __future__ import annotations

import sys

from control.cluster_config import ClusterConfig, DecodeNodeConfig
from runtime.node_process import load_model, run_node_process
from runtime.rank_group import RankZero


def _build(cluster: ClusterConfig, cfg: DecodeNodeConfig, model, inbox, outbox, security):
    from control.security import kv_link
    from decode_node.node import DecodeNode
    from kvtransfer import ZmqReceiver, make_fingerprint

    mcfg = model.cfg
    pool = model.new_kv_pool(cfg.num_pages, cfg.page_size)
    fingerprint = make_fingerprint(
        mcfg.fingerprint(), model.num_kv_layers, mcfg.kv_row_width, model.dtype
    )
    kv_security, seal = kv_link(cluster.security, security)
    receiver = ZmqReceiver(
        pool,
        fingerprint,
        cfg.kv_bind_endpoint,
        advertise_host=cfg.host,
        security=kv_security,
        seal=seal,
    )
    return DecodeNode(cfg.name, model, cfg, cluster.timeouts, inbox, outbox, receiver, cluster.sla)


class _Rank0(RankZero):
    """Loader and builder of rank 0 of a multi-rank node (a one-rank node uses neither)."""

    def load(self, cluster: ClusterConfig, cfg: DecodeNodeConfig, model_dir: str | None):
        if cfg.ranks == 1:
            return load_model(cluster, cfg, model_dir)
        from decode_node.ranks import shard_of

        shard = shard_of(cluster, cfg, model_dir, 0)  # refuses too many ranks before spawning
        self.start_ranks("decode_node.ranks", cfg)
        return load_model(cluster, cfg, model_dir, expert_range=shard)

    def build(self, cluster: ClusterConfig, cfg: DecodeNodeConfig, model, inbox, outbox, security):
        if cfg.ranks == 1:
            return _build(cluster, cfg, model, inbox, outbox, security)
        from decode_node.ranks import build_rank

        try:
            return build_rank(
                cluster, cfg, model, 0, self.listener, inbox, outbox, self.children, security
            )
        except BaseException:
            self.kill_children()
            raise


def main(argv: list[str] | None = None) -> int:
    rank0 = _Rank0(argv)
    return run_node_process("decode", DecodeNodeConfig, rank0.build, argv, load=rank0.load)


if __name__ == "__main__":
    sys.exit(main())

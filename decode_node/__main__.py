"""`python -m decode_node --config FILE --node NAME [--model DIR]`: start one decode node
(the process shell, signals and READY/FAILED reporting are in engine/node_process.py)."""

from __future__ import annotations

import sys

from engine.cluster_config import ClusterConfig, DecodeNodeConfig
from engine.errors import ConfigError
from engine.node_process import run_node_process


def _build(cluster: ClusterConfig, cfg: DecodeNodeConfig, model, inbox, outbox):
    from decode_node.node import DecodeNode
    from kvtransfer import ZmqReceiver, make_fingerprint

    if cfg.ranks != 1:
        raise ConfigError(f"node {cfg.name}: ranks = {cfg.ranks} is not supported yet (1 only)")
    mcfg = model.cfg
    pool = model.new_kv_pool(cfg.num_pages, cfg.page_size)
    fingerprint = make_fingerprint(
        mcfg.fingerprint(), mcfg.num_hidden_layers, mcfg.kv_row_width, model.dtype
    )
    receiver = ZmqReceiver(pool, fingerprint, cfg.kv_endpoint)
    return DecodeNode(cfg.name, model, cfg, cluster.timeouts, inbox, outbox, receiver)


def main(argv: list[str] | None = None) -> int:
    return run_node_process("decode", DecodeNodeConfig, _build, argv)


if __name__ == "__main__":
    sys.exit(main())

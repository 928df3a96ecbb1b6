"""`python -m prefill_node --config FILE --node NAME [--model DIR]`: start one prefill node
(the process shell, signals and READY/FAILED reporting are in engine/node_process.py)."""

from __future__ import annotations

import sys

from engine.cluster_config import ClusterConfig, PrefillNodeConfig
from engine.node_process import run_node_process


def _build(cluster: ClusterConfig, cfg: PrefillNodeConfig, model, inbox, outbox, security):
    from kvtransfer import ZmqSender
    from kvtransfer.faults import inject, plan_from_env
    from prefill_node.node import PrefillNode

    faults = plan_from_env()  # tests only: None unless DUET_KV_FAULTS is set (logged loudly)

    # A full send queue blocks the loop (back-pressure) for at most this long; beyond it the
    # decode node counts as gone. It stays inside the router's node timeout, so a dead decode
    # node never makes this healthy prefill node look dead too.
    send_timeout = min(cluster.timeouts.transfer_s, cluster.timeouts.node_timeout_s / 2)
    return PrefillNode(
        cfg.name,
        model,
        cfg,
        cluster.timeouts,
        inbox,
        outbox,
        sender_factory=lambda: inject(
            ZmqSender(cfg.name, send_timeout=send_timeout, security=security), faults
        ),
    )


def main(argv: list[str] | None = None) -> int:
    return run_node_process("prefill", PrefillNodeConfig, _build, argv)


if __name__ == "__main__":
    sys.exit(main())

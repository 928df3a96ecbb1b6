"""`python -m prefill_node --config FILE --node NAME [--model DIR]`: start one prefill node.

Reports NodeReady (or NodeFailed with the error) to the router's control endpoint, then serves
until a Shutdown message, SIGTERM or SIGINT. Exit status: 0 after a clean stop, 1 on failure,
2 for a bad command line or config (nothing to report to).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import torch

from engine.cluster_config import ClusterConfig, PrefillNodeConfig
from engine.errors import ConfigError
from engine.messaging import PullSocket, PushSocket
from engine.protocol import NodeFailed, NodeReady

ROLE = "prefill"
log = logging.getLogger("prefill_node")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prefill_node", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="cluster config (TOML)")
    p.add_argument("--node", required=True, help="this node's name in the config")
    p.add_argument("--model", help="checkpoint dir (default: the config's, else the tiny model)")
    return p.parse_args(argv)


def _build(cluster: ClusterConfig, cfg: PrefillNodeConfig, model_dir: str | None, inbox, outbox):
    from engine.model import DeepseekModel
    from engine.tiny_model import ensure_tiny_model
    from kvtransfer import ZmqSender
    from native import ops
    from prefill_node.node import PrefillNode

    if cfg.device != "cpu":
        raise ConfigError(f"node {cfg.name}: device {cfg.device!r} is not supported yet (cpu only)")
    ops.set_num_threads(cfg.threads)
    model_dir = model_dir or cluster.model or str(ensure_tiny_model())
    model = DeepseekModel.from_pretrained(model_dir, getattr(torch, cluster.dtype), progress=False)
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
        sender_factory=lambda: ZmqSender(cfg.name, send_timeout=send_timeout),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {args.node} %(levelname)s %(message)s"
    )
    try:
        cluster = ClusterConfig.load(args.config)
        cfg = cluster.node(args.node)
        if not isinstance(cfg, PrefillNodeConfig):
            raise ConfigError(f"node {args.node!r} is not a [[prefill]] node")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    router = PushSocket(cluster.router.control_endpoint)
    inbox = None
    try:
        inbox = PullSocket(cfg.control_endpoint, bind=True)
        node = _build(cluster, cfg, args.model, inbox, router)
    except KeyboardInterrupt:
        _close(router, inbox)
        return 1
    except Exception as exc:  # DuetError, OSError (port in use), anything from loading
        log.error("could not start: %s", exc)
        router.send(NodeFailed(cfg.name, ROLE, f"{type(exc).__name__}: {exc}"))
        _close(router, inbox)
        return 1

    def stop(signum, frame):  # first signal: finish the step and stop; second: exit now
        if node.is_stopping:
            raise KeyboardInterrupt
        node.is_stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    router.send(NodeReady(cfg.name, ROLE, node.ready_info()))
    log.info("ready: control %s, router %s", inbox.endpoint, router.endpoint)
    status = 0
    try:
        node.run()
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # die loudly: the router fails this node's requests at once
        log.exception("fatal error")
        router.send(NodeFailed(cfg.name, ROLE, f"{type(exc).__name__}: {exc}"))
        status = 1
    _close(router, inbox)
    return status


def _close(router: PushSocket, inbox: PullSocket | None) -> None:
    router.linger(1.0)  # let the last messages (errors, NodeFailed) leave
    router.close()
    if inbox is not None:
        inbox.close()


if __name__ == "__main__":
    sys.exit(main())

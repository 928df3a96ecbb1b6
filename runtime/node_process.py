"""The process shell shared by both node roles: `python -m prefill_node|decode_node --config
FILE --node NAME [--model DIR]`, or for a node not in the file that joins the running cluster
(`duet node`), `... --node NAME --join --control-port P [--kv-port K] [--host H]`: the first
[[prefill]] / [[decode]] entry's settings under its own name and ports
(`ClusterConfig.joining_node`); the router admits it after checking its model and KV layout.

It reports NodeReady (or NodeFailed with the error) to the router's control endpoint, then
serves until a Shutdown message or SIGINT (stop now), or SIGTERM (drain: finish what it holds
within `drain_s`, taking nothing new, then stop). Exit status: 0 after a clean stop, 1 on
failure, 2 for a bad command line or config (nothing to report to). Every socket of the node is
CURVE with the cluster keys of [security] (`control.security`), or plain with a warning for
`insecure = true`. Roles never import each other, so the shell lives here and each role passes
in how to build its node.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch

from control.cluster_config import ClusterConfig
from control.errors import ConfigError, DuetError
from control.messaging import PullSocket
from control.protocol import NodeFailed
from control.router_links import RouterLinks, connect_routers
from control.security import CurveSecurity, cluster_security

# build(cluster, node_cfg, model, inbox, outbox, security) -> a node with run(), ready_info(),
# is_stopping; `security` (None: plain) is for the node's KV sockets.
NodeBuilder = Callable[
    [ClusterConfig, Any, Any, PullSocket, RouterLinks, CurveSecurity | None], Any
]


def _parse(role: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {role}_node", description=f"start one {role} node")
    p.add_argument("--config", required=True, help="cluster config (TOML)")
    p.add_argument("--node", required=True, help="this node's name in the config")
    p.add_argument("--model", help="checkpoint dir (default: the config's, else the tiny model)")
    p.add_argument("--join", action="store_true", help="a node not in the config: join")
    p.add_argument("--control-port", type=int, default=0, help="--join: its control port")
    p.add_argument("--kv-port", type=int, default=0, help="--join, decode: its KV port")
    p.add_argument("--host", default="", help="--join: where the others reach it")
    return p.parse_args(argv)


def model_dir_of(cluster: ClusterConfig, model_dir: str | None) -> str:
    """The checkpoint a node serves: the command line's, else the config's, else the tiny
    model (made once)."""
    from control.builtin_model import ensure_builtin_model

    return model_dir or cluster.model or str(ensure_builtin_model())


def load_model(
    cluster: ClusterConfig,
    node_cfg: Any,
    model_dir: str | None,
    expert_range=None,
    tensor_parallel: tuple[int, int] | None = None,
    parallel: str = "tp",
):
    """The node's model on its device and threads (the tiny model when none is named), its
    weights in the node's `quant` scheme, its attention projections in `quant_attention`'s
    (unset: `quant`'s), its LM head in int8 with `quant_lm_head`, its MTP drafts through
    `mtp_draft_head`, mapped from its `pack` or the weights cache when the node says so
    (`model.pack_cache`);
    `expert_range` limits the routed experts held (an expert-parallel rank's shard);
    `tensor_parallel` = (rank, world) loads a tensor-parallel rank's shard of the `parallel`
    scheme ("tp" or "tp_sp")."""
    from control.placement import bound_node
    from model.pack_cache import load_model as load_weights
    from native import ops

    if node_cfg.device != "cpu":
        raise ConfigError(
            f"node {node_cfg.name}: device {node_cfg.device!r} is not supported yet (cpu only)"
        )
    ops.set_num_threads(node_cfg.threads)
    model_dir = model_dir_of(cluster, model_dir)
    try:
        model = load_weights(
            model_dir,
            getattr(torch, cluster.dtype),
            quant=node_cfg.quant,
            quant_lm_head=node_cfg.quant_lm_head,
            quant_attention=node_cfg.quant_attention or None,  # "": unset
            expert_range=expert_range,
            tensor_parallel=tensor_parallel,
            parallel=parallel,
            mtp=cluster.uses_mtp,  # the MTP layer's cache is part of every node's KV
            progress=False,
            pack=node_cfg.pack or None,
            weights_cache=node_cfg.weights_cache,
            numa_node=bound_node(),
        )
    except DuetError as exc:  # one line that names the node (the router shows it as is)
        raise type(exc)(f"node {node_cfg.name}: {exc}") from None
    if model.mtp is not None:
        model.set_draft_head(node_cfg.mtp_draft_head)
    return model


def run_node_process(
    role: str, config_type: type, build: NodeBuilder, argv=None, load=load_model
) -> int:
    """`load(cluster, node_cfg, model_dir)` -> the model (a multi-rank node loads a shard)."""
    args = _parse(role, argv)
    log = logging.getLogger(f"{role}_node")
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {args.node} %(levelname)s %(message)s"
    )
    try:
        cluster = ClusterConfig.load(args.config)
        if args.join:
            cfg = cluster.joining_node(role, args.node, args.control_port, args.kv_port, args.host)
        else:
            cfg = cluster.node(args.node)
        if not isinstance(cfg, config_type):
            raise ConfigError(f"node {args.node!r} is not a [[{role}]] node")
        security = cluster_security(cluster.security, args.config, f"node {args.node}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    router = connect_routers(cluster.router.control_endpoints, security)
    inbox = None
    try:
        inbox = PullSocket(cfg.control_bind_endpoint, bind=True, security=security)
        node = build(cluster, cfg, load(cluster, cfg, args.model), inbox, router, security)
    except KeyboardInterrupt:
        _close(router, inbox)
        return 1
    except Exception as exc:  # DuetError, OSError (port in use), anything from loading
        log.error("could not start: %s", exc)
        router.send(NodeFailed(cfg.name, role, f"{type(exc).__name__}: {exc}"))
        _close(router, inbox)
        return 1

    def stop(signum, frame):  # SIGINT: finish the step and stop; a second signal: exit now
        if node.is_stopping:
            raise KeyboardInterrupt
        node.is_stopping = True

    def drain(signum, frame):  # SIGTERM (Kubernetes, a rolling restart): drain, then stop
        if node.is_draining:
            stop(signum, frame)
        else:
            log.info("SIGTERM: draining (a second signal stops at once)")
            node.begin_drain()

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, stop)
    # Where the router reaches it: what a joining node is known by (the config's, else).
    node.advertised = {"control_endpoint": cfg.control_endpoint}
    node.send_ready()
    log.info("ready: control %s, router %s", inbox.endpoint, router.endpoint)
    status = 0
    try:
        node.run()
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # die loudly: the router fails this node's requests at once
        log.exception("fatal error")
        router.send(NodeFailed(cfg.name, role, f"{type(exc).__name__}: {exc}"))
        status = 1
    _close(router, inbox)
    return status


def _close(router: RouterLinks, inbox: PullSocket | None) -> None:
    router.linger(1.0)  # let the last messages (errors, NodeFailed) leave
    router.close()
    if inbox is not None:
        inbox.close()

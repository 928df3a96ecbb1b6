"""`python -m router --config FILE [--model DIR] [--port P] [--replica I] [--log-level L]`: the
HTTP gateway. With `[router] replicas` > 1, each router is started with its own `--replica`
(0, 1, ...): it serves HTTP on port + I and the nodes' messages on control_port + I.

Reads the cluster config (the same file every node reads), loads the tokenizer and the model's
config.json (no weights), binds the control socket the nodes report to (CURVE with the cluster
keys of [security], see control.security), and serves HTTP until SIGINT/SIGTERM (a graceful
shutdown, then exit status 0).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
from pathlib import Path

from control.errors import DuetError


def build_app(
    cfg, model_dir: str | None = None, security=None, config_path: str = "", replica: int = 0
):
    """The FastAPI app for a `ClusterConfig`, and the (host, port) it should listen on (the
    router's `bind_host`, else its `host`; replica `replica`'s port).
    `security` (a control.security.CurveSecurity) makes the node sockets CURVE; None: plain.
    `config_path`: the config's file, which the nodes an autoscaling router starts read."""
    from control.builtin_model import ensure_builtin_model
    from control.model_config import ModelConfig
    from control.tokenizer import Tokenizer
    from router.app import ModelInfo, create_app
    from router.core import Router

    model_dir = model_dir or cfg.model or str(ensure_builtin_model())
    model_cfg = ModelConfig.from_model_dir(model_dir)
    tokenizer = Tokenizer(model_dir)
    router = Router(
        cfg,
        eos_token_ids=list(model_cfg.eos_token_id),
        max_positions=model_cfg.max_position_embeddings,
        fingerprint=model_cfg.fingerprint(),
        security=security,
        replica=replica,
    )
    if cfg.autoscale.enabled and replica == 0:  # one router starts and drains nodes
        from router.autoscaler import Autoscaler, LocalLauncher

        if cfg.autoscale.launcher == "kubernetes":
            from router.k8s_launcher import K8sLauncher

            launcher = K8sLauncher(cfg.autoscale)
        else:
            launcher = LocalLauncher(config_path, model_dir)
        router.autoscaler = Autoscaler(router, launcher, cfg.autoscale)
    info = ModelInfo(
        name=Path(model_dir).name,
        path=str(model_dir),
        vocab_size=model_cfg.vocab_size,
        max_positions=model_cfg.max_position_embeddings,
    )
    own = cfg.router.for_replica(replica)
    return create_app(router, tokenizer, info), (own.listen_host, own.port)


def replica_index(text: str) -> int:
    """`--replica`: "1", or a StatefulSet pod's name ("duet-router-1"), whose ordinal it is."""
    match = re.fullmatch(r"(?:.*-)?(\d+)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor a name ending in -N")
    return int(match.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    parser.add_argument("--config", required=True, help="cluster config (TOML)")
    parser.add_argument("--model", help="checkpoint directory (overrides the config's)")
    parser.add_argument("--port", type=int, help="HTTP port (overrides the config's)")
    parser.add_argument(
        "--replica",
        type=replica_index,
        default=0,
        help="this router's place among [router] replicas: a number, or a StatefulSet pod "
        "name (NAME-i is replica i)",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s router{args.replica or ''} %(levelname)s %(message)s",
    )
    from router import request_log

    request_log.configure()  # one bare JSON line per request end
    import dataclasses

    from control.cluster_config import ClusterConfig
    from control.security import cluster_security

    try:
        cfg = ClusterConfig.load(args.config)
        if args.port is not None:
            cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, port=args.port))
        security = cluster_security(cfg.security, args.config, "the router")
        cfg.router.for_replica(args.replica)  # ConfigError for a replica the config lacks
        config_path = str(Path(args.config).resolve())
        app, (host, port) = build_app(cfg, args.model, security, config_path, args.replica)
    except DuetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # End every request with an error event first, so open streams close and the
            # graceful shutdown does not wait on them. Scheduled on the loop, not run inside
            # the signal handler, so it never interleaves with a half-done router step.
            if self.started and not self.should_exit:
                asyncio.get_event_loop().call_soon_threadsafe(app.state.router.fail_all)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5
    )
    try:
        Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT once it has shut down: a clean stop
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Health checks for a cluster's processes, run by Kubernetes probes inside the pods:

    python -m deploy.probe --config FILE [--node NAME] [--role ROLE] live|ready|router-live

- `live` (a node): the node still holds its sockets: a TCP connect to its control port (and a
  decode node's KV port) succeeds. A crashed process fails it (and is restarted anyway); a hung
  one passes, since the kernel completes a TCP handshake for a stopped process too: a hung node
  is the router's to catch (no heartbeat for `node_timeout_s`: its requests move), and `ready`
  then fails.
- `ready` (a node): the router's GET /health lists the node with status "ready": it reported
  NodeReady, its heartbeats arrive, it is not draining. The router is reached at the config's
  router host and HTTP port (its Service in Kubernetes).
- `router-live` (the router): GET /health answers at all (200, or 503 while no node pair is
  ready): the event loop serves HTTP. Its readiness is /health's 200 itself (an httpGet probe).

The node defaults to the one whose host's first DNS label is this machine's hostname: a
StatefulSet pod's hostname is its pod name, and its node's host is `POD.SERVICE.NS.svc`. With
`--role`, the node joined the cluster (a pool pod, `duet node`): it is named `--node`, else
this machine's hostname (a pool pod's name), with the settings and ports of the config's first
node of that role. Local
sockets are reached on the bind address when the config has one (127.0.0.1 for 0.0.0.0), so
`live` does not depend on cluster DNS. Exit status 0 passed, 1 failed (one line on stdout, which
Kubernetes shows in the pod's events), 2 a bad command line or config. Standard library only:
a probe runs every few seconds and must start fast.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import urllib.error
import urllib.request

from control.cluster_config import ClusterConfig
from control.errors import ConfigError

TIMEOUT_S = 3.0
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": None}


class ProbeFailed(Exception):
    """The check failed; the message says why in one line."""


def local_host(section) -> str:
    """Where this machine reaches a socket of `section` (the router's or a node's config): its
    bind address, loopback for a wildcard, else its advertised host."""
    return _WILDCARDS.get(section.bind_host, section.bind_host) or section.host


def find_node(cluster: ClusterConfig, hostname: str):
    """The node whose host's first label is `hostname` (a pod's own name)."""
    for node in (*cluster.prefill, *cluster.decode):
        if node.host.split(".", 1)[0] == hostname:
            return node
    raise ConfigError(f"no node of the config has a host named after this pod ({hostname!r})")


def joined_node(cluster: ClusterConfig, role: str, name: str):
    """A joining node as `duet node` starts one in a pool pod: the role's template under its
    own name, on the template's ports."""
    template = (cluster.prefill if role == "prefill" else cluster.decode)[0]
    return cluster.joining_node(role, name, template.control_port, getattr(template, "kv_port", 0))


def check_live(node) -> str:
    ports = [node.control_port] + ([node.kv_port] if hasattr(node, "kv_port") else [])
    host = local_host(node)
    for port in ports:
        try:
            socket.create_connection((host, port), timeout=TIMEOUT_S).close()
        except OSError as exc:
            raise ProbeFailed(
                f"node {node.name}: nothing accepts on {host}:{port} ({exc})"
            ) from None
    return f"node {node.name}: accepting on {host}:{', '.join(map(str, ports))}"


def router_health(cluster: ClusterConfig, host: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) of the router's /health; ProbeFailed if it does not answer."""
    url = f"http://{host}:{cluster.router.port}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            status, text = resp.status, resp.read()
    except urllib.error.HTTPError as exc:  # 503: the router answers, with its body
        status, text = exc.code, exc.read()
    except OSError as exc:
        raise ProbeFailed(f"the router at {url} does not answer ({exc})") from None
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    return status, body if isinstance(body, dict) else {}


def check_ready(cluster: ClusterConfig, node) -> str:
    try:
        _, body = router_health(cluster, cluster.router.host)
    except ProbeFailed as exc:
        raise ProbeFailed(f"node {node.name}: {exc}") from None
    nodes = body.get("nodes")
    entry = nodes.get(node.name) if isinstance(nodes, dict) else None
    if not isinstance(entry, dict):
        raise ProbeFailed(f"node {node.name}: the router does not list it")
    status = entry.get("status")
    if status != "ready":
        why = f" ({entry['error']})" if entry.get("error") else ""
        raise ProbeFailed(f"node {node.name}: the router reports it {status}{why}")
    return f"node {node.name}: ready"


def check_router_live(cluster: ClusterConfig) -> str:
    status, body = router_health(cluster, local_host(cluster.router))
    return f"router: /health answered {status} ({body.get('status', '?')})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.probe", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="cluster config (TOML)")
    p.add_argument("--node", help="the node's name (default: the one named after this host)")
    p.add_argument(
        "--role", choices=("prefill", "decode"), help="a joining node of this role (a pool pod)"
    )
    p.add_argument("check", choices=("live", "ready", "router-live"))
    args = p.parse_args(argv)
    try:
        cluster = ClusterConfig.load(args.config)
        if args.check == "router-live":
            print(check_router_live(cluster))
            return 0
        if args.role:
            node = joined_node(cluster, args.role, args.node or socket.gethostname())
        elif args.node:
            node = cluster.node(args.node)
        else:
            node = find_node(cluster, socket.gethostname())
        print(check_live(node) if args.check == "live" else check_ready(cluster, node))
        return 0
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    except ProbeFailed as exc:
        print(f"failed: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())

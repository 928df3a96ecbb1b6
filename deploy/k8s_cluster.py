"""The cluster config as Kubernetes runs it: which pod is which node, and the TOML they read.

Every [[prefill]]/[[decode]] entry becomes one StatefulSet (a *node set*) of `replicas` pods
behind a headless Service of the same name, so pod i has the stable DNS name
`SET-i.SET.NAMESPACE.svc`. `ClusterConfig` expands `replicas` into nodes named `NAME-i` with
ports `+ i`; those nodes are gathered back into one set named NAME whose pod i is node NAME-i
(pod name = node name). A node without such a suffix (an entry without `replicas`) is a set of
one pod, `NAME-0`, serving node NAME. Ports stay exactly the TOML's: with `replicas`, pod i
listens on the entry's ports + i.

The TOML in the ConfigMap (`k8s_cluster`) is the input with
- every node's host replaced by its pod's DNS name and the router's by its Service's (with
  `[router] replicas`, a StatefulSet of router pods: `replica_hosts` names each pod, which the
  nodes reach one by one; clients reach any of them through the Service),
- `bind_host = "0.0.0.0"` everywhere: a socket cannot bind a DNS name (ZeroMQ binds only an IP
  address or an interface), and a Service's address is not the pod's own,
- [security] pointing at the mounted Secrets (CURVE key pair, API keys), CURVE on even where the
  input says `insecure` (a cluster network is shared): keys are never in it, so a config with
  inline `api_keys` is refused.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from control.cluster_config import ClusterConfig, DecodeNodeConfig, PrefillNodeConfig
from control.errors import ConfigError
from control.security import KEY_FILE_NAME
from deploy.local_cluster import dump_toml

CONFIG_DIR = "/etc/duet/config"
CONFIG_FILE = "cluster.toml"
KEY_DIR = "/etc/duet/keys"
KEY_FILE = KEY_FILE_NAME  # what `duet keygen` writes
API_KEY_DIR = "/etc/duet/api"
API_KEY_FILE = "api_keys"
ROUTER = "router"  # the router's Deployment (StatefulSet with replicas) and Service
ROUTER_PODS = "router-pods"  # with [router] replicas: the headless Service naming each pod
BIND_ANY = "0.0.0.0"
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # a DNS-1035 label: Service names need one
_MAX_SET_NAME = 52  # StatefulSet pods get a `NAME-HASH` revision label of at most 63 characters

Node = PrefillNodeConfig | DecodeNodeConfig


@dataclass(frozen=True)
class NodeSet:
    """One StatefulSet: `nodes[i]` runs in pod `{name}-{i}`."""

    role: str  # "prefill" or "decode"
    name: str  # StatefulSet, headless Service and pod-name prefix
    nodes: tuple[Node, ...]

    @property
    def replicas(self) -> int:
        return len(self.nodes)

    def pod(self, i: int) -> str:
        return f"{self.name}-{i}"

    @property
    def is_pod_named(self) -> bool:
        """Whether node i's name is pod i's name (else a single pod serves a named node)."""
        return all(node.name == self.pod(i) for i, node in enumerate(self.nodes))


def config_path() -> str:
    return f"{CONFIG_DIR}/{CONFIG_FILE}"


def service_host(name: str, namespace: str) -> str:
    return f"{name}.{namespace}.svc"


def pod_host(node_set: NodeSet, i: int, namespace: str) -> str:
    return f"{node_set.pod(i)}.{service_host(node_set.name, namespace)}"


def router_pod_host(i: int, namespace: str) -> str:
    """Router replica i's DNS name (pod `router-i` of the StatefulSet, `[router] replicas`)."""
    return f"{ROUTER}-{i}.{service_host(ROUTER_PODS, namespace)}"


def node_sets(cluster: ClusterConfig) -> list[NodeSet]:
    """The StatefulSets of a cluster, prefill sets first, in config order; ConfigError for a
    node name Kubernetes cannot use."""
    sets = [*_group("prefill", cluster.prefill), *_group("decode", cluster.decode)]
    names = [s.name for s in sets]
    for s in sets:
        if not _NAME.fullmatch(s.name) or len(s.name) > _MAX_SET_NAME:
            raise ConfigError(
                f"node {s.nodes[0].name!r}: not usable as a Kubernetes name (lowercase letters, "
                f"digits and '-', starting with a letter, at most {_MAX_SET_NAME} characters)"
            )
        if s.name == ROUTER or names.count(s.name) > 1:
            raise ConfigError(f"two Kubernetes objects would be named {s.name!r}: rename a node")
    return sets


def _group(role: str, nodes: tuple[Node, ...]) -> list[NodeSet]:
    """Consecutive nodes `B-0, B-1, ...` that differ only in name and ports (+ i) form set B."""
    sets: list[NodeSet] = []
    for node in nodes:
        last = sets[-1] if sets else None
        if last is not None and last.is_pod_named and _is_replica(last, node):
            sets[-1] = dataclasses.replace(last, nodes=(*last.nodes, node))
            continue
        base, _, index = node.name.rpartition("-")
        if base and index == "0":
            sets.append(NodeSet(role, base, (node,)))
        else:
            sets.append(NodeSet(role, node.name, (node,)))
    return sets


def _is_replica(node_set: NodeSet, node: Node) -> bool:
    i = node_set.replicas
    first = node_set.nodes[0]
    if type(node) is not type(first) or node.name != node_set.pod(i):
        return False
    ports = {f.name for f in dataclasses.fields(first) if f.name.endswith("_port")}
    shifted = dataclasses.replace(
        first,
        name=node.name,
        **{p: getattr(first, p) + (i if getattr(first, p) else 0) for p in ports},
    )
    return shifted == node


def _with_bind(section, host: str):
    return dataclasses.replace(section, host=host, bind_host=BIND_ANY)


def k8s_cluster(cluster: ClusterConfig, namespace: str) -> ClusterConfig:
    """The config the pods read (see the module docstring)."""
    if cluster.security.api_keys:
        raise ConfigError(
            "[security] api_keys would put the keys in clear into a ConfigMap: put them in the "
            f"Secret that the router mounts as {API_KEY_DIR}/{API_KEY_FILE} instead"
        )
    for node in cluster.prefill:
        if node.rank_hosts:
            raise ConfigError(
                f"node {node.name}: rank_hosts (ranks on other hosts) is not rendered for "
                "Kubernetes: one pod runs every rank of its node"
            )
    hosts = {
        node.name: pod_host(s, i, namespace)
        for s in node_sets(cluster)
        for i, node in enumerate(s.nodes)
    }
    security = dataclasses.replace(
        cluster.security,
        curve_key_file=f"{KEY_DIR}/{KEY_FILE}",
        insecure=False,
        api_key_file=f"{API_KEY_DIR}/{API_KEY_FILE}",
    )
    router = _with_bind(cluster.router, service_host(ROUTER, namespace))
    if router.replicas > 1:  # every pod on the TOML's ports, each under its own name
        pods = tuple(router_pod_host(i, namespace) for i in range(router.replicas))
        router = dataclasses.replace(router, replica_hosts=pods)
    # On Kubernetes the autoscaler scales the pool Deployments, never processes of its pod.
    autoscale = dataclasses.replace(cluster.autoscale, launcher="kubernetes", namespace=namespace)
    return dataclasses.replace(
        cluster,
        router=router,
        autoscale=autoscale if cluster.autoscale.enabled else cluster.autoscale,
        prefill=tuple(_with_bind(n, hosts[n.name]) for n in cluster.prefill),
        decode=tuple(_with_bind(n, hosts[n.name]) for n in cluster.decode),
        security=security,
    )


def cluster_toml(cluster: ClusterConfig, source: str) -> str:
    """TOML text of a config, every field written out (replicas already expanded)."""
    raw = dataclasses.asdict(cluster)
    raw["prefill"], raw["decode"] = list(raw["prefill"]), list(raw["decode"])  # arrays of tables
    header = (
        f"# Rendered by `duet k8s render` from {source}: edit that file and render again.\n"
        "# Every field is written out; `replicas` are expanded into one entry per node.\n"
    )
    return header + dump_toml(raw)

"""The Kubernetes objects of one cluster: the router's Deployment (a StatefulSet of
`[router] replicas` pods when there are several) and Service, a StatefulSet and
a headless Service per node set, a PodDisruptionBudget per role. Pure functions of the
ClusterConfig (and the model, for the pods' requests); `deploy.k8s_render` puts them in files.

- Pods run the image's launch scripts (`deploy/launch_*.sh`) on the ConfigMap's TOML, as the
  image's user, with the CURVE key Secret (and, for the router, the API key Secret) mounted
  read-only where that TOML's [security] names them.
- Probes: a node's readiness asks the router's /health for that node's status and its liveness
  checks that it still holds its sockets (`deploy.probe`); the router's readiness is /health
  itself (200 only while a prefill and a decode node are ready), its liveness that /health
  answers at all.
- Both kinds of Service publish not-ready pods: a node registers with the router through them
  (and the router calls the node back) before anyone calls either ready.
- Termination: Kubernetes sends SIGTERM, which drains a node (it takes nothing new and finishes
  what it holds for at most `[timeouts] drain_s`), so a node's grace period is drain_s +
  DRAIN_MARGIN_S. The router ends its streams at SIGTERM and needs only ROUTER_GRACE_S.
- A template annotation holds the TOML's digest: a changed config rolls the pods.
- Weights cache: a node that builds its packed weights in the cache (`weights_cache = true`
  and no `pack`, `model.pack_cache`) gets the `weights-cache` volume at `$DUET_CACHE_DIR/packs`
  (`WeightsCache`): by default a hostPath, so every pod of a host maps one copy of a pack (one
  page-cache copy per host) and a restarted pod maps the pack instead of building it again;
  or a PersistentVolumeClaim made beforehand; or none (then such a node is refused).
"""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from control.cluster_config import ClusterConfig, PrefillNodeConfig, pool_name
from control.errors import ConfigError
from control.model_config import ModelConfig
from deploy.k8s_cluster import (
    API_KEY_DIR,
    API_KEY_FILE,
    CONFIG_DIR,
    KEY_DIR,
    KEY_FILE,
    ROUTER,
    ROUTER_PODS,
    NodeSet,
    config_path,
)
from deploy.k8s_resources import MIB, ROUTER_RESOURCES, node_resources, shm_bytes

IMAGE = "duet-serve:0.1.0"  # what the Dockerfile at the repository root builds
NAMESPACE = "duet"
APP = "duet-serve"
APP_DIR = "/opt/duet-serve"  # the image's WORKDIR (Dockerfile)
USER_ID = 10001  # the image's user (Dockerfile)
CONFIG_MAP = "duet-cluster"
CURVE_SECRET = "duet-curve-key"
API_SECRET = "duet-api-keys"
DRAIN_MARGIN_S = 30  # after drain_s: moving what is left, closing sockets, stopping the ranks
ROUTER_GRACE_S = 30  # the router ends every stream at SIGTERM, then uvicorn closes
PROBE = ["python", "-m", "deploy.probe", "--config", config_path()]
# The image's DUET_CACHE_DIR (Dockerfile), where the tiny model is baked in; the nodes build and
# map their packs under CACHE_DIR/packs (`model.pack_cache.cache_dir`), the volume's mount.
CACHE_DIR = f"{APP_DIR}/cache"
PACKS_DIR = f"{CACHE_DIR}/packs"
WEIGHTS_CACHE = "weights-cache"  # the volume's name
WEIGHTS_CACHE_KINDS = ("hostpath", "pvc", "none")

Doc = dict[str, Any]


# ---- shared pieces -------------------------------------------------------------------------
def labels(component: str, node_set: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}
    if node_set:
        out["duet-serve/node-set"] = node_set
    return out


def meta(name: str, namespace: str, labels_: dict[str, str]) -> Doc:
    return {"name": name, "namespace": namespace, "labels": labels_}


NODE_STARTUP_PROBES = 900  # x 2 s: 30 minutes to load or build the weights


def _exec_probe(check: str, period_s: int, failures: int, args: tuple[str, ...] = ()) -> Doc:
    return {
        "exec": {"command": [*PROBE, *args, check]},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


_CONFIG_VOLUME = {"name": "config", "configMap": {"name": CONFIG_MAP}}
_CURVE_VOLUME = {
    "name": "curve-key",
    # 0440 with the pod's fsGroup: only the image's user reads it (the node logs that the key
    # is group-readable; Kubernetes adds the group bits for fsGroup whatever is asked).
    "secret": {
        "secretName": CURVE_SECRET,
        "defaultMode": 0o440,
        "items": [{"key": KEY_FILE, "path": KEY_FILE}],
    },
}
_API_VOLUME = {
    "name": "api-keys",
    "secret": {
        "secretName": API_SECRET,
        "defaultMode": 0o440,
        "items": [{"key": API_KEY_FILE, "path": API_KEY_FILE}],
    },
}
_MOUNTS = {
    "config": CONFIG_DIR,
    "curve-key": KEY_DIR,
    "api-keys": API_KEY_DIR,
    "dshm": "/dev/shm",
    WEIGHTS_CACHE: PACKS_DIR,
}
# The prefix cache's disk tier (`disk_cache_dir` of a prefill node): a hostPath, so the prefill
# pods of a host share one store and a restarted pod finds it warm; mounted at the TOML's path.
KV_DISK = "kv-disk-cache"
KV_DISK_HOST_PATH = "/var/cache/duet-serve/kv"
_WRITABLE = {"dshm", WEIGHTS_CACHE, KV_DISK}


def _mounts(volumes: list[Doc], paths: dict[str, str] | None = None) -> list[Doc]:
    """Each volume at its path (`_MOUNTS`, or `paths` for those whose path the config names)."""
    where = {**_MOUNTS, **(paths or {})}
    return [
        {"name": v["name"], "mountPath": where[v["name"]]}
        | ({} if v["name"] in _WRITABLE else {"readOnly": True})
        for v in volumes
    ]


def _owner_init(name: str, volume: str, path: str, image: str) -> Doc:
    """An init container that gives a hostPath volume to the image's user: chown alone, as
    root with CAP_CHOWN only, a no-op once the directory is the user's."""
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["chown", f"{USER_ID}:{USER_ID}", path],
        "resources": {
            "requests": {"cpu": "10m", "memory": "32Mi"},
            "limits": {"memory": "32Mi"},
        },
        "volumeMounts": [{"name": volume, "mountPath": path}],
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
    }


def _kv_disk(node, image: str) -> tuple[list[Doc], list[Doc], dict[str, str]]:
    """A prefill node's disk tier: (volumes, init containers, mount paths); none without one."""
    path = getattr(node, "disk_cache_dir", "")
    if not path:
        return [], [], {}
    if not path.startswith("/"):
        raise ConfigError(
            f"node {node.name}: disk_cache_dir {path!r} must be an absolute path under "
            "Kubernetes (the pod mounts the host's store there)"
        )
    volume = {"name": KV_DISK, "hostPath": {"path": KV_DISK_HOST_PATH, "type": "DirectoryOrCreate"}}
    return [volume], [_owner_init("kv-disk-owner", KV_DISK, path, image)], {KV_DISK: path}


def _shm_volume(node) -> list[Doc]:
    """A tensor-parallel prefill node's shared-memory segment needs a /dev/shm larger than the
    container runtime's 64 MiB default for many ranks: a memory-backed emptyDir of its size
    (counted in the pod's memory, `deploy.k8s_resources.shm_bytes`)."""
    size = shm_bytes(node)
    if not size:
        return []
    return [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{-(-size // MIB)}Mi"}}]


@dataclass(frozen=True)
class WeightsCache:
    """The volume a node's packed-weight cache lives on (`duet k8s render --weights-cache`).

    - "hostpath" (the default): the host's directory `path` (DirectoryOrCreate). Every pod of a
      host that maps the same pack maps the same file, so the host's page cache holds one copy
      whatever the number of pods, and a restarted pod (or a new pod on that host) maps the
      pack instead of building it. fsGroup does not apply to a hostPath, and DirectoryOrCreate
      makes the directory root's: an init container gives it to the image's user.
    - "pvc": the PersistentVolumeClaim `claim`, made beforehand (referenced, never shipped):
      ReadWriteMany for pods on several hosts, each host's page cache then holding its copy.
    - "none": no volume; a node that would build its pack in the cache is refused (the image's
      cache directory is not the pods' user's to write): set `weights_cache = false` or a
      `pack` on it.
    """

    kind: str = "hostpath"
    path: str = "/var/cache/duet-serve/packs"
    claim: str = "duet-weights-cache"

    def check(self) -> None:
        if self.kind not in WEIGHTS_CACHE_KINDS:
            raise ConfigError(
                f"--weights-cache {self.kind!r}: one of {', '.join(WEIGHTS_CACHE_KINDS)}"
            )
        if self.kind == "hostpath" and (
            not self.path.startswith("/") or posixpath.normpath(self.path) in ("/", "//")
        ):
            raise ConfigError(
                f"--weights-cache-path {self.path!r} must be an absolute directory of the host"
            )
        name = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
        if self.kind == "pvc" and (not name.fullmatch(self.claim) or len(self.claim) > 253):
            raise ConfigError(
                f"--weights-cache-claim {self.claim!r} is not a PersistentVolumeClaim name"
            )

    def volumes(self) -> list[Doc]:
        if self.kind == "hostpath":
            return [
                {
                    "name": WEIGHTS_CACHE,
                    "hostPath": {"path": self.path, "type": "DirectoryOrCreate"},
                }
            ]
        if self.kind == "pvc":
            return [{"name": WEIGHTS_CACHE, "persistentVolumeClaim": {"claimName": self.claim}}]
        return []

    def init_containers(self, image: str) -> list[Doc]:
        """A hostPath's owner: the image's user (see the class)."""
        if self.kind != "hostpath":
            return []
        return [_owner_init("weights-cache-owner", WEIGHTS_CACHE, PACKS_DIR, image)]


def uses_weights_cache(node) -> bool:
    """Whether the node builds and maps its pack in the cache (`model.pack_cache.load_model`):
    an explicit `pack` is mapped from its own path instead."""
    return node.weights_cache and not node.pack


def _container(
    role: str,
    image: str,
    args: list[str],
    volumes: list[Doc],
    mount_paths: dict[str, str] | None = None,
    **fields,
) -> Doc:
    return {
        "name": role,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [f"{APP_DIR}/deploy/launch_{role}.sh"],
        "args": args,
        **fields,
        "volumeMounts": _mounts(volumes, mount_paths),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def _pod(
    component: str,
    node_set: str | None,
    digest: str,
    grace_s: int,
    container: Doc,
    volumes: list[Doc],
    init_containers: list[Doc] | None = None,
) -> Doc:
    """A pod template; `digest` (of the TOML) in an annotation rolls the pods when it changes."""
    return {
        "metadata": {
            "labels": labels(component, node_set),
            "annotations": {"duet-serve/config-sha256": digest},
        },
        "spec": {
            "serviceAccountName": APP,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": grace_s,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": USER_ID,
                "runAsGroup": USER_ID,
                "fsGroup": USER_ID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            **({"initContainers": init_containers} if init_containers else {}),
            "containers": [container],
            "volumes": volumes,
        },
    }


def node_grace_s(cluster: ClusterConfig) -> int:
    return math.ceil(cluster.timeouts.drain_s) + DRAIN_MARGIN_S


# ---- the router ----------------------------------------------------------------------------
def router_manifests(k8s: ClusterConfig, namespace: str, image: str, digest: str) -> list[Doc]:
    r = k8s.router
    volumes = [_CONFIG_VOLUME, _CURVE_VOLUME, _API_VOLUME]
    container = _container(
        ROUTER,
        image,
        [config_path()],
        volumes,
        ports=[
            {"name": "http", "containerPort": r.port, "protocol": "TCP"},
            {"name": "control", "containerPort": r.control_port, "protocol": "TCP"},
        ],
        resources=ROUTER_RESOURCES.k8s(),
        startupProbe=_exec_probe("router-live", 2, 90),
        livenessProbe=_exec_probe("router-live", 10, 3),
        readinessProbe={
            "httpGet": {"path": "/health", "port": r.port},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
    )
    selector = labels(ROUTER)
    template = _pod(ROUTER, None, digest, ROUTER_GRACE_S, container, volumes)
    workloads = [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta(ROUTER, namespace, selector),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": selector},
                "template": template,
            },
        }
    ]
    if r.replicas > 1:
        workloads = _router_replicas(r, namespace, selector, template)
    rbac: list[Doc] = []
    if k8s.autoscale.enabled:  # the router scales the pools: its pods get the API token
        template["spec"]["automountServiceAccountToken"] = True
        rbac = autoscaler_rbac(namespace)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(ROUTER, namespace, selector),
        "spec": {
            "type": "ClusterIP",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [
                {"name": "http", "port": r.port, "targetPort": r.port, "protocol": "TCP"},
                {
                    "name": "control",
                    "port": r.control_port,
                    "targetPort": r.control_port,
                    "protocol": "TCP",
                },
            ],
        },
    }
    http_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta("router-http", namespace, selector),
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"port": r.port, "protocol": "TCP"}]}],
        },
    }
    return [*workloads, service, http_policy, *rbac]


AUTOSCALER_ROLE = "duet-autoscaler"


def autoscaler_rbac(namespace: str) -> list[Doc]:
    """What the autoscaler may do (`router.k8s_launcher`): read and patch the pools' scale,
    annotate a pod before the pool drops it. Bound to the pods' ServiceAccount; only the
    router's pods mount its token."""
    pools = [pool_name(role) for role in ("prefill", "decode")]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta(AUTOSCALER_ROLE, namespace, labels(ROUTER)),
        "rules": [
            {
                "apiGroups": ["apps"],
                "resources": ["deployments/scale"],
                "resourceNames": pools,
                "verbs": ["get", "patch"],
            },
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta(AUTOSCALER_ROLE, namespace, labels(ROUTER)),
        "subjects": [{"kind": "ServiceAccount", "name": APP, "namespace": namespace}],
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": AUTOSCALER_ROLE,
        },
    }
    return [role, binding]


def _router_replicas(r, namespace: str, selector: dict, template: Doc) -> list[Doc]:
    """`[router] replicas` routers: a StatefulSet, so that pod i is replica i (`--replica` its
    pod name) under a stable DNS name (the headless ROUTER_PODS Service's, `replica_hosts`),
    which every node connects to. A Deployment's pods have neither."""
    (container,) = template["spec"]["containers"]
    container["args"] = [*container["args"], "--replica", "$(POD_NAME)"]
    container["env"] = [_POD_NAME]
    ports = [("control", r.control_port)]
    return [
        _headless_service(ROUTER_PODS, namespace, selector, ports),
        _stateful_set(ROUTER, namespace, selector, ROUTER_PODS, r.replicas, template),
    ]


def _headless_service(
    name: str, namespace: str, selector: dict, ports: list[tuple[str, int]]
) -> Doc:
    """A Service without an address that names each pod of a StatefulSet (`POD.NAME.NS.svc`),
    not-ready pods too: they register before anyone calls them ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name, namespace, selector),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [
                {"name": port_name, "port": port, "targetPort": port, "protocol": "TCP"}
                for port_name, port in ports
            ],
        },
    }


def _stateful_set(
    name: str, namespace: str, selector: dict, service: str, replicas: int, template: Doc
) -> Doc:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(name, namespace, selector),
        "spec": {
            "serviceName": service,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


# ---- the nodes -----------------------------------------------------------------------------
def node_ports(node_set: NodeSet) -> list[tuple[str, int]]:
    """(name, port) of every socket of the set's pods: pod i serves the ones suffixed -i."""
    out = []
    for i, node in enumerate(node_set.nodes):
        out.append((f"control-{i}", node.control_port))
        if node_set.role == "decode":
            out.append((f"kv-{i}", node.kv_port))
    return out


def _node_pod(
    cluster: ClusterConfig,
    node,
    model: ModelConfig,
    image: str,
    args: list[str],
    ports: list[tuple[str, int]],
    env: list[Doc],
    weights_cache: WeightsCache,
    probe_args: tuple[str, ...] = (),
) -> tuple[Doc, list[Doc], list[Doc]]:
    """(container, volumes, init containers) of a pod running `node` (a node set's, or a pool's
    template); `probe_args` go to `deploy.probe` before the check."""
    role = "prefill" if isinstance(node, PrefillNodeConfig) else "decode"
    volumes = [_CONFIG_VOLUME, _CURVE_VOLUME, *_shm_volume(node)]
    init_containers: list[Doc] = []
    if uses_weights_cache(node):  # a set's nodes differ in names and ports only
        if weights_cache.kind == "none":
            raise ConfigError(
                f"node {node.name}: weights_cache = true builds its packed weights "
                "in the cache, which --weights-cache none leaves without a writable volume: set "
                "weights_cache = false (or a pack) on the node, or render with --weights-cache "
                "hostpath or pvc"
            )
        volumes += weights_cache.volumes()
        init_containers = weights_cache.init_containers(image)
        # The image sets the same: pinned here, as the volume is mounted under it.
        env = [*env, {"name": "DUET_CACHE_DIR", "value": CACHE_DIR}]
    disk_volumes, disk_init, disk_paths = _kv_disk(node, image)
    volumes += disk_volumes
    init_containers += disk_init
    container = _container(
        role,
        image,
        args,
        volumes,
        disk_paths,
        env=env,
        ports=[{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports],
        resources=node_resources(model, cluster.dtype, node, cluster.uses_mtp).k8s(),
        # A decode node opens its KV port after loading: the first start on a host may build
        # the pack of a full-depth model (minutes), or wait on another pod building it.
        startupProbe=_exec_probe("live", 2, NODE_STARTUP_PROBES, probe_args),
        livenessProbe=_exec_probe("live", 10, 3, probe_args),
        readinessProbe=_exec_probe("ready", 5, 2, probe_args),
    )
    return container, volumes, init_containers


_POD_NAME = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
_POD_IP = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def node_set_manifests(
    cluster: ClusterConfig,
    node_set: NodeSet,
    model: ModelConfig,
    namespace: str,
    image: str,
    digest: str,
    weights_cache: WeightsCache = WeightsCache(),
) -> list[Doc]:
    role = node_set.role
    # One pod: its node's name. Several: pod i is node NAME-i, so the pod's own name.
    node_arg = node_set.nodes[0].name if node_set.replicas == 1 else "$(POD_NAME)"
    container, volumes, init_containers = _node_pod(
        cluster,
        node_set.nodes[0],
        model,
        image,
        [config_path(), node_arg],
        node_ports(node_set),
        [_POD_NAME],
        weights_cache,
    )
    selector = labels(role, node_set.name)
    template = _pod(
        role, node_set.name, digest, node_grace_s(cluster), container, volumes, init_containers
    )
    return [
        _headless_service(node_set.name, namespace, selector, node_ports(node_set)),
        _stateful_set(
            node_set.name, namespace, selector, node_set.name, node_set.replicas, template
        ),
    ]


def pool_manifests(
    cluster: ClusterConfig,
    role: str,
    model: ModelConfig,
    namespace: str,
    image: str,
    digest: str,
    weights_cache: WeightsCache = WeightsCache(),
) -> list[Doc]:
    """A role's pool (`control.cluster_config.pool_name`): a Deployment of joining nodes,
    none at first. Each pod is a node named after itself at its own address (`duet node`,
    the config's first node of the role as template, on that node's ports); the router
    admits it as it comes. `kubectl scale`, or the autoscaler on Kubernetes, sets the
    replicas; a pod going away drains first. None for a role whose template runs several
    ranks (a joining node runs one)."""
    template = (cluster.prefill if role == "prefill" else cluster.decode)[0]
    if template.ranks > 1:
        return []
    name = pool_name(role)
    ports = [("control", template.control_port)]
    join = ["--role", role, "--config", config_path(), "--name", "$(POD_NAME)"]
    join += ["--control-port", str(template.control_port), "--host", "$(POD_IP)"]
    if role == "decode":
        ports.append(("kv", template.kv_port))
        join += ["--kv-port", str(template.kv_port)]
    container, volumes, init_containers = _node_pod(
        cluster,
        template,
        model,
        image,
        join,
        ports,
        [_POD_NAME, _POD_IP],
        weights_cache,
        probe_args=("--role", role),  # the node named after the pod (its hostname)
    )
    container["command"] = [f"{APP_DIR}/deploy/launch_join.sh"]
    selector = labels(role, name)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, namespace, selector),
        "spec": {
            "replicas": 0,
            "strategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector},
            "template": _pod(
                role, name, digest, node_grace_s(cluster), container, volumes, init_containers
            ),
        },
    }
    return [deployment]


def disruption_budgets(namespace: str) -> list[Doc]:
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta(f"duet-{role}", namespace, labels(role)),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(role)}},
        }
        for role in (ROUTER, "prefill", "decode")
    ]

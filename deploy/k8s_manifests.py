"""The Kubernetes objects of one cluster: the router's Deployment and Service, a StatefulSet and
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
"""

from __future__ import annotations

import math
from typing import Any

from deploy.k8s_cluster import (
    API_KEY_DIR,
    API_KEY_FILE,
    CONFIG_DIR,
    KEY_DIR,
    KEY_FILE,
    ROUTER,
    NodeSet,
    config_path,
)
from deploy.k8s_resources import MIB, ROUTER_RESOURCES, node_resources, shm_bytes
from engine.cluster_config import ClusterConfig
from engine.config import ModelConfig

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

Doc = dict[str, Any]


# ---- shared pieces -------------------------------------------------------------------------
def labels(component: str, node_set: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}
    if node_set:
        out["duet-serve/node-set"] = node_set
    return out


def meta(name: str, namespace: str, labels_: dict[str, str]) -> Doc:
    return {"name": name, "namespace": namespace, "labels": labels_}


def _exec_probe(check: str, period_s: int, failures: int) -> Doc:
    return {
        "exec": {"command": [*PROBE, check]},
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
_MOUNTS = {"config": CONFIG_DIR, "curve-key": KEY_DIR, "api-keys": API_KEY_DIR}


def _mounts(volumes: list[Doc]) -> list[Doc]:
    return [
        {"name": v["name"], "mountPath": "/dev/shm"} if v["name"] == "dshm"
        else {"name": v["name"], "mountPath": _MOUNTS[v["name"]], "readOnly": True}
        for v in volumes
    ]  # fmt: skip


def _shm_volume(node) -> list[Doc]:
    """A tensor-parallel prefill node's shared-memory segment needs a /dev/shm larger than the
    container runtime's 64 MiB default for many ranks: a memory-backed emptyDir of its size
    (counted in the pod's memory, `deploy.k8s_resources.shm_bytes`)."""
    size = shm_bytes(node)
    if not size:
        return []
    return [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{-(-size // MIB)}Mi"}}]


def _container(role: str, image: str, args: list[str], volumes: list[Doc], **fields) -> Doc:
    return {
        "name": role,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [f"{APP_DIR}/deploy/launch_{role}.sh"],
        "args": args,
        **fields,
        "volumeMounts": _mounts(volumes),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def _pod(
    component: str,
    node_set: str | None,
    digest: str,
    grace_s: int,
    container: Doc,
    volumes: list[Doc],
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
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(ROUTER, namespace, selector),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": _pod(ROUTER, None, digest, ROUTER_GRACE_S, container, volumes),
        },
    }
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
    return [deployment, service, http_policy]


# ---- the nodes -----------------------------------------------------------------------------
def node_ports(node_set: NodeSet) -> list[tuple[str, int]]:
    """(name, port) of every socket of the set's pods: pod i serves the ones suffixed -i."""
    out = []
    for i, node in enumerate(node_set.nodes):
        out.append((f"control-{i}", node.control_port))
        if node_set.role == "decode":
            out.append((f"kv-{i}", node.kv_port))
    return out


def node_set_manifests(
    cluster: ClusterConfig,
    node_set: NodeSet,
    model: ModelConfig,
    namespace: str,
    image: str,
    digest: str,
) -> list[Doc]:
    role = node_set.role
    volumes = [_CONFIG_VOLUME, _CURVE_VOLUME, *_shm_volume(node_set.nodes[0])]
    # One pod: its node's name. Several: pod i is node NAME-i, so the pod's own name.
    node_arg = node_set.nodes[0].name if node_set.replicas == 1 else "$(POD_NAME)"
    container = _container(
        role,
        image,
        [config_path(), node_arg],
        volumes,
        env=[{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        ports=[
            {"name": name, "containerPort": port, "protocol": "TCP"}
            for name, port in node_ports(node_set)
        ],
        resources=node_resources(model, cluster.dtype, node_set.nodes[0], cluster.uses_mtp).k8s(),
        startupProbe=_exec_probe("live", 2, 60),
        livenessProbe=_exec_probe("live", 10, 3),
        readinessProbe=_exec_probe("ready", 5, 2),
    )
    selector = labels(role, node_set.name)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(node_set.name, namespace, selector),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [
                {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}
                for name, port in node_ports(node_set)
            ],
        },
    }
    grace = node_grace_s(cluster)
    stateful_set = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(node_set.name, namespace, selector),
        "spec": {
            "serviceName": node_set.name,
            "replicas": node_set.replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector},
            "template": _pod(role, node_set.name, digest, grace, container, volumes),
        },
    }
    return [service, stateful_set]


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

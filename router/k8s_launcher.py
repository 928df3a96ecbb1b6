"""The autoscaler's nodes on Kubernetes (`[autoscale] launcher = "kubernetes"`): each role's pool
Deployment (`control.cluster_config.pool_name`, rendered by `duet k8s render`), whose pods are
joining nodes named after themselves, gets its replicas patched through the Kubernetes API (the
`kubernetes` client, in-cluster credentials of the router's ServiceAccount, which the rendered
RBAC Role lets read and patch the pools' scale and annotate pods).

Scaling down picks the pod to go: the newest-named ready pod of the pool gets the
`controller.kubernetes.io/pod-deletion-cost` annotation at its lowest before the replicas
drop, so the ReplicaSet deletes that one; Kubernetes sends it SIGTERM, it drains (takes nothing
new, finishes what it holds) and the router forgets it once it leaves: no request is lost.
Pods the pool runs but the router does not list as ready yet count as starting. The replicas
are read back from the API at start, so a restarted router goes on from what runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from control.cluster_config import AutoscaleConfig, pool_name

log = logging.getLogger("router")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_COST = str(-(2**31))  # the annotation's lowest value: this pod goes first
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def kubernetes_apis() -> tuple[Any, Any]:
    """(AppsV1Api, CoreV1Api) with the pod's in-cluster credentials."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise RuntimeError(
            '[autoscale] launcher = "kubernetes" needs the kubernetes client: '
            "pip install 'duet-serve[k8s]'"
        ) from exc
    config.load_incluster_config()
    return client.AppsV1Api(), client.CoreV1Api()


class K8sLauncher:
    """`router.autoscaler.Launcher` over the pool Deployments of `namespace` (`apps`, `core`:
    the client's AppsV1Api and CoreV1Api, or objects with the same methods)."""

    def __init__(self, cfg: AutoscaleConfig, apps: Any = None, core: Any = None):
        if apps is None or core is None:
            apps, core = kubernetes_apis()
        self.apps, self.core = apps, core
        self.namespace = cfg.namespace or NAMESPACE_FILE.read_text().strip()
        self.replicas: dict[str, int] = {}  # per role, what was last asked of the pool

    def _replicas(self, role: str) -> int:
        if role not in self.replicas:
            scale = self.apps.read_namespaced_deployment_scale(pool_name(role), self.namespace)
            self.replicas[role] = int(scale.spec.replicas or 0)
        return self.replicas[role]

    def _pods(self, role: str, ready: set[str]) -> list[str]:
        """The pool's pods among the ready nodes (a pod's name is its node's)."""
        return sorted(name for name in ready if name.startswith(pool_name(role) + "-"))

    def counts(self, role: str, ready: set[str]) -> tuple[int, int]:
        pods = self._pods(role, ready)
        return max(0, self._replicas(role) - len(pods)), len(pods)

    def running(self, role: str) -> int:
        return self._replicas(role)

    def start(self, role: str) -> str:
        return self._scale(role, self._replicas(role) + 1)

    def drain(self, role: str, ready: set[str]) -> str:
        pod = self._pods(role, ready)[-1]
        body = {"metadata": {"annotations": {DELETION_COST: LOWEST_COST}}}
        self.core.patch_namespaced_pod(pod, self.namespace, body)
        return f"{pod} ({self._scale(role, self._replicas(role) - 1)})"

    def _scale(self, role: str, replicas: int) -> str:
        body = {"spec": {"replicas": replicas}}
        self.apps.patch_namespaced_deployment_scale(pool_name(role), self.namespace, body)
        self.replicas[role] = replicas
        return f"deployment/{pool_name(role)} at {replicas} replicas"

    def reap(self) -> None:
        pass  # the ReplicaSet replaces or removes pods; the router forgets the ones that left

    def close(self) -> None:
        pass  # the pools keep their replicas: the next router reads them back

"""The autoscaler's Kubernetes launcher (`router.k8s_launcher`) against a recording stand-in of
the API: it reads the pools' replicas once, counts the pool pods the router does not list as
ready as starting, scales up by patching the scale, and scales down by marking the newest ready
pool pod for deletion before lowering the replicas (so that pod, and no other, drains); nodes
outside the pool are never touched. The calls it makes are checked against the `kubernetes`
client's own methods."""

import inspect
from types import SimpleNamespace

import pytest

from control.cluster_config import AutoscaleConfig
from router.k8s_launcher import DELETION_COST, LOWEST_COST, K8sLauncher


class FakeApi:
    """AppsV1Api and CoreV1Api in one: records each call, in order."""

    def __init__(self, replicas: dict[str, int]):
        self.replicas = dict(replicas)
        self.calls: list[tuple] = []

    def read_namespaced_deployment_scale(self, name, namespace):
        self.calls.append(("read", name, namespace))
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas[name]))

    def patch_namespaced_deployment_scale(self, name, namespace, body):
        self.calls.append(("scale", name, namespace, body))
        self.replicas[name] = body["spec"]["replicas"]

    def patch_namespaced_pod(self, name, namespace, body):
        self.calls.append(("pod", name, namespace, body))


@pytest.fixture
def api():
    return FakeApi({"prefill-pool": 2, "decode-pool": 0})


@pytest.fixture
def launcher(api):
    return K8sLauncher(AutoscaleConfig(launcher="kubernetes", namespace="ns"), api, api)


def test_it_starts_from_what_the_pools_run(launcher, api):
    ready = {"prefill-0", "prefill-pool-7c9-abcde"}  # one pool pod is still starting
    assert launcher.counts("prefill", ready) == (1, 1)
    assert launcher.running("prefill") == 2 and launcher.running("decode") == 0
    launcher.counts("prefill", ready)
    assert [c for c in api.calls if c[0] == "read"] == [
        ("read", "prefill-pool", "ns"),
        ("read", "decode-pool", "ns"),
    ]  # once each


def test_scaling_up_patches_the_pool(launcher, api):
    assert "decode-pool at 1 replicas" in launcher.start("decode")
    assert api.calls[-1] == ("scale", "decode-pool", "ns", {"spec": {"replicas": 1}})
    assert launcher.counts("decode", {"decode-0"}) == (1, 0)  # asked for, not ready yet


def test_scaling_down_marks_the_pod_before_the_pool_drops_it(launcher, api):
    ready = {"prefill-0", "prefill-pool-7c9-aaaaa", "prefill-pool-7c9-zzzzz", "prefill-poolx"}
    assert launcher.counts("prefill", ready) == (0, 2)
    said = launcher.drain("prefill", ready)
    assert said.startswith("prefill-pool-7c9-zzzzz")
    mark, scale = api.calls[-2:]
    assert mark == (
        "pod",
        "prefill-pool-7c9-zzzzz",
        "ns",
        {"metadata": {"annotations": {DELETION_COST: LOWEST_COST}}},
    )
    assert scale == ("scale", "prefill-pool", "ns", {"spec": {"replicas": 1}})
    assert LOWEST_COST == str(-(2**31))
    # The configured node and a name that only looks like the pool's are never drained.
    assert launcher.counts("prefill", {"prefill-0", "prefill-poolx"}) == (1, 0)


def test_the_calls_are_the_kubernetes_clients():
    client = pytest.importorskip("kubernetes.client")
    for api, method, params in [
        (client.AppsV1Api, "read_namespaced_deployment_scale", ["name", "namespace"]),
        (client.AppsV1Api, "patch_namespaced_deployment_scale", ["name", "namespace", "body"]),
        (client.CoreV1Api, "patch_namespaced_pod", ["name", "namespace", "body"]),
    ]:
        signature = inspect.signature(getattr(api, method))
        assert list(signature.parameters)[1 : 1 + len(params)] == params, method
    scale = client.V1Scale(spec=client.V1ScaleSpec(replicas=3))
    assert scale.spec.replicas == 3  # what read_namespaced_deployment_scale returns

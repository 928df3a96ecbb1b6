"""deploy/k8s and `duet k8s render`: every manifest against the Kubernetes schemas (offline,
`kubernetes-validate`'s bundled schemas of one pinned version), and against the TOML it came
from: names, ports, DNS names, probes, secrets, grace periods, disruption budgets, resources.
The checked-in tree under deploy/k8s must be exactly what the renderer writes today."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from control.cluster_config import ClusterConfig, SecurityConfig
from control.errors import ConfigError
from control.model_config import ModelConfig
from deploy.cli import main as duet
from deploy.k8s_cluster import node_sets
from deploy.k8s_manifests import (
    APP_DIR,
    CACHE_DIR,
    DRAIN_MARGIN_S,
    PACKS_DIR,
    ROUTER_GRACE_S,
    USER_ID,
    WeightsCache,
)
from deploy.k8s_render import SECRETS_EXAMPLE, base_files, overlay_files, render_tree
from deploy.k8s_yaml import dump_all
from tinymodel.make import ensure_tiny_model

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
CHECKED_IN = {name: f"deploy/configs/{name}.toml" for name in ("1p1d", "2p1d", "1p1d-2rank")}
K8S_VERSION = "1.33.0"  # the schemas validated against (kubernetes-validate ships 1.25 on)
NAMESPACED = {
    "ConfigMap",
    "Service",
    "Deployment",
    "StatefulSet",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ServiceAccount",
    "Secret",
}

# Every branch of the renderer: replicated and single entries, several entries of one role, a
# replicated multi-rank decode entry, a drain longer than the default, another namespace.
WIDE = {
    "router": {"port": 9000, "control_port": 9100},
    "timeouts": {"drain_s": 95.5},
    "security": {"metrics_need_key": True},
    "prefill": [
        {"name": "fast", "replicas": 3, "control_port": 7100, "threads": 4, "num_pages": 512},
        {"name": "slow", "control_port": 7150, "threads": 2},
    ],
    "decode": [
        {
            "name": "big",
            "replicas": 2,
            "ranks": 2,
            "control_port": 7200,
            "kv_port": 7300,
            "threads": 3,
            "num_pages": 1024,
        },
        {"name": "small", "control_port": 7250, "kv_port": 7350},
    ],
}


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_model_dir(ensure_tiny_model())


@pytest.fixture(scope="module")
def cases(tiny):
    """(overlay name, input config, namespace, rendered tree): the checked-in configs and WIDE."""
    out = []
    for name, source in CHECKED_IN.items():
        cluster = ClusterConfig.load(ROOT / source)
        out.append((name, cluster, "duet", render_tree(cluster, tiny, name=name, source=source)))
    wide = ClusterConfig.from_dict(WIDE)
    out.append(("wide", wide, "prod", render_tree(wide, tiny, name="wide", namespace="prod")))
    return out


class Overlay:
    """One rendered overlay, parsed back: its docs by kind, the TOML of its ConfigMap."""

    def __init__(self, cluster: ClusterConfig, namespace: str, name: str, tree: dict[str, str]):
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.docs = [
            doc
            for path, text in tree.items()
            if path.startswith(f"overlays/{name}/") and not path.endswith("kustomization.yaml")
            for doc in yaml.safe_load_all(text)
        ]
        (config_map,) = self.of("ConfigMap")
        self.toml_text = config_map["data"]["cluster.toml"]
        self.k8s = ClusterConfig.from_dict(tomllib.loads(self.toml_text))

    def of(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def named(self, kind: str, name: str) -> dict:
        (doc,) = [d for d in self.of(kind) if d["metadata"]["name"] == name]
        return doc

    def pod_templates(self) -> list[tuple[dict, dict]]:
        """(workload, its pod template) of every Deployment (the router's, the pools') and
        StatefulSet."""
        return [(w, w["spec"]["template"]) for w in self.of("Deployment") + self.of("StatefulSet")]


def _is_router(workload: dict) -> bool:
    return workload["metadata"]["labels"]["app.kubernetes.io/component"] == "router"


def _is_pool(workload: dict) -> bool:
    return workload["metadata"]["name"].endswith("-pool")


@pytest.fixture(scope="module")
def overlays(cases):
    return [Overlay(cluster, ns, name, tree) for name, cluster, ns, tree in cases]


def _container(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


# ---- the checked-in tree and the files ---------------------------------------------------
def test_checked_in_tree_is_what_the_renderer_writes(cases):
    rendered = {}
    for name, _, _, tree in cases:
        if name in CHECKED_IN:
            rendered.update(tree)
    on_disk = {str(p.relative_to(K8S_DIR)) for p in K8S_DIR.rglob("*") if p.is_file()}
    assert on_disk == set(rendered), "deploy/k8s holds files no config renders, or lacks some"
    for rel, text in rendered.items():
        assert (K8S_DIR / rel).read_text() == text, (
            f"deploy/k8s/{rel} is stale: run `duet k8s render --config CONFIG --out deploy/k8s` "
            f"for {', '.join(CHECKED_IN.values())}"
        )


def test_every_manifest_validates_against_the_kubernetes_schemas(cases):
    num_validated = 0
    for _, _, _, tree in cases:
        for path, text in tree.items():
            if path.endswith("kustomization.yaml"):
                continue
            for doc in yaml.safe_load_all(text):
                try:
                    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    where = ".".join(map(str, exc.path))
                    pytest.fail(f"{path}: {doc['kind']} {where}: {exc.message}")
                num_validated += 1
    assert num_validated >= 4 * 12


def test_kustomizations_list_their_files_and_set_the_tomls_namespace(cases, overlays):
    for (name, _, namespace, tree), overlay in zip(cases, overlays, strict=True):
        base = yaml.safe_load(tree["base/kustomization.yaml"])
        assert base["kind"] == "Kustomization" and "namespace" not in base
        in_base = {p.removeprefix("base/") for p in tree if p.startswith("base/")}
        assert set(base["resources"]) == in_base - {
            "kustomization.yaml",
            "secrets.example.yaml",
        }
        kust = yaml.safe_load(tree[f"overlays/{name}/kustomization.yaml"])
        assert kust["namespace"] == namespace
        files = {p.rsplit("/", 1)[1] for p in tree if p.startswith(f"overlays/{name}/")}
        assert kust["resources"][0] == "../../base"
        assert sorted(kust["resources"][1:]) == sorted(files - {"kustomization.yaml"})
        # Every namespaced object, and every DNS name in the TOML, is in that namespace.
        for doc in overlay.docs:
            if doc["kind"] in NAMESPACED:
                assert doc["metadata"]["namespace"] == namespace
        (namespace_doc,) = overlay.of("Namespace")
        assert namespace_doc["metadata"]["name"] == namespace
        for role in (overlay.k8s.router, *overlay.k8s.prefill, *overlay.k8s.decode):
            assert role.host.endswith(f".{namespace}.svc")


@pytest.mark.parametrize(
    "value",
    [
        "yes",
        "on",
        "No",
        "null",
        "~",
        "1",
        "0.0.0.0",
        "1Gi",
        "$(POD_NAME)",
        "a: b",
        "",
        "#x",
        "-m",
        "--config",
        "x # y",
        "é",
        "line\n",
        "two\n\nlines\n",
        "trailing \nspace\n",
        "\tx\n",
        "no newline\nat end",
        " lead\n",
        "end\n\n",
        True,
        0,
        288,
        None,
        [],
        {},
    ],
)
def test_yaml_scalars_read_back_as_written(value):
    doc = {"k": value, "list": [value, {"a": value, "b": [value]}]}
    assert yaml.safe_load(dump_all([doc])) == doc


def test_rendered_yaml_reads_back_as_the_manifests(tiny):
    cluster = ClusterConfig.from_dict(WIDE)
    args = {"namespace": "prod", "image": "img:1", "source": "wide.toml"}
    tree = render_tree(cluster, tiny, name="w", **args)
    for file, docs in overlay_files(cluster, tiny, **args).items():
        assert list(yaml.safe_load_all(tree[f"overlays/w/{file}"])) == docs
    for file, docs in base_files().items():
        assert list(yaml.safe_load_all(tree[f"base/{file}"])) == docs
    assert list(yaml.safe_load_all(tree["base/secrets.example.yaml"])) == SECRETS_EXAMPLE


# ---- agreement with the TOML ---------------------------------------------------------------
def test_config_map_names_every_node_by_its_pods_dns_name(overlays):
    for o in overlays:
        src, k8s = o.cluster, o.k8s
        assert [n.name for n in k8s.prefill] == [n.name for n in src.prefill]
        assert [n.name for n in k8s.decode] == [n.name for n in src.decode]
        pods = {}  # pod DNS name -> (its StatefulSet, pod name)
        for sts in o.of("StatefulSet"):
            svc = o.named("Service", sts["spec"]["serviceName"])
            assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
            for i in range(sts["spec"]["replicas"]):
                pod = f"{sts['metadata']['name']}-{i}"
                pods[f"{pod}.{svc['metadata']['name']}.{o.namespace}.svc"] = (sts, pod)
        hosts = [n.host for n in (*k8s.prefill, *k8s.decode)]
        assert sorted(hosts) == sorted(pods), "one pod per node, one node per pod"
        for node in (*k8s.prefill, *k8s.decode):
            sts, pod = pods[node.host]
            container = _container(sts["spec"]["template"])
            assert container["command"][0].endswith(f"/launch_{_role(k8s, node)}.sh")
            arg = container["args"][1]
            if arg == "$(POD_NAME)":  # the pod's own name, from the downward API
                assert node.name == pod
                (env,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
                assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            else:
                assert arg == node.name and sts["spec"]["replicas"] == 1
        router = o.named("Service", "router")
        assert k8s.router.host == f"router.{o.namespace}.svc"
        assert router["spec"]["publishNotReadyAddresses"]  # nodes register before it is ready
        for role in (k8s.router, *k8s.prefill, *k8s.decode):
            assert role.bind_host == "0.0.0.0"
        # Everything but the addresses and [security] is the input's, field for field.
        assert _without_addresses(k8s) == _without_addresses(src)


def _role(cluster: ClusterConfig, node) -> str:
    return "prefill" if node in cluster.prefill else "decode"


def _without_addresses(cluster: ClusterConfig) -> ClusterConfig:
    def strip(section):
        return dataclasses.replace(section, host="h", bind_host="")

    return dataclasses.replace(
        cluster,
        router=strip(cluster.router),
        prefill=tuple(map(strip, cluster.prefill)),
        decode=tuple(map(strip, cluster.decode)),
        security=dataclasses.replace(
            SecurityConfig(), metrics_need_key=cluster.security.metrics_need_key
        ),
    )


def test_service_and_container_ports_are_the_tomls(overlays):
    for o in overlays:
        k8s = o.k8s
        for sts in o.of("StatefulSet"):
            svc = o.named("Service", sts["spec"]["serviceName"])
            nodes = [
                n
                for n in (*k8s.prefill, *k8s.decode)
                if n.host.endswith(f".{svc['metadata']['name']}.{o.namespace}.svc")
            ]
            want = {n.control_port for n in nodes} | {getattr(n, "kv_port", None) for n in nodes}
            want.discard(None)
            ports = svc["spec"]["ports"]
            assert {p["port"] for p in ports} == want and len(ports) == len(want)
            assert all(p["targetPort"] == p["port"] for p in ports)
            container = _container(sts["spec"]["template"])
            assert {p["containerPort"] for p in container["ports"]} == want
            assert svc["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
            assert sts["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
        router_svc = o.named("Service", "router")
        want = {k8s.router.port, k8s.router.control_port}
        assert {p["port"] for p in router_svc["spec"]["ports"]} == want
        deployment = o.named("Deployment", "router")
        assert {
            p["containerPort"] for p in _container(deployment["spec"]["template"])["ports"]
        } == want
        policy = o.named("NetworkPolicy", "router-http")
        assert policy["spec"]["ingress"] == [
            {"ports": [{"port": k8s.router.port, "protocol": "TCP"}]}
        ]


def test_probes_run_real_commands_against_real_ports(overlays, tmp_path, monkeypatch, capsys):
    from deploy import probe
    from router.__main__ import build_app

    assert importlib.util.find_spec("deploy.probe") is not None
    no_router = _NoRouter()  # no cluster here: record where the probes would go
    for o in overlays:
        config = tmp_path / f"{o.name}.toml"
        config.write_text(o.toml_text)
        for workload, template in o.pod_templates():
            container = _container(template)
            config_mount = _mount_of(template, "configMap")
            args = container["args"]
            config_arg = args[args.index("--config") + 1] if _is_pool(workload) else args[0]
            assert config_arg == f"{config_mount}/cluster.toml"
            script = Path(container["command"][0]).relative_to(APP_DIR)
            assert (ROOT / script).is_file() and (ROOT / script).stat().st_mode & 0o111
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                spec = container[kind]
                if "httpGet" in spec:  # the router's readiness: its /health on its HTTP port
                    assert spec["httpGet"] == {"path": "/health", "port": o.k8s.router.port}
                    continue
                command = spec["exec"]["command"]
                assert command[:3] == ["python", "-m", "deploy.probe"]
                assert command[3:5] == ["--config", config_arg]
                # In this pod (its hostname is its pod name) the probe checks this pod's node:
                # nothing listens here, so it fails (1), never a usage or config error (2).
                # A pool has no pod yet: one as the ReplicaSet would name it.
                for i in range(max(workload["spec"]["replicas"], _is_pool(workload))):
                    pod = _pod(workload, i)
                    monkeypatch.setattr(probe.socket, "gethostname", lambda pod=pod: pod)
                    monkeypatch.setattr(probe, "TIMEOUT_S", 0.2)
                    monkeypatch.setattr(probe.urllib.request, "urlopen", no_router.open)
                    monkeypatch.setattr(probe.socket, "create_connection", no_router.connect)
                    argv = ["--config", str(config), *command[5:]]
                    assert probe.main(argv) == 1
                    out = capsys.readouterr().out
                    check = command[-1]
                    if check == "ready":  # it asks the router, by its Service's name
                        url = f"http://router.{o.namespace}.svc:{o.k8s.router.port}/health"
                        assert no_router.urls.pop() == url
                    if workload["kind"] == "StatefulSet":
                        node = _node_of_pod(o.k8s, workload, i)
                        assert f"node {node.name}:" in out
                    elif _is_pool(workload):  # the pod's node: joined, on the template's ports
                        assert command[5:7] == ["--role", workload["metadata"]["name"][:-5]]
                        node = _pool_template(o.k8s, workload)
                        assert f"node {pod}:" in out
                    if check == "live":  # its own control port first, on loopback
                        assert no_router.addresses.pop() == ("127.0.0.1", node.control_port)
        # The router behind the probes serves /health (an app built from this very TOML).
        cfg = dataclasses.replace(o.k8s, security=SecurityConfig(insecure=True))
        app, (host, port) = build_app(cfg)
        assert (host, port) == ("0.0.0.0", o.k8s.router.port)
        assert any(getattr(r, "path", None) == "/health" for r in app.routes)


class _NoRouter:
    """Stands in for the network: records where the probe goes, answers nothing."""

    def __init__(self):
        self.urls: list[str] = []
        self.addresses: list[tuple[str, int]] = []

    def open(self, url, timeout):
        self.urls.append(url)
        raise OSError("no router in this test")

    def connect(self, address, timeout):
        self.addresses.append(address)
        raise ConnectionRefusedError("nothing listens in this test")


def _pod(workload: dict, i: int) -> str:
    if _is_pool(workload):  # a ReplicaSet's pod: NAME-<hash>-<suffix>
        return f"{workload['metadata']['name']}-5d8f7c9b6-x7k2p"
    return f"{workload['metadata']['name']}-{i}" if workload["kind"] == "StatefulSet" else "x"


def _pool_template(k8s: ClusterConfig, pool: dict):
    role = pool["metadata"]["labels"]["app.kubernetes.io/component"]
    return (k8s.prefill if role == "prefill" else k8s.decode)[0]


def _node_of_pod(k8s: ClusterConfig, sts: dict, i: int):
    (node,) = [n for n in (*k8s.prefill, *k8s.decode) if n.host.startswith(f"{_pod(sts, i)}.")]
    return node


def _mount_of(template: dict, source: str, key: str | None = None) -> str:
    """The mount path of the pod's volume of that source kind (and secret name)."""
    (volume,) = [
        v
        for v in template["spec"]["volumes"]
        if source in v and (key is None or v[source].get("secretName") == key)
    ]
    (mount,) = [m for m in _container(template)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"]
    return mount["mountPath"]


def test_one_disruption_budget_per_role(overlays):
    for o in overlays:
        budgets = o.of("PodDisruptionBudget")
        assert len(budgets) == 3
        for pdb in budgets:
            assert pdb["spec"]["maxUnavailable"] == 1
            selector = pdb["spec"]["selector"]["matchLabels"]
            role = selector["app.kubernetes.io/component"]
            for _, template in o.pod_templates():
                pod_labels = template["metadata"]["labels"]
                matches = all(pod_labels.get(k) == v for k, v in selector.items())
                assert matches == (pod_labels["app.kubernetes.io/component"] == role)
        roles = {
            p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for p in budgets
        }
        assert roles == {"router", "prefill", "decode"}


@pytest.mark.parametrize("drain_s", [0.5, 30.0, 301.25])
def test_termination_grace_covers_the_drain(tiny, drain_s):
    raw = {**WIDE, "timeouts": {"drain_s": drain_s}}
    o = Overlay(
        ClusterConfig.from_dict(raw),
        "duet",
        "g",
        render_tree(ClusterConfig.from_dict(raw), tiny, name="g"),
    )
    for workload, template in o.pod_templates():
        grace = template["spec"]["terminationGracePeriodSeconds"]
        if not _is_router(workload):  # a node set's or a pool's
            assert grace >= drain_s + DRAIN_MARGIN_S and grace == math.ceil(drain_s) + 30
        else:
            assert grace == ROUTER_GRACE_S


# ---- secrets ---------------------------------------------------------------------------------
def test_secrets_are_mounted_where_the_toml_looks_and_never_shipped(cases, overlays, tmp_path):
    from control.security import read_key_file as read_curve_keys
    from router.auth import read_key_file as read_api_keys

    for (_, _, _, tree), o in zip(cases, overlays, strict=True):
        assert not o.of("Secret")  # no Secret is applied by the overlay (nor by the base)
        assert "kind: Secret" not in "".join(
            text for path, text in tree.items() if not path.endswith("secrets.example.yaml")
        )
        for workload, template in o.pod_templates():
            curve = _mount_of(template, "secret", "duet-curve-key")
            assert o.k8s.security.curve_key_file == f"{curve}/cluster.key"
            if _is_router(workload):
                api = _mount_of(template, "secret", "duet-api-keys")
                assert o.k8s.security.api_key_file == f"{api}/api_keys"
            else:  # the nodes never see the API keys
                assert all(
                    v.get("secret", {}).get("secretName") != "duet-api-keys"
                    for v in template["spec"]["volumes"]
                )
            assert template["spec"]["securityContext"]["runAsUser"] == USER_ID
        assert o.k8s.security.api_keys == () and not o.k8s.security.insecure
    # The example's placeholders are refused by the loaders: applied by mistake, the pods stop
    # with an error, with neither a known key nor an open gateway.
    curve_value, api_value = (next(iter(s["stringData"].values())) for s in SECRETS_EXAMPLE)
    (tmp_path / "cluster.key").write_text(curve_value)
    (tmp_path / "api_keys").write_text(api_value)
    with pytest.raises(ConfigError, match="not a CURVE key file"):
        read_curve_keys(tmp_path / "cluster.key")
    with pytest.raises(ConfigError, match="one word"):
        read_api_keys(str(tmp_path / "api_keys"))
    # No key material anywhere under deploy/ (a CURVE key file's lines, a z85 key).
    for path in (ROOT / "deploy").rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".toml", ".py", ".sh"):
            text = path.read_text()
            assert not re.search(r'(public|secret)-key\s*=\s*"[^"]{40}"', text), path


def test_inline_api_keys_are_refused(tiny):
    raw = {**WIDE, "security": {"api_keys": ["sk-live-1"]}}
    with pytest.raises(ConfigError, match="ConfigMap"):
        render_tree(ClusterConfig.from_dict(raw), tiny, name="x")


# ---- the weights cache -----------------------------------------------------------------------
def _cache_volume(template: dict) -> dict | None:
    volumes = [v for v in template["spec"]["volumes"] if v["name"] == "weights-cache"]
    assert len(volumes) <= 1
    return volumes[0] if volumes else None


def _check_cache_mount(template: dict) -> None:
    """The node container mounts the volume read-write where the engine builds its packs."""
    container = _container(template)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "weights-cache"]
    assert mount == {"name": "weights-cache", "mountPath": PACKS_DIR}  # read-write
    (env,) = [e for e in container["env"] if e["name"] == "DUET_CACHE_DIR"]
    assert env == {"name": "DUET_CACHE_DIR", "value": CACHE_DIR}


def _no_cache(template: dict) -> None:
    container = _container(template)
    assert _cache_volume(template) is None and "initContainers" not in template["spec"]
    assert all(m["name"] != "weights-cache" for m in container["volumeMounts"])
    assert all(e["name"] != "DUET_CACHE_DIR" for e in container.get("env", []))


def test_the_mount_is_where_the_engine_caches_its_packs(monkeypatch):
    from model.pack_cache import cache_dir

    monkeypatch.setenv("DUET_CACHE_DIR", CACHE_DIR)
    assert cache_dir() == Path(PACKS_DIR)


def test_node_pods_share_a_host_directory_for_the_weights_cache(overlays):
    """The default: a hostPath on every node pod (one page-cache copy per host, kept across
    restarts), made the image user's by a chown-only init container; never on the router."""
    for o in overlays:
        for workload, template in o.pod_templates():
            if _is_router(workload):
                _no_cache(template)
                continue
            assert _cache_volume(template) == {
                "name": "weights-cache",
                "hostPath": {"path": "/var/cache/duet-serve/packs", "type": "DirectoryOrCreate"},
            }
            _check_cache_mount(template)
            (init,) = template["spec"]["initContainers"]
            assert init["command"] == ["chown", f"{USER_ID}:{USER_ID}", PACKS_DIR]
            assert init["volumeMounts"] == [{"name": "weights-cache", "mountPath": PACKS_DIR}]
            assert init["image"] == _container(template)["image"]
            security = init["securityContext"]
            assert security["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
            assert not security["allowPrivilegeEscalation"]


def _rendered(tiny, raw: dict, cache: WeightsCache) -> Overlay:
    cluster = ClusterConfig.from_dict(raw)
    tree = render_tree(cluster, tiny, name="c", weights_cache=cache)
    for path, text in tree.items():
        if not path.endswith("kustomization.yaml"):
            for doc in yaml.safe_load_all(text):
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    return Overlay(cluster, "duet", "c", tree)


def test_weights_cache_on_a_persistent_volume_claim(tiny):
    o = _rendered(tiny, WIDE, WeightsCache("pvc", claim="duet-packs"))
    assert not o.of("PersistentVolumeClaim")  # referenced, made beforehand
    for workload, template in o.pod_templates():
        if _is_router(workload):
            _no_cache(template)
            continue
        volume = _cache_volume(template)
        assert volume == {
            "name": "weights-cache",
            "persistentVolumeClaim": {"claimName": "duet-packs"},
        }
        _check_cache_mount(template)
        assert "initContainers" not in template["spec"]  # fsGroup makes it the pods' own


def test_no_weights_cache_volume(tiny):
    """`none` renders no volume: for nodes that do not build their pack in the cache (an
    explicit `pack`, or weights_cache = false); a node that would is refused, since the image's
    cache directory is not the pods' to write. Such nodes get no volume whatever the option."""
    raw = {
        **WIDE,
        "prefill": [{**n, "pack": f"/models/{n['name']}.pack"} for n in WIDE["prefill"]],
        "decode": [{**n, "weights_cache": False} for n in WIDE["decode"]],
    }
    for kind in ("none", "hostpath", "pvc"):
        o = _rendered(tiny, raw, WeightsCache(kind))
        for _, template in o.pod_templates():
            _no_cache(template)
        assert {n.pack for n in o.k8s.prefill} == {f"/models/{n}.pack" for n in ("fast", "slow")}
    with pytest.raises(ConfigError, match="weights_cache = false"):
        render_tree(
            ClusterConfig.from_dict(WIDE), tiny, name="c", weights_cache=WeightsCache("none")
        )


@pytest.mark.parametrize(
    "cache, option",
    [
        (WeightsCache(path="cache"), "--weights-cache-path"),
        (WeightsCache(path="/"), "--weights-cache-path"),
        (WeightsCache("pvc", claim="Bad_Claim"), "--weights-cache-claim"),
        (WeightsCache("emptydir"), "--weights-cache"),
    ],
)
def test_bad_weights_cache_options_are_refused(tiny, cache, option):
    with pytest.raises(ConfigError, match=option):
        render_tree(ClusterConfig.from_dict(WIDE), tiny, name="c", weights_cache=cache)


def test_duet_k8s_render_weights_cache_options(tiny, tmp_path, capsys):
    config = ROOT / "deploy" / "configs" / "1p1d.toml"
    cluster = ClusterConfig.load(config)
    for options, cache in [
        (
            ["--weights-cache", "pvc", "--weights-cache-claim", "packs"],
            WeightsCache("pvc", claim="packs"),
        ),
        (["--weights-cache-path", "/mnt/nvme/duet"], WeightsCache(path="/mnt/nvme/duet")),
        (["--weights-cache", "hostpath"], WeightsCache()),
    ]:
        out = tmp_path / options[-1].strip("/").replace("/", "-")
        argv = ["k8s", "render", "--config", str(config), "--out", str(out), "--name", "c"]
        assert duet([*argv, *options]) == 0
        expected = render_tree(cluster, tiny, name="c", source=str(config), weights_cache=cache)
        written = {str(p.relative_to(out)): p.read_text() for p in out.rglob("*.yaml")}
        assert written == expected
    argv = ["k8s", "render", "--config", str(config), "--out", str(tmp_path / "x")]
    assert duet([*argv, "--weights-cache", "none"]) == 1  # the shipped nodes cache their packs
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "weights_cache" in err


# ---- node sets -------------------------------------------------------------------------------
def test_node_sets_follow_the_entries():
    def sets(raw):
        return [
            (s.role, s.name, s.replicas, s.is_pod_named)
            for s in node_sets(ClusterConfig.from_dict(raw))
        ]

    assert sets(WIDE) == [
        ("prefill", "fast", 3, True),
        ("prefill", "slow", 1, False),
        ("decode", "big", 2, True),
        ("decode", "small", 1, False),
    ]
    # Hand-written p-0, p-1 that differ in more than ports stay apart: each its own StatefulSet.
    raw = {
        "prefill": [
            {"name": "p-0", "control_port": 1},
            {"name": "p-1", "control_port": 2, "threads": 2},
        ],
        "decode": [{"name": "d", "control_port": 3, "kv_port": 4}],
    }
    assert sets(raw) == [
        ("prefill", "p", 1, True),
        ("prefill", "p-1", 1, False),
        ("decode", "d", 1, False),
    ]


@pytest.mark.parametrize("name", ["Prefill", "p_1", "9p", "router", "x" * 53])
def test_names_kubernetes_cannot_use_are_refused(tiny, name):
    raw = {"prefill": [{"name": name}], "decode": [{"name": "d"}]}
    with pytest.raises(ConfigError):
        render_tree(ClusterConfig.from_dict(raw), tiny, name="x")


# ---- the command -----------------------------------------------------------------------------
def test_duet_k8s_render_writes_the_tree(tiny, tmp_path, capsys):
    config = ROOT / "deploy" / "configs" / "2p1d.toml"
    argv = [
        "k8s",
        "render",
        "--config",
        str(config),
        "--out",
        str(tmp_path),
        "--namespace",
        "prod",
        "--image",
        "registry.example/duet:1",
        "--name",
        "two",
    ]
    assert duet(argv) == 0
    expected = render_tree(
        ClusterConfig.load(config),
        tiny,
        name="two",
        namespace="prod",
        image="registry.example/duet:1",
        source=str(config),
    )
    written = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*.yaml")}
    assert written == expected
    assert "kubectl apply -k" in capsys.readouterr().out


def test_duet_k8s_render_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[security]\napi_keys = ["k"]\n[[prefill]]\nname = "p"\n[[decode]]\nname = "d"\n'
    )
    assert duet(["k8s", "render", "--config", str(bad), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    config = str(ROOT / "deploy" / "configs" / "1p1d.toml")
    argv = ["k8s", "render", "--config", config, "--out", str(tmp_path), "--namespace", "Bad_NS"]
    assert duet(argv) == 1
    assert not (tmp_path / "o").exists() and not (tmp_path / "base").exists()


def test_the_prefill_disk_tier_gets_a_host_directory(tiny):
    """A prefill node's `disk_cache_dir`: a hostPath (the host's prefill pods share one store,
    a restarted pod finds it warm), owned by the image's user, mounted writable at the TOML's
    path in the prefill pods only; a relative path is refused."""
    raw = {
        **WIDE,
        "prefill": [{**n, "disk_cache_dir": "/var/lib/duet-kv"} for n in WIDE["prefill"]],
    }
    o = _rendered(tiny, raw, WeightsCache())
    seen = 0
    for workload, template in o.pod_templates():
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        (container,) = template["spec"]["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        if workload["metadata"]["labels"]["app.kubernetes.io/component"] != "prefill":
            assert "kv-disk-cache" not in volumes
            continue
        seen += 1
        assert volumes["kv-disk-cache"]["hostPath"]["type"] == "DirectoryOrCreate"
        assert mounts["kv-disk-cache"] == {"name": "kv-disk-cache", "mountPath": "/var/lib/duet-kv"}
        owners = [c for c in template["spec"]["initContainers"] if c["name"] == "kv-disk-owner"]
        assert owners[0]["command"][-1] == "/var/lib/duet-kv"
    assert seen == 3  # the prefill sets "fast" and "slow", and the prefill pool
    raw["prefill"][0]["disk_cache_dir"] = "kv"
    with pytest.raises(ConfigError, match="absolute path"):
        render_tree(ClusterConfig.from_dict(raw), tiny, name="c")


def test_router_replicas_are_a_stateful_set_each_pod_named_in_the_toml(tiny):
    """`[router] replicas`: pod i runs `--replica router-i` (its pod name) and binds the
    TOML's ports; the nodes reach each pod by the headless Service's DNS name, which the TOML's
    `replica_hosts` lists; clients reach any router through the Service."""
    from router.__main__ import replica_index

    raw = {**WIDE, "router": {**WIDE["router"], "replicas": 2}}
    o = _rendered(tiny, raw, WeightsCache())
    assert not [d for d in o.of("Deployment") if d["metadata"]["name"] == "router"]
    routers = o.named("StatefulSet", "router")
    assert routers["spec"]["replicas"] == 2 and routers["spec"]["serviceName"] == "router-pods"
    container = _container(routers["spec"]["template"])
    assert container["args"][-2:] == ["--replica", "$(POD_NAME)"]
    (env,) = container["env"]
    assert (
        env["name"] == "POD_NAME" and env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    )
    assert [replica_index(_pod(routers, i)) for i in range(2)] == [0, 1]
    headless = o.named("Service", "router-pods")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == routers["spec"]["selector"]["matchLabels"]
    assert [p["port"] for p in headless["spec"]["ports"]] == [9100]
    router = o.k8s.router
    pods = [f"{_pod(routers, i)}.router-pods.duet.svc" for i in range(2)]
    assert router.replica_hosts == tuple(pods)
    assert router.control_endpoints == [f"tcp://{pod}:9100" for pod in pods]
    assert [router.for_replica(i).port for i in range(2)] == [9000, 9000]  # one port, two pods
    assert o.named("Service", "router")["spec"]["selector"] == headless["spec"]["selector"]


def test_each_role_has_a_pool_of_joining_nodes(overlays, tmp_path, capsys):
    """A Deployment per role (none at first) whose pods join as nodes named after themselves,
    at their own address, on the template's ports: `kubectl scale` adds nodes with no config
    change. A role whose first node runs several ranks has none (a joining node runs one)."""
    for o in overlays:
        for role in ("prefill", "decode"):
            template = (o.k8s.prefill if role == "prefill" else o.k8s.decode)[0]
            pools = [d for d in o.of("Deployment") if d["metadata"]["name"] == f"{role}-pool"]
            if template.ranks > 1:
                assert not pools
                continue
            (pool,) = pools
            assert pool["spec"]["replicas"] == 0
            labels_ = pool["spec"]["template"]["metadata"]["labels"]
            assert labels_["app.kubernetes.io/component"] == role
            assert pool["spec"]["selector"]["matchLabels"] == labels_
            container = _container(pool["spec"]["template"])
            assert container["command"] == [f"{APP_DIR}/deploy/launch_join.sh"]
            want = ["--role", role, "--config", "/etc/duet/config/cluster.toml"]
            want += ["--name", "$(POD_NAME)", "--control-port", str(template.control_port)]
            want += ["--host", "$(POD_IP)"]
            ports = {template.control_port}
            if role == "decode":
                want += ["--kv-port", str(template.kv_port)]
                ports.add(template.kv_port)
            assert container["args"] == want
            assert {p["containerPort"] for p in container["ports"]} == ports
            fields = {
                e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
                for e in container["env"]
                if "valueFrom" in e
            }
            assert fields["POD_NAME"] == "metadata.name" and fields["POD_IP"] == "status.podIP"
            # What `duet node` makes of those arguments: a valid joining node of that role.
            pod, ip = _pod(pool, 0), "10.1.2.3"
            joined = o.k8s.joining_node(
                role, pod, template.control_port, getattr(template, "kv_port", 0), ip
            )
            assert joined.control_endpoint == f"tcp://{ip}:{template.control_port}"
            assert joined.bind_host == "0.0.0.0"
            # The launch script's arguments are `duet node`'s: it gets as far as the config.
            args = [a.replace("$(POD_NAME)", pod).replace("$(POD_IP)", ip) for a in want]
            args[args.index("--config") + 1] = str(tmp_path / "absent.toml")
            assert duet(["node", *args]) != 0
            assert "absent.toml: cannot read" in capsys.readouterr().err
        budgets = {
            d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: d
            for d in o.of("PodDisruptionBudget")
        }
        for pool in [d for d in o.of("Deployment") if _is_pool(d)]:  # drains count too
            role = pool["metadata"]["labels"]["app.kubernetes.io/component"]
            selector = budgets[role]["spec"]["selector"]["matchLabels"]
            assert selector.items() <= pool["spec"]["template"]["metadata"]["labels"].items()


def test_autoscale_on_kubernetes_scales_the_pools_with_a_role_to_do_it(tiny):
    decode = [{**WIDE["decode"][0], "ranks": 1}, *WIDE["decode"][1:]]  # joining nodes: 1 rank
    raw = {
        **WIDE,
        "decode": decode,
        "autoscale": {"enabled": True, "max_prefill": 6, "max_decode": 5},
    }
    o = _rendered(tiny, raw, WeightsCache())  # every document against the schemas
    assert o.k8s.autoscale.launcher == "kubernetes" and o.k8s.autoscale.namespace == "duet"
    role = o.named("Role", "duet-autoscaler")
    scale, pods = role["rules"]
    assert scale == {
        "apiGroups": ["apps"],
        "resources": ["deployments/scale"],
        "resourceNames": ["prefill-pool", "decode-pool"],
        "verbs": ["get", "patch"],
    }
    assert pods == {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}
    binding = o.named("RoleBinding", "duet-autoscaler")
    assert binding["roleRef"]["name"] == "duet-autoscaler"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "duet-serve", "namespace": "duet"}
    ]
    for workload, template in o.pod_templates():  # only the router holds the API token
        assert template["spec"]["serviceAccountName"] == "duet-serve"
        assert template["spec"]["automountServiceAccountToken"] is _is_router(workload)
    assert len([d for d in o.of("Deployment") if _is_pool(d)]) == 2
    plain = _rendered(tiny, WIDE, WeightsCache())
    assert not plain.of("Role") and not plain.of("RoleBinding")
    assert plain.k8s.autoscale.launcher == "local"  # off: as the input says

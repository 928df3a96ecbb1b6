"""`duet k8s render`: Kubernetes manifests (a kustomize base and one overlay) for a cluster TOML.

    duet k8s render --config FILE --out DIR [--name NAME] [--namespace NS] [--image IMAGE]
                    [--model-config PATH] [--weights-cache hostpath|pvc|none]
                    [--weights-cache-path HOST_DIR] [--weights-cache-claim PVC]

writes DIR/base/ (the same for every cluster: the pods' ServiceAccount, a NetworkPolicy that
opens the pods' ports to the cluster's own pods only, and an example of the two Secrets that is
never applied) and DIR/overlays/NAME/ (NAME defaults to the TOML's file stem): the Namespace,
the TOML the pods read as a ConfigMap (`deploy.k8s_cluster`), the router, the node sets and the
disruption budgets (`deploy.k8s_manifests`), and a kustomization.yaml over them and the base.
The node pods keep their packed weights on the `weights-cache` volume
(`deploy.k8s_manifests.WeightsCache`): the host's HOST_DIR (default), the claim PVC, or none.

The pods are sized from the model named by the TOML (`deploy.k8s_resources`): its config.json
is read on this machine, or from --model-config, or the built-in tiny model's. `render_tree`
(a pure function of the ClusterConfig and the ModelConfig) gives every file's text; the files
under deploy/k8s are its output for deploy/configs/{1p1d,2p1d,1p1d-2rank}.toml, and a test
renders them again and compares, so they cannot drift from the TOML.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

from control.cluster_config import ClusterConfig
from control.errors import ConfigError
from control.model_config import ModelConfig
from deploy.k8s_cluster import (
    API_KEY_FILE,
    KEY_FILE,
    cluster_toml,
    k8s_cluster,
    node_sets,
)
from deploy.k8s_manifests import (
    API_SECRET,
    APP,
    CONFIG_MAP,
    CURVE_SECRET,
    IMAGE,
    NAMESPACE,
    WEIGHTS_CACHE_KINDS,
    Doc,
    WeightsCache,
    disruption_budgets,
    meta,
    node_set_manifests,
    pool_manifests,
    router_manifests,
)
from deploy.k8s_yaml import dump_all

KUSTOMIZE = "kustomize.config.k8s.io/v1beta1"
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


# ---- files ---------------------------------------------------------------------------------
def overlay_files(
    cluster: ClusterConfig,
    model: ModelConfig,
    *,
    namespace: str,
    image: str,
    source: str,
    weights_cache: WeightsCache = WeightsCache(),
) -> dict[str, list[Doc]]:
    """The overlay's manifests by file name (kustomization.yaml apart)."""
    k8s = k8s_cluster(cluster, namespace)
    toml_text = cluster_toml(k8s, source)
    digest = hashlib.sha256(toml_text.encode()).hexdigest()[:16]
    sets = node_sets(cluster)
    files: dict[str, list[Doc]] = {
        "namespace.yaml": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        ],
        "configmap.yaml": [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": meta(CONFIG_MAP, namespace, {"app.kubernetes.io/name": APP}),
                "data": {"cluster.toml": toml_text},
            }
        ],
        "router.yaml": router_manifests(k8s, namespace, image, digest),
    }
    for role in ("prefill", "decode"):
        files[f"{role}.yaml"] = [
            doc
            for s in sets
            if s.role == role
            for doc in node_set_manifests(
                cluster, s, model, namespace, image, digest, weights_cache
            )
        ] + pool_manifests(cluster, role, model, namespace, image, digest, weights_cache)
    files["pdb.yaml"] = disruption_budgets(namespace)
    return files


def base_files() -> dict[str, list[Doc]]:
    pods = {"matchLabels": {"app.kubernetes.io/name": APP}}
    return {
        "serviceaccount.yaml": [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": APP, "labels": {"app.kubernetes.io/name": APP}},
                "automountServiceAccountToken": False,
            }
        ],
        "networkpolicy.yaml": [
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "duet-internal", "labels": {"app.kubernetes.io/name": APP}},
                "spec": {
                    "podSelector": pods,
                    "policyTypes": ["Ingress"],
                    # Every port of every pod (control, KV, a decode node's gloo ranks) is open
                    # to the cluster's own pods only.
                    "ingress": [{"from": [{"podSelector": pods}]}],
                },
            }
        ],
    }


# Placeholders that every loader refuses (a space inside an API key, no key lines in the key
# file), so applying this file by mistake stops the pods with an error instead of opening them.
SECRETS_EXAMPLE = [
    {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": CURVE_SECRET, "labels": {"app.kubernetes.io/name": APP}},
        "type": "Opaque",
        "stringData": {KEY_FILE: "PLACEHOLDER, NOT A KEY: see the commands at the top\n"},
    },
    {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": API_SECRET, "labels": {"app.kubernetes.io/name": APP}},
        "type": "Opaque",
        "stringData": {API_KEY_FILE: "PLACEHOLDER, NOT A KEY: see the commands at the top\n"},
    },
]


def secret_commands(namespace: str) -> str:
    return (
        "duet keygen ./keys    # writes ./keys/cluster.key (mode 0600)\n"
        f"kubectl -n {namespace} create secret generic {CURVE_SECRET} "
        f"--from-file={KEY_FILE}=./keys/{KEY_FILE}\n"
        f"kubectl -n {namespace} create secret generic {API_SECRET} "
        f"--from-file={API_KEY_FILE}=./api_keys    # one key per line\n"
    )


def _kustomization(resources: list[str], namespace: str | None = None) -> Doc:
    doc: Doc = {"apiVersion": KUSTOMIZE, "kind": "Kustomization"}
    if namespace:
        doc["namespace"] = namespace
    doc["resources"] = resources
    return doc


def render_tree(
    cluster: ClusterConfig,
    model: ModelConfig,
    *,
    name: str,
    namespace: str = NAMESPACE,
    image: str = IMAGE,
    source: str = "the cluster config",
    weights_cache: WeightsCache = WeightsCache(),
) -> dict[str, str]:
    """Every file's text by its path under the output directory: base/... and
    overlays/NAME/... (ConfigError for a config Kubernetes cannot run as given)."""
    weights_cache.check()
    if not _LABEL.fullmatch(namespace) or len(namespace) > 63:
        raise ConfigError(f"--namespace {namespace!r} is not a Kubernetes namespace name")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name.startswith("."):
        raise ConfigError(f"--name {name!r} must be one path component")
    out: dict[str, str] = {}
    base = base_files()
    common = "Written by `duet k8s render`: the same for every cluster config."
    for file, docs in base.items():
        out[f"base/{file}"] = dump_all(docs, common)
    out["base/kustomization.yaml"] = dump_all([_kustomization(list(base))], common)
    out["base/secrets.example.yaml"] = dump_all(
        SECRETS_EXAMPLE,
        f"{common}\nNot applied (not in kustomization.yaml): the Secrets the pods mount, with\n"
        f"placeholders the pods refuse. Create the real ones instead:\n"
        f"{secret_commands(NAMESPACE)}",
    )
    files = overlay_files(
        cluster,
        model,
        namespace=namespace,
        image=image,
        source=source,
        weights_cache=weights_cache,
    )
    rendered = (
        f"Rendered by `duet k8s render --config {source}`: do not edit, edit the TOML and render"
        " again."
    )
    for file, docs in files.items():
        out[f"overlays/{name}/{file}"] = dump_all(docs, rendered)
    kustomization = _kustomization(["../../base", *files], namespace)
    out[f"overlays/{name}/kustomization.yaml"] = dump_all([kustomization], rendered)
    return out


# ---- the command ---------------------------------------------------------------------------
def _model_config(cluster: ClusterConfig, path: str | None) -> ModelConfig:
    """The model to size the pods from: --model-config (config.json or its directory), else the
    TOML's model directory, else the built-in tiny model."""
    if path:
        p = Path(path)
        return ModelConfig.from_model_dir(p.parent if p.name == "config.json" else p)
    if cluster.model:
        if not (Path(cluster.model) / "config.json").is_file():
            raise ConfigError(
                f"{cluster.model}/config.json is not on this machine: pass --model-config with "
                "a copy of the checkpoint's config.json to size the pods"
            )
        return ModelConfig.from_model_dir(cluster.model)
    from control.builtin_model import ensure_builtin_model

    return ModelConfig.from_model_dir(ensure_builtin_model())


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="duet k8s", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="write the kustomize base and an overlay for a cluster TOML")
    r.add_argument("--config", required=True, help="cluster config (TOML)")
    r.add_argument("--out", required=True, help="output directory (base/ and overlays/NAME/)")
    r.add_argument("--name", help="overlay name (default: the config's file stem)")
    r.add_argument("--namespace", default=NAMESPACE)
    r.add_argument("--image", default=IMAGE)
    r.add_argument("--model-config", help="config.json (or its directory) to size the pods from")
    default = WeightsCache()
    r.add_argument(
        "--weights-cache",
        choices=WEIGHTS_CACHE_KINDS,
        default=default.kind,
        help="the node pods' packed-weight cache: a directory of the host, shared by its pods "
        "(default), a PersistentVolumeClaim, or none",
    )
    r.add_argument(
        "--weights-cache-path",
        default=default.path,
        metavar="HOST_DIR",
        help=f"the host's directory for hostpath (default {default.path})",
    )
    r.add_argument(
        "--weights-cache-claim",
        default=default.claim,
        metavar="PVC",
        help=f"the existing PersistentVolumeClaim for pvc (default {default.claim})",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        cluster = ClusterConfig.load(args.config)
        model = _model_config(cluster, args.model_config)
        name = args.name or Path(args.config).stem
        tree = render_tree(
            cluster,
            model,
            name=name,
            namespace=args.namespace,
            image=args.image,
            source=args.config,
            weights_cache=WeightsCache(
                args.weights_cache, args.weights_cache_path, args.weights_cache_claim
            ),
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    try:
        for rel, text in tree.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(text)
    except OSError as exc:
        print(f"error: {out}: cannot write the manifests ({exc.strerror})", file=sys.stderr)
        return 1
    print(f"wrote {out / 'base'} and {out / 'overlays' / name}; then:")
    print(f"kubectl create namespace {args.namespace}")
    print(secret_commands(args.namespace), end="")
    print(f"kubectl apply -k {out / 'overlays' / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

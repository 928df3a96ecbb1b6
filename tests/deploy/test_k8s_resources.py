"""Pod requests sized from the model (deploy/k8s_resources.py): weight bytes against the tiny
checkpoint's own tensors, the bench model's shapes (DeepSeek-V2-Lite layers) against the count
the README states, KV pool bytes by hand, decode ranks sharing the routed experts, and the
rendered manifests carrying exactly these numbers."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from safetensors import safe_open

from control.cluster_config import ClusterConfig, DecodeNodeConfig, PrefillNodeConfig
from control.errors import ConfigError
from control.model_config import ModelConfig
from deploy.k8s_render import render_tree
from deploy.k8s_resources import (
    MARGIN,
    MIB,
    RUNTIME_BYTES,
    kv_pool_bytes,
    node_resources,
    shm_bytes,
    weight_bytes,
)
from model.weight_names import checkpoint_shapes, keeps_fp32, mtp_copy_names, mtp_shapes
from tinymodel.bench_model import bench_config
from tinymodel.make import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_model_dir(ensure_tiny_model())


@pytest.fixture(scope="module")
def bench() -> ModelConfig:
    return ModelConfig.from_dict(bench_config(4, 32000, 1, 2))


def test_tiny_weight_bytes_are_the_checkpoints_tensors(tiny):
    expected = {"bfloat16": 0, "float32": 0}
    read = set(checkpoint_shapes(tiny))  # what the loader reads (not the MTP layer yet)
    with safe_open(str(ensure_tiny_model() / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for name in names & read:
            numel = math.prod(f.get_slice(name).get_shape())
            expected["bfloat16"] += numel * (4 if keeps_fp32(name) else 2)
            expected["float32"] += numel * 4
    assert names == read | set(mtp_shapes(tiny)) | set(mtp_copy_names(tiny))
    for dtype, num_bytes in expected.items():
        assert weight_bytes(tiny, dtype) == num_bytes


def test_bench_model_shapes(bench):
    shapes = checkpoint_shapes(bench)
    num_params = sum(math.prod(s) for s in shapes.values())
    assert round(num_params / 1e9, 2) == 1.97  # the README's "4 layers, 1.97 B parameters"
    num_fp32 = sum(math.prod(s) for n, s in shapes.items() if keeps_fp32(n))
    assert num_fp32 == 3 * (64 * 2048 + 64)  # three MoE layers' gate and correction bias
    assert weight_bytes(bench, "bfloat16") == 2 * num_params + 2 * num_fp32
    # [layers, pages, page_size, kv_lora_rank + rope_dim] in bf16
    assert kv_pool_bytes(bench, "bfloat16", 2048, 16) == 4 * 2048 * 16 * (512 + 64) * 2


def test_prefill_node_request(bench):
    node = PrefillNodeConfig(name="p", threads=8, num_pages=4096, page_size=16)
    res = node_resources(bench, "bfloat16", node)
    weights, kv = weight_bytes(bench, "bfloat16"), kv_pool_bytes(bench, "bfloat16", 4096, 16)
    assert (res.weight_bytes, res.kv_bytes, res.cpu) == (weights, kv, 8)
    assert res.memory_bytes == math.ceil((weights + kv) * MARGIN) + RUNTIME_BYTES
    assert 4.5e9 < res.memory_bytes < 6.5e9  # ~3.9 GB of bf16 weights, 0.3 GB of KV
    memory = f"{math.ceil(res.memory_bytes / MIB)}Mi"
    assert res.k8s() == {"requests": {"cpu": "8", "memory": memory}, "limits": {"memory": memory}}


def test_decode_ranks_share_the_routed_experts(bench):
    node = DecodeNodeConfig(name="d", threads=3, ranks=2, num_pages=2048, page_size=16)
    res = node_resources(bench, "bfloat16", node)
    full = weight_bytes(bench, "bfloat16")
    experts = 3 * 64 * 3 * 2048 * 1408 * 2  # MoE layers x routed experts x 3 matrices, bf16
    # Each rank: everything but the routed experts, plus its half of them.
    assert res.weight_bytes == 2 * (full - experts) + experts
    assert res.kv_bytes == 2 * kv_pool_bytes(bench, "bfloat16", 2048, 16)  # a pool per rank
    assert res.cpu == 6
    expected = math.ceil((res.weight_bytes + res.kv_bytes) * MARGIN) + 2 * RUNTIME_BYTES
    assert res.memory_bytes == expected


SPLIT = ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
         "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
         "shared_experts.down_proj.weight")  # fmt: skip


def test_tensor_parallel_prefill_ranks_split_heads_mlps_and_experts(bench):
    """A prefill node of 2 tensor-parallel ranks: each holds half of every head-split and
    MLP-split matrix, half the routed experts, and the rest (embedding, head, latent
    projections, norms, gates) whole."""
    node = PrefillNodeConfig(name="p", threads=2, ranks=2, num_pages=1024, page_size=16)
    res = node_resources(bench, "bfloat16", node)
    shapes = checkpoint_shapes(bench)
    full = weight_bytes(bench, "bfloat16")
    split = sum(
        2 * math.prod(s) for n, s in shapes.items() if n.endswith(SPLIT) and ".experts." not in n
    )
    experts = 3 * 64 * 3 * 2048 * 1408 * 2  # MoE layers x routed experts x 3 matrices, bf16
    assert split > 0
    assert res.weight_bytes == 2 * (full - split - experts) + split + experts
    assert res.kv_bytes == 2 * kv_pool_bytes(bench, "bfloat16", 1024, 16)  # a pool per rank
    assert res.cpu == 4
    with pytest.raises(ConfigError, match="divisible by 3"):  # 16 heads over 3 ranks
        node_resources(bench, "bfloat16", PrefillNodeConfig(name="p", ranks=3))
    # "tp_sp": only the heads' q / kv_b projections split; o_proj, MLPs and experts whole.
    sp = node_resources(bench, "bfloat16", dataclasses.replace(node, parallel="tp_sp"))
    heads = sum(
        2 * math.prod(s)
        for n, s in shapes.items()
        if n.endswith(("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight"))
    )
    assert sp.weight_bytes == 2 * full - heads
    assert sp.kv_bytes == res.kv_bytes


def test_more_ranks_than_experts_is_refused_as_the_node_would(tiny):
    node = DecodeNodeConfig(name="d", ranks=tiny.n_routed_experts + 1)
    with pytest.raises(ConfigError, match="routed experts"):
        node_resources(tiny, "bfloat16", node)


@pytest.mark.parametrize("model_name", ["tiny", "bench"])
def test_manifests_carry_the_computed_requests(request, model_name):
    model = request.getfixturevalue(model_name)
    cluster = ClusterConfig.load(ROOT / "deploy" / "configs" / "1p1d-2rank.toml")
    tree = render_tree(cluster, model, name="r")
    nodes = {"prefill": cluster.prefill[0], "decode": cluster.decode[0]}
    for role, node in nodes.items():
        docs = list(yaml.safe_load_all(tree[f"overlays/r/{role}.yaml"]))
        (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        assert container["resources"] == node_resources(model, cluster.dtype, node).k8s()


def test_mapped_weights_are_still_counted_in_every_pod(tiny):
    """A node mapping its pack (from the weights cache or an explicit `pack`) holds its weights
    in page cache shared per host, not in its heap: each pod still asks for all of them (an
    upper bound: the pod charged for the shared pages keeps them resident)."""
    node = DecodeNodeConfig(name="d", ranks=2)
    heap = node_resources(tiny, "bfloat16", dataclasses.replace(node, weights_cache=False))
    assert node.weights_cache and node_resources(tiny, "bfloat16", node) == heap
    mapped = dataclasses.replace(node, pack="/models/d.pack")
    assert node_resources(tiny, "bfloat16", mapped) == heap


def test_a_tensor_parallel_prefill_pod_gets_a_dev_shm_for_its_segment(tiny):
    """Prefill ranks over the shared-memory collectives: the segment (two buffers of a 4 MiB
    slot a rank) lives in a memory-backed /dev/shm of its size, counted in the pod's memory;
    over gloo, or on one rank, no such volume."""
    raw = tomllib.loads((ROOT / "deploy" / "configs" / "1p1d.toml").read_text())
    raw["prefill"][0]["ranks"] = 2
    cluster = ClusterConfig.from_dict(raw)
    node = cluster.prefill[0]
    assert shm_bytes(node) == 2 * 2 * 4 * MIB + MIB
    plain = node_resources(tiny, cluster.dtype, dataclasses.replace(node, all_reduce="gloo"))
    assert node_resources(tiny, cluster.dtype, node).memory_bytes == plain.memory_bytes + 17 * MIB
    spec = _pod_spec(render_tree(cluster, tiny, name="r"), "prefill")
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "17Mi"}} in spec[
        "volumes"
    ]
    (container,) = spec["containers"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    for role in ("prefill", "decode"):  # the shipped 1p1d: one rank, no volume
        spec = _pod_spec(
            render_tree(
                ClusterConfig.from_dict(
                    tomllib.loads((ROOT / "deploy" / "configs" / "1p1d.toml").read_text())
                ),
                tiny,
                name="r",
            ),
            role,
        )
        assert all(v["name"] != "dshm" for v in spec["volumes"])


def test_ranks_on_other_hosts_are_refused_for_kubernetes(tiny):
    raw = tomllib.loads((ROOT / "deploy" / "configs" / "1p1d.toml").read_text())
    raw["prefill"][0].update(ranks=2, rank_hosts=["10.0.0.9"], all_reduce="gloo", group_port=7150)
    with pytest.raises(ConfigError, match="rank_hosts .* is not rendered for Kubernetes"):
        render_tree(ClusterConfig.from_dict(raw), tiny, name="r")


def _pod_spec(tree: dict[str, str], role: str) -> dict:
    docs = list(yaml.safe_load_all(tree[f"overlays/r/{role}.yaml"]))
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    return sts["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def random_tiny_dir(tmp_path_factory):
    """The random tiny model (512 tokens): its projections and experts are most of its bytes,
    as in a real checkpoint; the trained default's 2048-token embedding and head are not."""
    from tinymodel.make import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_a_quantized_node_asks_for_its_quantized_weights(random_tiny_dir, quant):
    """A node with `quant` holds its projections and experts at about a byte a weight: the
    estimate is checked against the bytes the model loaded in that scheme really holds (every
    tensor storage reachable from it, bench/e2e_worker.held_tensor_bytes). The estimate counts
    the checkpoint's kv_b once, the model holds it twice (packed, and as W_UK / W_UV), and the
    packing pads small matrices to its blocks (fp8: 32 rows, so the tiny model's 40-row kv_a
    holds 64): measured 6.7 % (int8) and 11.6 % (fp8) under on the tiny model, 0.8 % on the
    bench model; bounded at 15 %."""
    import torch

    from bench.e2e_worker import held_tensor_bytes
    from model.deepseek import DeepseekModel

    tiny = ModelConfig.from_model_dir(random_tiny_dir)
    model = DeepseekModel.from_pretrained(
        random_tiny_dir, torch.bfloat16, progress=False, quant=quant
    )
    estimate = weight_bytes(tiny, "bfloat16", quant=quant)
    held = held_tensor_bytes(model)
    assert 0 <= (held - estimate) / held < 0.15, (estimate, held)
    assert estimate < 0.8 * weight_bytes(tiny, "bfloat16")
    node = DecodeNodeConfig(name="d", quant=quant)
    assert node_resources(tiny, "bfloat16", node).weight_bytes == estimate


def test_the_attention_scheme_is_counted_apart_from_quant(random_tiny_dir):
    """`quant_attention` changes the attention projections' bytes alone: each [N, K] of them
    (q_a, q_b, kv_a, o_proj of every layer, as the checkpoint stores them) counts 2 N K in bf16,
    N K + 8 N in int8 (the default under int4: a scale and a compensation a row), N K / 2 +
    4 N ceil(K / 64) in int4 (an fp32 scale a group); the MLPs keep `quant`'s. A node's key
    reaches its pod's estimate."""
    tiny = ModelConfig.from_model_dir(random_tiny_dir)
    projections = (".q_a_proj.weight", ".q_b_proj.weight", ".kv_a_proj_with_mqa.weight")
    projections += (".o_proj.weight",)
    with safe_open(str(random_tiny_dir / "model.safetensors"), "pt") as f:
        shapes = [f.get_slice(n).get_shape() for n in f.keys() if n.endswith(projections)]
    assert len(shapes) == 4 * tiny.num_hidden_layers
    size = {
        "none": lambda n, k: 2 * n * k,
        "int8": lambda n, k: n * k + 8 * n,
        "int4": lambda n, k: n * k // 2 + 4 * n * -(-k // 64),
    }
    for quant, default in (("int4", "int8"), ("none", "none")):
        base = weight_bytes(tiny, "bfloat16", quant=quant)
        for attention in size:
            got = weight_bytes(tiny, "bfloat16", quant=quant, quant_attention=attention)
            want = sum(size[attention](n, k) - size[default](n, k) for n, k in shapes)
            assert got - base == want, (quant, attention)
            node = DecodeNodeConfig(name="d", quant=quant, quant_attention=attention)
            assert node_resources(tiny, "bfloat16", node).weight_bytes == got
            assert (got != base) == (attention != default)


def test_a_cluster_with_mtp_sizes_the_mtp_layer_and_its_cache(tmp_path):
    """mtp: every node holds the MTP layer (the checkpoint's tensors but its copies
    of the shared embedding and head), the draft head's copy of the head, and a KV pool of one
    more layer."""
    from model.weight_names import mtp_copy_names
    from tinymodel.make import make_tiny_model

    path = make_tiny_model(tmp_path / "m", seed=1, overrides={"num_nextn_predict_layers": 1})
    cfg = ModelConfig.from_model_dir(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = sum(
            math.prod(f.get_slice(n).get_shape()) * 4
            for n in f.keys()
            if n not in mtp_copy_names(cfg)
        )
    assert weight_bytes(cfg, "float32", mtp=True) == stored
    assert weight_bytes(cfg, "float32") < stored
    layers = cfg.num_hidden_layers
    assert kv_pool_bytes(cfg, "float32", 8, 4, mtp=True) * layers == kv_pool_bytes(
        cfg, "float32", 8, 4
    ) * (layers + 1)
    node = DecodeNodeConfig(name="d", mtp=True)
    res = node_resources(cfg, "float32", node, mtp=True)
    # plus the draft head's int4 copy of the head (model.draft_head, the default): half a
    # byte a weight and an fp32 scale per 64 inputs of each row
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    assert res.weight_bytes == stored + vocab * hidden // 2 + 4 * vocab * -(-hidden // 64)
    main_head = DecodeNodeConfig(name="d", mtp=True, mtp_draft_head="none")
    assert node_resources(cfg, "float32", main_head, mtp=True).weight_bytes == stored
    assert res.kv_bytes == kv_pool_bytes(cfg, "float32", node.num_pages, node.page_size, True)

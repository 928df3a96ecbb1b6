"""CPU and memory a node's pod asks Kubernetes for, computed from the model and the node config.

    memory = (weights + KV pool) * MARGIN + processes * RUNTIME_BYTES + shm  (rounded up to MiB)
    cpu    = threads * processes

- weights: every tensor of the checkpoint (`model.weight_names.checkpoint_shapes`, from the
  model's config.json) at the cluster dtype, the router gate and bias in float32 as loaded
  (`model.weight_names.keeps_fp32`), except the matrices the node's `quant` and
  `quant_attention` quantize (`control.quant_schemes.tensor_scheme`, `quantized_bytes`: a byte
  or half a byte per weight plus scales), and the LM head's
  int8 bytes on a `quant_lm_head` node (a tied head is the embedding, counted once as every tied
  head is). An FP8 checkpoint on a quant = "none" node is dequantized at load, so it counts at
  the cluster dtype. A decode
  node of `ranks` R runs R processes, each with the full attention, dense and shared-expert
  weights and its own shard of the routed experts (`model.sharding.expert_shard`); a prefill
  node of `ranks` R (tensor parallel) runs R processes, each with its share of the heads, MLP
  and shared-expert columns (`model.sharding.shard_shape`) and routed experts, and the
  embedding, head, latent projections and norms whole ("tp_sp": its share of the heads' own
  projections, everything else whole).
- KV pool: `num_layers * num_pages * page_size * kv_row_width * dtype bytes` per process (each
  rank of a node allocates its own pool of the node's `num_pages`).
- shm: a tensor-parallel prefill node's shared-memory segment (`shm_bytes`), in a
  memory-backed /dev/shm that counts against the pod's limit.
- Mapped packs (`weights_cache`, `pack`; `deploy.k8s_manifests.WeightsCache`): the weights
  are then page cache of the pack file rather than each process's heap, one copy per host
  however many pods map it, charged to the memory cgroup of the pod that first reads each page
  and reclaimable. They are still counted in full in every pod: an upper bound for each pod
  (whichever is charged must keep the pages resident without evicting its own), not a sum
  to expect per host.
- MARGIN covers the load peak (a matrix's raw and prepacked copies are held together for a
  moment), activations and allocator slack; RUNTIME_BYTES is Python, torch and ZeroMQ of one
  process (about 250 MiB resident measured for a tiny-model node; twice that is asked).

The pod's memory limit equals its request (a node that outgrows it is OOM-killed and restarted,
its requests moved, instead of starving its neighbours); CPU has a request and no limit, since
CFS throttling would stall the kernels' worker threads mid-step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from control.cluster_config import DecodeNodeConfig, PrefillNodeConfig
from control.model_config import ModelConfig
from control.quant_schemes import quantized_bytes, tensor_scheme
from model.sharding import SHM_CAPACITY, check_tensor_parallel, expert_shard, shard_shape
from model.weight_names import checkpoint_shapes, keeps_fp32, mtp_shapes

MIB = 1 << 20
RUNTIME_BYTES = 512 * MIB  # per process: interpreter, torch, ZeroMQ (measured ~250 MiB)
MARGIN = 1.25  # on weights + KV: load peak, activations, allocator slack
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
ROUTER_CPU = 1  # one event loop (tokenizing, SSE)
ROUTER_MEMORY_BYTES = 1024 * MIB  # tokenizer + config.json, no weights (measured ~250 MiB)


@dataclass(frozen=True)
class PodResources:
    cpu: int  # cores requested
    memory_bytes: int  # requested and the limit
    weight_bytes: int = 0
    kv_bytes: int = 0

    def k8s(self) -> dict[str, dict[str, str]]:
        """The container's `resources` field."""
        memory = f"{math.ceil(self.memory_bytes / MIB)}Mi"
        return {"requests": {"cpu": str(self.cpu), "memory": memory}, "limits": {"memory": memory}}


ROUTER_RESOURCES = PodResources(cpu=ROUTER_CPU, memory_bytes=ROUTER_MEMORY_BYTES)


def weight_bytes(
    model: ModelConfig,
    dtype: str,
    experts: range | None = None,
    quant: str = "none",
    mtp: bool = False,
    tensor_parallel: int = 1,
    parallel: str = "tp",
    quant_lm_head: bool = False,
    quant_attention: str | None = None,
    mtp_draft_head: str = "none",
) -> int:
    """Bytes of the weights one process holds; `experts` limits the routed experts (a rank);
    `quant` the node's weight scheme (its quantized matrices take about a byte per weight);
    `mtp`: the MTP layer is loaded too, and with it the draft head's copy of the LM head in
    `mtp_draft_head` (model.draft_head: none when it is "none", or "int8" over an int8 head);
    `tensor_parallel` = R: a tensor-parallel rank's share of the matrices its `parallel`
    scheme splits; `quant_lm_head`: the LM head in int8; `quant_attention`: the attention
    projections' scheme (unset: `quant`'s)."""
    keep = None if experts is None else (lambda e: e in experts)
    size = DTYPE_BYTES[dtype]

    def held(name: str, shape: tuple[int, ...]) -> int:
        if tensor_scheme(name, quant, quant_attention) != "none":
            return quantized_bytes(quant, shape, name, quant_attention)
        if quant_lm_head and name == "lm_head.weight":
            return quantized_bytes("int8", shape)
        return math.prod(shape) * (4 if keeps_fp32(name) else size)

    shapes = checkpoint_shapes(model, keep)
    draft_copy = (
        mtp and mtp_draft_head != "none" and not (mtp_draft_head == "int8" and quant_lm_head)
    )
    if mtp:
        shapes.update(mtp_shapes(model, keep))
    head = (model.vocab_size, model.hidden_size)
    return sum(
        held(name, shard_shape(name, shape, tensor_parallel, parallel))
        for name, shape in shapes.items()
    ) + (quantized_bytes(mtp_draft_head, head) if draft_copy else 0)


def kv_pool_bytes(
    model: ModelConfig, dtype: str, num_pages: int, page_size: int, mtp: bool = False
) -> int:
    """Bytes of one KV pool: [layers, num_pages, page_size, kv_lora_rank + rope_dim]; with
    `mtp` one more layer, the MTP layer's."""
    rows = (model.num_hidden_layers + (1 if mtp else 0)) * num_pages * page_size
    return rows * model.kv_row_width * DTYPE_BYTES[dtype]


def shm_bytes(node: PrefillNodeConfig | DecodeNodeConfig) -> int:
    """/dev/shm a node uses: a tensor-parallel prefill node's segment over the shared-memory
    collectives (`model.tensor_parallel`: two buffers of a slot a rank), plus a MiB of slack;
    0 for every other node."""
    if not isinstance(node, PrefillNodeConfig) or node.ranks == 1 or node.all_reduce != "shm":
        return 0
    return 2 * node.ranks * SHM_CAPACITY * 4 + MIB


def node_resources(
    model: ModelConfig,
    dtype: str,
    node: PrefillNodeConfig | DecodeNodeConfig,
    mtp: bool = False,
) -> PodResources:
    """What the pod of `node` asks for (ConfigError if a node has more ranks than the model
    has routed experts, as the node itself would refuse); `mtp`: the cluster uses MTP
    (`ClusterConfig.uses_mtp`), so every node holds the MTP layer and its cache."""
    ranks = node.ranks
    quant, head, attention = node.quant, node.quant_lm_head, node.quant_attention
    draft = node.mtp_draft_head
    if ranks == 1:
        weights = weight_bytes(
            model,
            dtype,
            quant=quant,
            mtp=mtp,
            quant_lm_head=head,
            quant_attention=attention,
            mtp_draft_head=draft,
        )
    else:
        tp = ranks if isinstance(node, PrefillNodeConfig) else 1
        scheme = node.parallel if tp > 1 else "tp"
        if tp > 1:
            check_tensor_parallel(model, tp, scheme)  # as the node refuses an uneven split
        if scheme == "tp_sp":  # every rank holds every expert
            shards = (None for _ in range(ranks))
        else:
            shards = (expert_shard(model.n_routed_experts, r, ranks) for r in range(ranks))
        weights = sum(
            weight_bytes(model, dtype, shard, quant, mtp, tp, scheme, head, attention, draft)
            for shard in shards
        )
    kv = ranks * kv_pool_bytes(model, dtype, node.num_pages, node.page_size, mtp)
    memory = math.ceil((weights + kv) * MARGIN) + ranks * RUNTIME_BYTES + shm_bytes(node)
    return PodResources(node.threads * ranks, memory, weights, kv)

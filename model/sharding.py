"""Which part of the model a rank holds: routed experts by contiguous range (expert-parallel
decode, tensor-parallel prefill), attention heads and MLP columns by equal slices (tensor
parallel prefill, `model.tensor_parallel`)."""

from __future__ import annotations

from control.errors import ConfigError
from control.model_config import ModelConfig

SHM_CAPACITY = 1 << 20  # floats a rank's slot holds: 2 x 4 MiB a rank (Docker's /dev/shm is 64 MiB)


def expert_shard(num_experts: int, rank: int, world: int) -> range:
    """Rank r owns experts [r*E//R, (r+1)*E//R): contiguous, sizes differ by at most one
    when R does not divide E (uneven shards are fine: the kernel takes any local count)."""
    check_shardable(num_experts, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside [0, {world})")
    return range(rank * num_experts // world, (rank + 1) * num_experts // world)


def check_shardable(num_experts: int, world: int) -> None:
    """ConfigError unless every one of `world` ranks can own at least one routed expert."""
    if world < 1:
        raise ConfigError(f"ranks must be >= 1, got {world}")
    if world > 1 and num_experts < world:
        raise ConfigError(
            f"ranks = {world} exceeds the model's {num_experts} routed experts: "
            "every rank must own at least one"
        )


def even_slice(size: int, rank: int, world: int) -> slice:
    """Rank r's equal part of `size` (which `world` must divide: check_tensor_parallel)."""
    part = size // world
    return slice(rank * part, (rank + 1) * part)


def check_tensor_parallel(cfg: ModelConfig, world: int, scheme: str = "tp") -> None:
    """ConfigError unless what `scheme` splits splits evenly over `world` ranks: for "tp" the
    heads, the MLP's and the shared experts' intermediate sizes, and every rank must own a
    routed expert; for "tp_sp" the heads alone (o_proj and the MLPs run whole, sequence-split).
    An uneven split would give the ranks kernels of different shapes for no gain."""
    if world < 1:
        raise ConfigError(f"ranks must be >= 1, got {world}")
    sizes = {"num_attention_heads": cfg.num_attention_heads}
    if scheme == "tp":
        check_shardable(cfg.n_routed_experts, world)
        if not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            sizes["intermediate_size"] = cfg.intermediate_size
        if cfg.n_shared_experts:
            sizes["moe_intermediate_size * n_shared_experts"] = (
                cfg.moe_intermediate_size * cfg.n_shared_experts
            )
    for name, size in sizes.items():
        if size % world:
            raise ConfigError(
                f"tensor parallelism over {world} ranks needs {name} ({size}) divisible by {world}"
            )


_HEAD_ROWS = ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight")
_HEAD_COLUMNS = ("self_attn.o_proj.weight",)
_MLP_ROWS = ("mlp.gate_proj.weight", "mlp.up_proj.weight",
             "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")  # fmt: skip
_MLP_COLUMNS = ("mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight")


SCHEMES = ("tp", "tp_sp")


def _split_of(name: str, scheme: str = "tp") -> str | None:
    """Which of the split lists `name` falls under (None: held whole, routed experts too).
    "tp" splits heads and MLPs; "tp_sp" (`model.sequence_parallel`) only the heads' own
    projections: o_proj and the MLPs run sequence-split, whole on every rank."""
    if "experts." in name and ".shared_experts." not in name:
        return None  # routed: whole experts, by expert_range
    lists = (
        (*_HEAD_ROWS, *_HEAD_COLUMNS, *_MLP_ROWS, *_MLP_COLUMNS) if scheme == "tp" else _HEAD_ROWS
    )
    split = [s for s in lists if name.endswith(s)]
    return split[0] if split else None


def shard_shape(
    name: str, shape: tuple[int, ...], world: int, scheme: str = "tp"
) -> tuple[int, ...]:
    """The shape a tensor-parallel rank of `world` holds of checkpoint tensor `name`
    (ShardedWeights' split; rows or columns by `world`), for sizing without reading it."""
    split = _split_of(name, scheme)
    if split is None or world == 1:
        return shape
    if split in (*_HEAD_ROWS, *_MLP_ROWS):
        return (shape[0] // world, *shape[1:])
    return (shape[0], shape[1] // world)


class ShardedWeights:
    """A model's weights as tensor-parallel rank `rank` of `world` reads them: each tensor the
    rank splits is sliced as it is read (so one whole tensor is in flight at a time, never the
    model), the rest pass whole.

    Split: attention heads (the rows of q_proj / q_b_proj and kv_b_proj of the rank's heads, the
    columns of o_proj: its output is a partial sum); the intermediate rows of gate/up and the
    columns of down of the dense MLPs and the shared experts (partial sums again). Whole: the
    latent projections (q_a_proj, kv_a_proj and their norms: every rank computes the same KV
    rows), norms, router gates, embedding and head. Routed experts are left to `expert_range`."""

    def __init__(self, weights, cfg: ModelConfig, rank: int, world: int, scheme: str = "tp"):
        check_tensor_parallel(cfg, world, scheme)
        self._weights = weights
        self._cfg = cfg
        self._heads = even_slice(cfg.num_attention_heads, rank, world)
        self._rank, self._world, self._scheme = rank, world, scheme

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    def __getitem__(self, name: str):
        return self._slice(name, self._weights[name])

    def pop(self, name: str):
        return self._slice(name, self._weights.pop(name))

    def _slice(self, name: str, tensor):
        split = _split_of(name, self._scheme)
        if split is None:
            return tensor
        if hasattr(tensor, "qweight"):  # GPTQ (model.gptq): its packed words do not split by
            tensor = tensor.dequantize()  # heads or rows, its fp32 values do
        if not hasattr(tensor, "view"):  # kept FP8 blocks: their scales would not line up
            raise ConfigError(
                f"tensor parallelism cannot split {name} as stored (quant = fp8 keeps the "
                "checkpoint's blocks): use quant = none or int8 on a tensor-parallel node"
            )
        heads = self._cfg.num_attention_heads
        if split in _HEAD_ROWS:  # [H * per_head, in]
            return tensor.view(heads, -1, tensor.shape[1])[self._heads].flatten(0, 1).contiguous()
        if split in _HEAD_COLUMNS:  # [D, H * Dv]
            d = tensor.shape[0]
            return tensor.view(d, heads, -1)[:, self._heads].flatten(1).contiguous()
        if split in _MLP_ROWS:  # [I, D]
            return tensor[even_slice(tensor.shape[0], self._rank, self._world)].contiguous()
        return tensor[:, even_slice(tensor.shape[1], self._rank, self._world)].contiguous()

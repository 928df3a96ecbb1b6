"""Where a model's weights come from, named: what the layers' constructors ask for.

A layer asks its `WeightSource` for each weight by checkpoint name and by how it holds it (`raw`
as read, a `linear` projection in the node's attention scheme (the attention projections and
the MTP layer's eh_proj: `model.quant`, `quant_attention`), a `gated_mlp` in the node's
`quant`, a `dense` one in the model dtype, the LM `head` in its own scheme (the model dtype, or
int8 with `quant_lm_head`), the routed `experts`, the `absorbed` attention of kv_b_proj); the
source returns it ready for the kernels:

- `CheckpointSource` reads the checkpoint (a `CheckpointReader`, a tensor-parallel view of one,
  or a plain dict in tests) and packs each weight with the node's `Quantizer` as it is asked
  for. With a `sink` (a packed weight store being written, `model.weight_pack.PackWriter`) it
  hands every result to the sink under its name and keeps nothing: the model it builds is an
  empty husk and the pack holds the weights.
- `PackSource` returns the same objects rebuilt around a mapped pack's tensors (no copy, no
  quantization), keyed by the same names; an expert-parallel rank's experts are a slice of the
  whole model's (`native.packed_state.select_experts`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from model.heap import release_free_heap
from model.quant import Experts, Linear, Quantizer, as_tensor
from native import ops
from native.packed_state import select_experts

if TYPE_CHECKING:
    from control.model_config import ModelConfig
    from model.weight_pack import MappedPack, PackWriter

# The absorbed attention of kv_b_proj: (kv_b_proj, W_UK prepacked for bmm, W_UV^T prepacked).
Absorbed = tuple[Linear, object, object]


class WeightSource(Protocol):
    def __contains__(self, name: object) -> bool: ...
    def raw(self, name: str) -> torch.Tensor: ...
    def linear(self, *names: str) -> Linear: ...
    def gated_mlp(self, prefix: str) -> tuple[Linear, Linear]: ...
    def dense(self, name: str, tied: bool = False) -> Linear: ...
    def head(self, name: str, tied: bool = False) -> Linear: ...
    def experts(self, prefix: str, expert_range: range) -> Experts: ...
    def absorbed(self, name: str, cfg: ModelConfig, num_heads: int) -> Absorbed: ...


def _expert_name(prefix: str, e: int, projection: str) -> str:
    return f"{prefix}.experts.{e}.{projection}_proj.weight"


class CheckpointSource:
    """Weights read from `weights` (a mapping with `pop`) and packed by `quant`; see the module."""

    def __init__(self, weights, quant: Quantizer, sink: PackWriter | None = None):
        self._weights, self._quant, self._sink = weights, quant, sink

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    def _keep(self, key: str, packed):
        """What the model holds of `packed`: itself, or with a sink (which takes it) None in its
        place (a tuple of Nones for a tuple)."""
        if self._sink is None:
            return packed
        self._sink.add(key, packed)
        return tuple(None for _ in packed) if isinstance(packed, tuple) else None

    def raw(self, name: str) -> torch.Tensor:
        tensor = self._weights[name]
        if self._sink is not None:
            self._sink.add(f"raw:{name}", tensor)
        return tensor  # small (norms, gates) or needed raw by the husk (the embedding)

    def linear(self, *names: str) -> Linear:
        """The projection of `names` stacked by rows, in the quantizer's `attention_scheme`."""
        linear = self._quant.attention(*(self._weights.pop(n) for n in names))
        return self._quant.wrap_attention(
            self._keep(self._quant.attention_key(names), linear.weight)
        )

    def gated_mlp(self, prefix: str) -> tuple[Linear, Linear]:
        gate, up, down = (
            self._weights.pop(f"{prefix}.{p}_proj.weight") for p in ("gate", "up", "down")
        )
        w13, w2 = self._quant.gated_mlp(gate, up, down)
        del gate, up, down
        w13, w2 = self._keep(f"gated_mlp:{prefix}", (w13.weight, w2.weight))
        return self._quant.wrap_linear(w13), self._quant.wrap_linear(w2)

    def dense(self, name: str, tied: bool = False) -> Linear:
        """The model-dtype projection of `name`; `tied`: a tensor the model also holds raw (the
        embedding as the head), read without releasing it."""
        source = self._weights[name] if tied else self._weights.pop(name)
        packed = self._quant.dense(source).weight
        del source
        return self._quant.wrap_dense(self._keep(f"dense:{name}", packed))

    def head(self, name: str, tied: bool = False) -> Linear:
        """The LM head of `name` in the quantizer's `head_scheme`; `tied` as for `dense` (the
        embedding keeps its model-dtype rows for the lookup, the head is a packed copy)."""
        source = self._weights[name] if tied else self._weights.pop(name)
        packed = self._quant.head(source).weight
        del source
        return self._quant.wrap_head(self._keep(self._quant.head_key(name), packed))

    def experts(self, prefix: str, expert_range: range) -> Experts:
        # Per-expert loaders: each expert is read only as it is packed, so loading holds one
        # expert in flight, never a layer's experts (most of the model).
        def load(e: int, *projections: str):
            if self._sink is None:  # a husk holds nothing: its heap is all reused temporaries
                release_free_heap()  # the last matrix's packing temporaries (model.heap)
            return tuple(self._weights.pop(_expert_name(prefix, e, p)) for p in projections)

        w13 = [lambda e=e: load(e, "gate", "up") for e in expert_range]  # E_local x [2I, D]
        w2 = [lambda e=e: load(e, "down")[0] for e in expert_range]  # E_local x [D, I]
        experts = self._quant.experts(w13, w2)
        return self._quant.wrap_experts(self._keep(f"experts:{prefix}", (experts.w13, experts.w2)))

    def absorbed(self, name: str, cfg: ModelConfig, num_heads: int) -> Absorbed:
        # kv_b stays in the model dtype whatever the scheme: it decompresses the latent cache
        # (extend) and is absorbed into q and the output (decode), attention's own precision.
        kv_b = as_tensor(self._weights.pop(name), self._quant.dtype)  # [H * (Dn + Dv), L]
        dense = self._quant.dense(kv_b).weight
        kv_b = kv_b.view(num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk = ops.prepack_bmm(kv_b[:, : cfg.qk_nope_head_dim])  # [H, Dn, L]
        w_uv_t = ops.prepack_bmm(kv_b[:, cfg.qk_nope_head_dim :].transpose(1, 2))  # [H, L, Dv]
        del kv_b
        dense, w_uk, w_uv_t = self._keep(f"absorbed:{name}", (dense, w_uk, w_uv_t))
        return self._quant.wrap_dense(dense), w_uk, w_uv_t


class PackSource:
    """The weights of a mapped pack (`model.weight_pack.MappedPack`), as `CheckpointSource`
    packed them for the same scheme: every object rebuilt around the mapping's tensors."""

    def __init__(self, pack: MappedPack, quant: Quantizer, num_experts: int | None = None):
        """`num_experts`: the routed experts the pack holds per layer, when it holds every one
        (the model's whole pack: an expert-parallel rank takes its `expert_range` out of it)."""
        self._pack, self._quant, self._num_experts = pack, quant, num_experts
        self.taken: set[str] = set()

    def _get(self, key: str):
        self.taken.add(key)
        return self._pack.object(key)

    def __contains__(self, name: object) -> bool:
        return self._pack.has(f"raw:{name}")

    def raw(self, name: str) -> torch.Tensor:
        return self._get(f"raw:{name}")

    def linear(self, *names: str) -> Linear:
        return self._quant.wrap_attention(self._get(self._quant.attention_key(names)))

    def gated_mlp(self, prefix: str) -> tuple[Linear, Linear]:
        w13, w2 = self._get(f"gated_mlp:{prefix}")
        return self._quant.wrap_linear(w13), self._quant.wrap_linear(w2)

    def dense(self, name: str, tied: bool = False) -> Linear:
        return self._quant.wrap_dense(self._get(f"dense:{name}"))

    def head(self, name: str, tied: bool = False) -> Linear:
        return self._quant.wrap_head(self._get(self._quant.head_key(name)))

    def experts(self, prefix: str, expert_range: range) -> Experts:
        packed = self._get(f"experts:{prefix}")
        if self._num_experts is not None and expert_range != range(self._num_experts):
            packed = select_experts(packed, expert_range)
        return self._quant.wrap_experts(packed)

    def absorbed(self, name: str, cfg: ModelConfig, num_heads: int) -> Absorbed:
        dense, w_uk, w_uv_t = self._get(f"absorbed:{name}")
        return self._quant.wrap_dense(dense), w_uk, w_uv_t

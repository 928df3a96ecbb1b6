"""The DeepSeek decoder layer and its parts: MLA attention, the MoE block, the gated MLP.

Attention has two forms over one paged latent cache (rows [c_kv | k_pe] per token and layer):
- extend (prefill chunks): decompress the cached prefix and the new tokens with kv_b_proj into
  per-head K/V, then FlashAttention with the prefix attended fully and the new tokens causally;
- decode: absorb W_UK into the query and W_UV into the output, attend over the latent rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from control.model_config import ModelConfig
from model.batch import ForwardBatch
from model.weight_source import WeightSource
from native import ops

if TYPE_CHECKING:
    pass


class MLP:
    """SiLU-gated MLP (dense layers and shared experts): down(silu(gate(x)) * up(x))."""

    def __init__(self, weights: WeightSource, prefix: str):
        self.w13, self.w2 = weights.gated_mlp(prefix)  # [2I, D] (one GEMM), [D, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.silu_and_mul(self.w13(x)))


RoutedExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class MoE:
    """Routed experts chosen by the grouped top-k gate, plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig, weights: WeightSource, prefix: str, expert_range: range):
        self.cfg = cfg
        # [E, D]; routing runs in fp32 from a gate kept bf16 when stored so (fp32 holds it exactly)
        gate = weights.raw(f"{prefix}.gate.weight")
        self.gate = gate if gate.dtype in (torch.bfloat16, torch.float32) else gate.float()
        bias = f"{prefix}.gate.e_score_correction_bias"
        self.correction_bias = weights.raw(bias).float() if bias in weights else None
        self.expert_offset = expert_range.start
        # The shared experts first: packing their fused gate|up is the layer's largest
        # transient, better held beside the layers before than beside this layer's experts too.
        self.shared = MLP(weights, f"{prefix}.shared_experts") if cfg.n_shared_experts else None
        self.experts = weights.experts(prefix, expert_range)
        # Expert parallelism replaces this with a dispatch/combine around the local experts;
        # `routed_adds_shared` then says its hook adds the shared experts itself (computed
        # while the dispatch is in flight).
        self.routed_experts: RoutedExperts = self.local_experts
        self.routed_adds_shared = False

    def local_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return self.experts(x, weights, ids, self.expert_offset)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, K] fp32, expert ids [T, K] int32)."""
        cfg = self.cfg
        logits = ops.router_logits(x, self.gate)  # [T, E] fp32
        return ops.grouped_topk(
            logits,
            self.correction_bias,
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
            cfg.scoring_func,
            cfg.topk_method,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.routed_experts(x, weights, ids)
        if self.shared is not None and not self.routed_adds_shared:
            out = out + self.shared(x)
        return out


class MLA:
    """Multi-head latent attention with a paged cache of [c_kv | k_pe] rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: WeightSource,
        prefix: str,
        cos_sin: torch.Tensor,
        num_heads: int | None = None,
    ):
        """`num_heads`: the heads this rank holds (tensor parallelism: `weights` then holds
        their rows only, `model.sharding.ShardedWeights`); default all of them."""
        self.cfg = cfg
        self.cos_sin = cos_sin
        self.num_heads = num_heads or cfg.num_attention_heads
        name = f"{prefix}.{{}}.weight".format
        if cfg.q_lora_rank is None:
            self.q_proj = weights.linear(name("q_proj"))
        else:
            self.q_a_proj = weights.linear(name("q_a_proj"))
            self.q_a_norm = weights.raw(name("q_a_layernorm"))
            self.q_b_proj = weights.linear(name("q_b_proj"))
        self.kv_a_proj = weights.linear(name("kv_a_proj_with_mqa"))  # [L + R, D]
        self.kv_a_norm = weights.raw(name("kv_a_layernorm"))
        # kv_b_proj [H * (Dn + Dv), L] in the model dtype, W_UK [H, Dn, L] and W_UV^T [H, L, Dv]
        self.kv_b_proj, self.w_uk, self.w_uv_t = weights.absorbed(
            name("kv_b_proj"), cfg, self.num_heads
        )
        self.o_proj = weights.linear(name("o_proj"))  # [D, H * Dv]

    def __call__(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """x: [T, D] -> [T, D]; kv_cache: this layer's [num_pages, page_size, L + R]."""
        out = self.attend(*self.latent(x), batch, kv_cache)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.cfg.v_head_dim))

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token down-projections, before any head: q's input [T, q_lora] (normed;
        x itself without q_lora) and kv_a [T, L + R] (the sequence-split scheme all-gathers
        these, `model.sequence_parallel`)."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q_in = x
        else:
            q_in = ops.rms_norm(self.q_a_proj(x), self.q_a_norm, cfg.rms_norm_eps)
        return q_in, self.kv_a_proj(x)

    def attend(self, q_in, kv_a, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """This rank's heads over the latents of every new token: [T, H, Dv] before o_proj;
        the new rows [c_kv | k_pe] go into the cache."""
        cfg, num_tokens, h = self.cfg, q_in.shape[0], self.num_heads
        q = self.q_proj(q_in) if cfg.q_lora_rank is None else self.q_b_proj(q_in)
        q = q.view(num_tokens, h, cfg.qk_head_dim)
        if batch.is_decode:
            # W_UK absorbed into q and W_UV into the output: attention over the latent rows.
            return ops.mla_decode_absorbed(
                q,
                kv_a,
                self.kv_a_norm,
                cfg.rms_norm_eps,
                batch.positions,
                self.cos_sin,
                self.w_uk,
                self.w_uv_t,
                kv_cache,
                batch.page_table,
                batch.seq_lens,
                cfg.softmax_scale,
            )
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c_kv = ops.rms_norm(kv_a[:, : cfg.kv_lora_rank], self.kv_a_norm, cfg.rms_norm_eps)
        q_pe, k_pe = ops.apply_rope(
            q_pe.contiguous(),
            kv_a[:, cfg.kv_lora_rank :].contiguous(),
            batch.positions,
            self.cos_sin,
        )
        rows = torch.cat((c_kv, k_pe), dim=-1)  # [T, L + R], what the cache keeps
        return self._extend(q_nope, q_pe, rows, batch, kv_cache)

    def _decompress(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [N, L + R] -> per-head K [N, H, Dn + R] and V [N, H, Dv]."""
        cfg, n = self.cfg, rows.shape[0]
        kv = self.kv_b_proj(rows[:, : cfg.kv_lora_rank])
        kv = kv.view(n, self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_pe = rows[:, None, cfg.kv_lora_rank :].expand(n, self.num_heads, cfg.qk_rope_head_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v.contiguous()

    def _extend(self, q_nope, q_pe, rows, batch, kv_cache) -> torch.Tensor:
        ops.store_kv_rows(kv_cache, batch.slots, rows)
        prefix_rows = ops.gather_kv_rows(kv_cache, batch.prefix_slots).to(rows.dtype)
        k, v = self._decompress(rows)
        k_prefix, v_prefix = self._decompress(prefix_rows)
        q = torch.cat((q_nope, q_pe), dim=-1).contiguous()  # [T, H, Dn + R]
        return ops.extend_attention(
            q, k, v, k_prefix, v_prefix, batch.new_lens, batch.prefix_lens, self.cfg.softmax_scale
        )  # [T, H, Dv]


class DecoderLayer:
    def __init__(
        self,
        cfg,
        weights: WeightSource,
        idx: int,
        cos_sin: torch.Tensor,
        expert_range: range,
        num_heads: int | None = None,
    ):
        prefix = f"model.layers.{idx}"
        self.eps = cfg.rms_norm_eps
        self.input_norm = weights.raw(f"{prefix}.input_layernorm.weight")
        self.post_attention_norm = weights.raw(f"{prefix}.post_attention_layernorm.weight")
        self.attn = MLA(cfg, weights, f"{prefix}.self_attn", cos_sin, num_heads)
        if cfg.is_moe_layer(idx):
            self.mlp: MLP | MoE = MoE(cfg, weights, f"{prefix}.mlp", expert_range)
        else:
            self.mlp = MLP(weights, f"{prefix}.mlp")

    def __call__(self, h, residual, batch, kv_cache):
        """Pre-norm block; the residual add is fused into the next norm."""
        if residual is None:
            residual, x = h, ops.rms_norm(h, self.input_norm, self.eps)
        else:
            x, residual = ops.fused_add_rms_norm(h, residual, self.input_norm, self.eps)
        h = self.attn(x, batch, kv_cache)
        x, residual = ops.fused_add_rms_norm(h, residual, self.post_attention_norm, self.eps)
        return self.mlp(x), residual

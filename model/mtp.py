"""DeepSeek-V3's multi-token prediction (MTP) layer, used as the draft model of speculative
decoding.

At position i it combines the main model's hidden state h_i (before the final norm) with the
embedding of the token after it, t_{i+1}, and predicts t_{i+2}:

    x_i = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])      (embedding first, as SGLang / vLLM)
    y_i = DecoderLayer(x_i)  at rope position i, causal over the MTP positions <= i
    logits_i = lm_head(shared_head.norm(y_i))

The decoder layer has its own latent KV cache: the pool's layer `num_hidden_layers`, after the
main ones, so the KV of a prompt moves from the prefill node to the decode node like any other
layer's. The embedding and the head are the main model's (V3 stores copies; they are equal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from control.model_config import ModelConfig
from model.batch import ForwardBatch
from model.weight_names import mtp_prefix
from native import ops

if TYPE_CHECKING:
    from model.layers import DecoderLayer
    from model.weight_source import WeightSource


class MTPLayer:
    def __init__(self, cfg: ModelConfig, weights: WeightSource, decoder_layer: DecoderLayer):
        prefix = mtp_prefix(cfg)
        self.eps = cfg.rms_norm_eps
        self.enorm = weights.raw(f"{prefix}.enorm.weight")
        self.hnorm = weights.raw(f"{prefix}.hnorm.weight")
        self.eh_proj = weights.linear(f"{prefix}.eh_proj.weight")  # [D, 2D]
        self.layer = decoder_layer
        self.head_norm = weights.raw(f"{prefix}.shared_head.norm.weight")

    def hidden(
        self,
        embedded: torch.Tensor,
        main_hidden: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """embedded [T, D] (the embeddings of t_{i+1}), main_hidden [T, D] (h_i, before the
        main model's final norm), `batch` at the positions i -> the layer's output [T, D]
        before the head's norm (what a chained draft feeds back as its h).

        `keep` [N]: the rows whose output is wanted (a request's last, which drafts); the
        others only write their KV rows, so they stop after attention: the MoE (most of the
        layer's cost) runs on N rows instead of T. Returns [N, D] then."""
        e = ops.rms_norm(embedded, self.enorm, self.eps)
        h = ops.rms_norm(main_hidden.to(embedded.dtype), self.hnorm, self.eps)
        x = self.eh_proj(torch.cat((e, h), dim=-1))
        if keep is None:
            y, residual = self.layer(x, None, batch, kv_cache)
            return y + residual
        layer = self.layer
        attn = layer.attn(ops.rms_norm(x, layer.input_norm, layer.eps), batch, kv_cache)
        x, residual = ops.fused_add_rms_norm(
            attn[keep], x[keep], layer.post_attention_norm, layer.eps
        )
        return layer.mlp(x) + residual

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output [N, D] -> what the shared head multiplies."""
        return ops.rms_norm(hidden.contiguous(), self.head_norm, self.eps)

"""The sequence-split tensor-parallel prefill (`parallel = "tp_sp"`): the seeds'
2P1D prefill scheme, as a forward of `model.deepseek.DeepseekModel` loaded with
`parallel = "tp_sp"` (each rank holds its heads' q / kv_b projections; o_proj, the MLPs and
every expert whole).

A batch of T new tokens is cut into R contiguous pieces of P = ceil(T / R) tokens (the last
padded with dummy tokens whose rows are dropped). Rank r, per layer:
1. norms its piece and runs the down-projections on it: q's latent (x itself without q_lora)
   and kv_a, [P, W];
2. all-gathers them: [T, W] on every rank, so every rank writes the same KV rows at the same
   slots (its own pool, as "tp");
3. runs attention for its heads over all T tokens (rope at the batch's positions): [T, H/R, Dv];
4. all-to-all: the attention output of rank s's tokens goes to rank s, which gets every head
   of its own piece: [P, H * Dv];
5. o_proj, the residual and the MLP (or MoE) on its piece, whole weights.
After the last layer the rows whose logits are asked (each sequence's last token, prompt
logprob rows) are normed where they live and summed over the ranks (every other rank adds
zeros: exact), so every rank runs the head on the same rows.

What a rank sends per layer is the all-gather of [P, W] bf16 and the all-to-all of its
[T, H/R * Dv] less its own piece (`model.tensor_parallel.traffic_per_layer`, "tp_sp"):
about a fifth of "tp"'s two fp32 all-reduces of [T, D] on the bench shapes. The price: every
rank holds the whole MLPs and experts, and runs the dense down-projections on its piece only.
Prefill (extend) batches only: a decode step of a few tokens has nothing to split.
"""

from __future__ import annotations

import torch

from model.batch import ForwardBatch
from model.kv_pool import KVPool
from native import ops


class SequenceParallel:
    """The sequence-split forward of rank `rank` of `world`, over `comm` (a GlooComm or
    ShmComm of `model.tensor_parallel`: all_gather, all_to_all, and the fp32 sum)."""

    def __init__(self, comm, rank: int, world: int):
        self.comm, self.rank, self.world = comm, rank, world

    def forward(self, model, batch: ForwardBatch, pool: KVPool, keep_hidden: bool):
        if batch.is_decode or keep_hidden:
            raise ValueError(
                "the sequence-split scheme runs prefill batches only (no decode step, no MTP)"
            )
        cfg, world = model.cfg, self.world
        num_tokens = batch.input_ids.shape[0]
        piece = -(-num_tokens // world)
        start = self.rank * piece
        ids = torch.zeros(piece * world, dtype=batch.input_ids.dtype)
        ids[:num_tokens] = batch.input_ids  # dummy token 0 past the end: its rows are dropped
        h = model.embed_tokens.index_select(0, ids[start : start + piece])  # [P, D]
        residual = None
        for idx, layer in enumerate(model.layers):
            if residual is None:
                residual, x = h, ops.rms_norm(h, layer.input_norm, layer.eps)
            else:
                x, residual = ops.fused_add_rms_norm(h, residual, layer.input_norm, layer.eps)
            h = self._attention(layer.attn, x, batch, pool.layer(idx), num_tokens, piece)
            x, residual = ops.fused_add_rms_norm(h, residual, layer.post_attention_norm, layer.eps)
            h = layer.mlp(x)
        rows = model.logit_rows(batch)
        mine = (rows >= start) & (rows < start + piece)
        x = torch.zeros(rows.shape[0], cfg.hidden_size, dtype=h.dtype)
        if mine.any():
            local = rows[mine] - start
            x[mine], _ = ops.fused_add_rms_norm(
                h[local], residual[local], model.norm, cfg.rms_norm_eps
            )
        x = self.comm(x)  # each row from its rank, zeros from the others
        return model.lm_head(x).float(), None

    def _attention(self, attn, x, batch, kv_cache, num_tokens: int, piece: int) -> torch.Tensor:
        """Steps 1-4 above: this rank's piece [P, D] in, o_proj's output for it [P, D] out."""
        world = self.world
        q_in, kv_a = attn.latent(x)
        widths = [q_in.shape[1], kv_a.shape[1]]
        gathered = self.comm.all_gather(torch.cat((q_in, kv_a), dim=-1))  # [R, P, W]
        full = gathered.reshape(world * piece, -1)[:num_tokens]
        q_full, kv_full = (t.contiguous() for t in full.split(widths, dim=-1))
        heads = attn.attend(q_full, kv_full, batch, kv_cache)  # [T, H/R, Dv]
        width = heads.shape[1] * heads.shape[2]
        out = torch.zeros(world * piece, width, dtype=heads.dtype)
        out[:num_tokens] = heads.reshape(num_tokens, width)
        exchanged = self.comm.all_to_all(out.view(world, piece, width))  # [R (heads), P, w]
        return attn.o_proj(exchanged.permute(1, 0, 2).reshape(piece, world * width))


def install_sequence_parallel(model, comm) -> None:
    """Makes `model` (loaded with parallel = "tp_sp") run its forwards sequence-split."""
    if model.tensor_parallel is None or model.parallel != "tp_sp":
        raise ValueError('the model was not loaded as a parallel = "tp_sp" shard')
    rank, world = model.tensor_parallel
    model.sequence_parallel = SequenceParallel(comm, rank, world)

"""DeepSeek-V2/V3: MLA attention + MoE, reading like the papers, on the ops of `native.ops`.

Attention has two forms over one paged latent cache (rows [c_kv | k_pe] per token and layer):
- extend (prefill chunks): decompress the cached prefix and the new tokens with kv_b_proj into
  per-head K/V, then FlashAttention with the prefix attended fully and the new tokens causally;
- decode: absorb W_UK into the query and W_UV into the output, attend over the latent rows.
Parallelism is a transform of this model (see `MoE.routed_experts`), not a branch inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.batch import ForwardBatch
from engine.checkpoint_reader import CheckpointReader
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.heap import release_free_heap
from engine.kv_pool import KVPool
from engine.mtp import MTPLayer
from engine.quant import quantizer
from engine.rope import rope_cos_sin
from engine.sharding import ShardedWeights, expert_shard
from engine.weight_names import checkpoint_shapes, mtp_shapes
from engine.weight_pack import PackError
from engine.weight_source import CheckpointSource, PackSource, WeightSource
from native import ops

if TYPE_CHECKING:
    from engine.weight_pack import MappedPack, PackWriter


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
        self.gate = weights.raw(f"{prefix}.gate.weight").float()  # [E, D], routing runs in fp32
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
        logits = torch.nn.functional.linear(x.float(), self.gate)  # [T, E]
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
        their rows only, `engine.sharding.ShardedWeights`); default all of them."""
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
        these, `engine.sequence_parallel`)."""
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
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c_kv = ops.rms_norm(kv_a[:, : cfg.kv_lora_rank], self.kv_a_norm, cfg.rms_norm_eps)
        q_pe, k_pe = ops.apply_rope(
            q_pe.contiguous(),
            kv_a[:, cfg.kv_lora_rank :].contiguous(),
            batch.positions,
            self.cos_sin,
        )
        rows = torch.cat((c_kv, k_pe), dim=-1)  # [T, L + R], what the cache keeps
        if batch.is_decode:
            return self._decode(q_nope, q_pe, rows, batch, kv_cache)
        return self._extend(q_nope, q_pe, rows, batch, kv_cache)

    def _decode(self, q_nope, q_pe, rows, batch, kv_cache) -> torch.Tensor:
        cfg = self.cfg
        q_latent = ops.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, H, L]
        q_full = torch.cat((q_latent, q_pe), dim=-1).contiguous()  # [B, H, L + R]
        o_latent = ops.mla_decode(
            q_full,
            kv_cache,
            batch.page_table,
            batch.seq_lens,
            cfg.softmax_scale,
            cfg.kv_lora_rank,
            new_rows=rows.to(kv_cache.dtype),
        )  # [B, H, L]
        return ops.bmm(o_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [B, H, Dv]

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


class DeepseekModel:
    """The whole network. `forward` returns fp32 logits of each sequence's last new token.

    The constructor consumes `weights` (pops each tensor as its layer packs it), so the raw and
    the packed copy of a matrix are never both held for the whole model; from a
    CheckpointReader (`from_pretrained`) each tensor is read only as it is packed, so loading
    holds the model as held plus one tensor in flight. `quant` ("none", "int8", "fp8"; None =
    "none") is the scheme of the projections and experts (`engine.quant`). With `mtp`, the
    checkpoint's MTP layer is loaded too (`engine.mtp`, the draft of speculative decoding) and
    the KV pool has one more layer, its cache. With `tensor_parallel` = (rank, world) the model
    holds rank `rank`'s shard (`engine.sharding`: its heads, MLP columns and experts), whose
    attention and MLP outputs are partial sums: `engine.tensor_parallel` all-reduces them;
    with `parallel = "tp_sp"` its heads only (o_proj, MLPs and experts whole), and the forward
    runs sequence-split (`engine.sequence_parallel`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights,
        dtype: torch.dtype,
        expert_range=None,
        quant: str | None = None,
        mtp: bool = False,
        tensor_parallel: tuple[int, int] | None = None,
        parallel: str = "tp",
        sink: PackWriter | None = None,
    ):
        self.cfg = cfg
        self.tensor_parallel = tensor_parallel
        self.parallel = parallel
        # The sequence-split forward (`engine.sequence_parallel.install_sequence_parallel`).
        self.sequence_parallel = None
        num_heads = None
        q = quantizer(quant, dtype)
        if tensor_parallel is not None:
            rank, world = tensor_parallel
            if not isinstance(weights, PackSource):  # a pack holds the shard as it was cut
                weights = ShardedWeights(weights, cfg, rank, world, parallel)
            num_heads = cfg.num_attention_heads // world
            if parallel == "tp":
                expert_range = expert_range or expert_shard(cfg.n_routed_experts, rank, world)
        if not isinstance(weights, PackSource):
            weights = CheckpointSource(weights, q, sink)
        self.quant = q.name
        # Where it was loaded from (`from_pretrained`): structured output loads the tokenizer
        # there. None for a model built from weights in memory.
        self.model_dir: Path | None = None
        self.dtype = dtype
        # Where the weights live (`engine.quant_schemes.WEIGHT_BACKINGS`), and in words: what NodeReady
        # reports. A mapped pack's loader says which mapping it got.
        self.weights_backing = "heap"
        self.weights_detail = "read from the checkpoint into the heap"
        # Called after each layer of a forward, on the forward's thread: a node keeps its
        # heartbeat going through a forward that outlasts the router's node timeout (a
        # full-depth prefill chunk on one core takes seconds).
        self.between_layers: Callable[[], None] | None = None
        self.expert_range = expert_range or range(cfg.n_routed_experts)
        self.cos_sin = rope_cos_sin(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
        self.embed_tokens = weights.raw("model.embed_tokens.weight")
        # The head (the largest matrix) first: its raw and packed copies are held together
        # while little else is loaded, not on top of the whole model.
        if cfg.tie_word_embeddings:
            self.lm_head = weights.dense("model.embed_tokens.weight", tied=True)
        else:
            self.lm_head = weights.dense("lm_head.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            self.layers.append(
                DecoderLayer(cfg, weights, i, self.cos_sin, self.expert_range, num_heads)
            )
            release_free_heap()  # the layer's packing temporaries (engine.heap)
        self.norm = weights.raw("model.norm.weight")
        self.mtp: MTPLayer | None = None
        if mtp:
            check_has_mtp(cfg)
            n = cfg.num_hidden_layers
            layer = DecoderLayer(cfg, weights, n, self.cos_sin, self.expert_range, num_heads)
            self.mtp = MTPLayer(cfg, weights, layer)
            release_free_heap()
        # The KV pool's layers: the main ones, then the MTP layer's when loaded.
        self.num_kv_layers = cfg.num_hidden_layers + (1 if self.mtp is not None else 0)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.bfloat16,
        expert_range: range | None = None,
        progress: bool = True,
        quant: str | None = None,
        mtp: bool = False,
        tensor_parallel: tuple[int, int] | None = None,
        parallel: str = "tp",
    ) -> DeepseekModel:
        """Loads config.json and the safetensors, each tensor read as the model packs it;
        `expert_range` limits the routed experts held (an expert-parallel rank loads only its
        shard); `quant` is the weights' scheme (`engine.quant`: "none", "int8", "fp8");
        `tensor_parallel` = (rank, world): a tensor-parallel rank's shard of the `parallel`
        scheme ("tp" or "tp_sp", see the class). `engine.pack_cache.load_model` loads through a
        packed weight store instead."""
        args = (dtype, expert_range, progress, quant, mtp, tensor_parallel, parallel)
        with cls.open_checkpoint(model_dir, *args) as (cfg, weights, expert_range):
            model = cls(cfg, weights, dtype, expert_range, quant, mtp, tensor_parallel, parallel)
        model.model_dir = Path(model_dir)
        return model

    @classmethod
    @contextmanager
    def open_checkpoint(cls, model_dir, dtype, expert_range, progress, quant, mtp,
                        tensor_parallel, parallel):  # fmt: skip
        """(config, CheckpointReader of the tensors these arguments read, the experts held);
        on leaving, checks that the model built from it read every one."""
        cfg = ModelConfig.from_model_dir(model_dir)
        if tensor_parallel is not None and expert_range is None and parallel == "tp":
            # Which experts to read; the split itself is checked by ShardedWeights, before any
            # tensor is read.
            rank, world = tensor_parallel
            expert_range = expert_shard(cfg.n_routed_experts, rank, world)
        keep = None if expert_range is None else (lambda e: e in expert_range)
        shapes = checkpoint_shapes(cfg, keep)
        if mtp:
            check_has_mtp(cfg)
            shapes.update(mtp_shapes(cfg, keep))
        block = cfg.quant.weight_block_size if cfg.quant else None
        keep_fp8 = quantizer(quant, dtype).keeps_fp8
        with CheckpointReader(model_dir, shapes, dtype, block, keep_fp8, progress) as weights:
            yield cfg, weights, expert_range
            unread = weights.unread()
        if unread:  # checkpoint_shapes and the model disagree: a bug, not the user's input
            raise RuntimeError(f"the model did not read {len(unread)} tensors: {unread[:3]}")

    @classmethod
    def from_pack(cls, cfg: ModelConfig, pack: MappedPack, dtype: torch.dtype,
                  expert_range: range | None,
                  quant: str | None, mtp: bool, tensor_parallel: tuple[int, int] | None,
                  parallel: str) -> DeepseekModel:  # fmt: skip
        """The model around a mapped pack's weights (`engine.weight_pack`), which must be of
        these arguments (`engine.pack_cache.load_model` checks its spec)."""
        whole = pack.spec.expert_range is None and pack.spec.tensor_parallel is None
        source = PackSource(pack, quantizer(quant, dtype), cfg.n_routed_experts if whole else None)
        model = cls(cfg, source, dtype, expert_range, quant, mtp, tensor_parallel, parallel)
        if unused := set(pack.keys()) - source.taken:
            raise PackError(f"pack {pack.path}: holds {len(unused)} weights the model did not take")
        model.pack = pack  # the mapping lives as long as the model
        return model

    def new_kv_pool(self, num_pages: int, page_size: int, device="cpu") -> KVPool:
        cfg = self.cfg
        return KVPool(
            self.num_kv_layers, num_pages, page_size, cfg.kv_row_width, self.dtype, device
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Runs the batch, writing its new KV rows into `pool`. Returns [B, vocab] fp32: each
        sequence's last new token; then [N] more rows for `batch.extra_logit_index` if set."""
        return self._forward(batch, pool, keep_hidden=False)[0]

    @torch.inference_mode()
    def forward_with_hidden(
        self, batch: ForwardBatch, pool: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits and the hidden states [T, D] of every new token before the final
        norm (what the MTP layer reads)."""
        logits, hidden = self._forward(batch, pool, keep_hidden=True)
        return logits, hidden

    def _forward(self, batch: ForwardBatch, pool: KVPool, keep_hidden: bool):
        if self.sequence_parallel is not None:
            return self.sequence_parallel.forward(self, batch, pool, keep_hidden)
        h = self.embed_tokens.index_select(0, batch.input_ids)  # [T, D]
        residual = None
        for idx, layer in enumerate(self.layers):
            h, residual = layer(h, residual, batch, pool.layer(idx))
            if self.between_layers is not None:
                self.between_layers()
        rows = self.logit_rows(batch)
        x, _ = ops.fused_add_rms_norm(h[rows], residual[rows], self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(x).float(), (h + residual if keep_hidden else None)

    @torch.inference_mode()
    def forward_mtp(
        self,
        batch: ForwardBatch,
        main_hidden: torch.Tensor,
        pool: KVPool,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over `batch`, whose input_ids are the tokens t_{i+1} after the
        positions i it runs at, and `main_hidden` [T, D] the main model's h_i (or, for a
        chained draft, this layer's own output). Writes its KV into the pool's last layer.
        Returns the logits (rows as `forward`'s: each sequence's last token, then
        `extra_logit_index`; or, with `logit_rows`, those packed rows only: a draft needs
        one request's last) and the output hidden states: [T, D], or with `logit_rows` of a
        decode-path batch those rows' only (the other rows stop after writing their KV)."""
        if self.mtp is None:
            raise RuntimeError("the model was loaded without its MTP layer (mtp=True)")
        embedded = self.embed_tokens.index_select(0, batch.input_ids)
        kv_cache = pool.layer(self.cfg.num_hidden_layers)
        if logit_rows is not None and batch.is_decode:
            hidden = self.mtp.hidden(embedded, main_hidden, batch, kv_cache, keep=logit_rows)
            return self.lm_head(self.mtp.head_input(hidden)).float(), hidden
        hidden = self.mtp.hidden(embedded, main_hidden, batch, kv_cache)
        rows = self.logit_rows(batch) if logit_rows is None else logit_rows
        x = self.mtp.head_input(hidden[rows])
        return self.lm_head(x).float(), hidden

    @staticmethod
    def logit_rows(batch: ForwardBatch) -> torch.Tensor:
        """The packed rows whose logits `forward` returns: each sequence's last new token,
        then `extra_logit_index`."""
        last = batch.last_token_index
        if batch.extra_logit_index is not None:
            last = torch.cat([last, batch.extra_logit_index])
        return last


def check_has_mtp(cfg: ModelConfig) -> None:
    """ConfigError unless the checkpoint has an MTP layer (num_nextn_predict_layers >= 1)."""
    if cfg.num_nextn_predict_layers < 1:
        raise ConfigError(
            "MTP needs a checkpoint with an MTP layer (num_nextn_predict_layers >= 1); "
            "this one has none"
        )

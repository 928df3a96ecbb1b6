"""DeepSeek-V2/V3: MLA attention + MoE, reading like the papers, on the ops of `native.ops`.

The whole network: embedding, the decoder layers (`model.layers`), the final norm and the LM
head, built from a weight source (a checkpoint or a packed weight store).
Parallelism is a transform of this model (see `MoE.routed_experts`), not a branch inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from control.errors import ConfigError
from control.model_config import ModelConfig
from control.quant_schemes import DEFAULT_DRAFT_HEAD
from model.batch import ForwardBatch
from model.checkpoint_reader import CheckpointReader
from model.draft_head import draft_head
from model.heap import release_free_heap
from model.kv_pool import KVPool
from model.layers import DecoderLayer
from model.mtp import MTPLayer
from model.quant import Linear, quantizer
from model.rope import rope_cos_sin
from model.sharding import ShardedWeights, expert_shard
from model.weight_names import checkpoint_shapes, mtp_shapes
from model.weight_pack import PackError
from model.weight_source import CheckpointSource, PackSource
from native import ops

if TYPE_CHECKING:
    from model.weight_pack import MappedPack, PackWriter


class DeepseekModel:
    """The whole network. `forward` returns fp32 logits of each sequence's last new token.

    The constructor consumes `weights` (pops each tensor as its layer packs it), so the raw and
    the packed copy of a matrix are never both held for the whole model; from a
    CheckpointReader (`from_pretrained`) each tensor is read only as it is packed, so loading
    holds the model as held plus one tensor in flight. `quant` ("none", "int8", "fp8", "int4"; None =
    "none") is the scheme of the MLPs and experts (`model.quant`), `quant_attention` the attention
    projections' (None: `quant`'s, "int8" under "int4"); `quant_lm_head` runs the LM head (the
    MTP layer's too: it is the same head) in int8 whatever `quant` is. With
    `mtp`, the checkpoint's MTP layer is loaded too (`model.mtp`, the draft of speculative
    decoding) and the KV pool has one more layer, its cache. With `tensor_parallel` = (rank, world) the model
    holds rank `rank`'s shard (`model.sharding`: its heads, MLP columns and experts), whose
    attention and MLP outputs are partial sums: `model.tensor_parallel` all-reduces them;
    with `parallel = "tp_sp"` its heads only (o_proj, MLPs and experts whole), and the forward
    runs sequence-split (`model.sequence_parallel`)."""

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
        quant_lm_head: bool = False,
        quant_attention: str | None = None,
    ):
        self.cfg = cfg
        self.tensor_parallel = tensor_parallel
        self.parallel = parallel
        # The sequence-split forward (`model.sequence_parallel.install_sequence_parallel`).
        self.sequence_parallel = None
        num_heads = None
        q = quantizer(quant, dtype, quant_lm_head, quant_attention)
        if tensor_parallel is not None:
            rank, world = tensor_parallel
            if not isinstance(weights, PackSource):  # a pack holds the shard as it was cut
                weights = ShardedWeights(weights, cfg, rank, world, parallel)
            num_heads = cfg.num_attention_heads // world
            if parallel == "tp":
                expert_range = expert_range or expert_shard(cfg.n_routed_experts, rank, world)
        if not isinstance(weights, PackSource):
            weights = CheckpointSource(weights, q, sink)
        self.quant = q.name  # the MLPs' and experts' scheme
        self.attention_quant = q.attention_scheme  # the attention projections' scheme
        self.lm_head_quant = q.head_scheme  # the LM head's scheme: "none" | "int8"
        # Where it was loaded from (`from_pretrained`): structured output loads the tokenizer
        # there. None for a model built from weights in memory.
        self.model_dir: Path | None = None
        self.dtype = dtype
        # Where the weights live (`control.quant_schemes.WEIGHT_BACKINGS`), and in words: what NodeReady
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
        # while little else is loaded, not on top of the whole model. A tied head follows
        # `quant_lm_head` too: the embedding keeps its model-dtype rows for the lookup and the
        # head is a packed copy of them (int8 or not), as an untied head is its own matrix.
        if cfg.tie_word_embeddings:
            self.lm_head = weights.head("model.embed_tokens.weight", tied=True)
        else:
            self.lm_head = weights.head("lm_head.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            self.layers.append(
                DecoderLayer(cfg, weights, i, self.cos_sin, self.expert_range, num_heads)
            )
            release_free_heap()  # the layer's packing temporaries (model.heap)
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
        # The head drafts run through (`model.draft_head`; None: `lm_head`; a pack being written
        # holds no head, so it gets none).
        self.draft_head_scheme: str | None = None
        self.draft_lm_head: Linear | None = None
        if self.mtp is not None and sink is None:
            self.set_draft_head(DEFAULT_DRAFT_HEAD)

    def set_draft_head(self, scheme: str) -> None:
        """The MTP layer's drafts run through the LM head in `scheme` (`model.draft_head`:
        "none" the main head, "int8" / "int4" a copy); nothing changes when it already does."""
        if self.mtp is None:
            raise RuntimeError("the model was loaded without its MTP layer (mtp=True)")
        if scheme != self.draft_head_scheme:
            self.draft_lm_head = None  # the old copy goes before the new one is made
            head = draft_head(self.lm_head, scheme)
            # None: the main head itself, whatever `lm_head` is when the draft runs
            self.draft_lm_head = None if head is self.lm_head else head
            self.draft_head_scheme = scheme

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
        quant_lm_head: bool = False,
        quant_attention: str | None = None,
    ) -> DeepseekModel:
        """Loads config.json and the safetensors, each tensor read as the model packs it;
        `expert_range` limits the routed experts held (an expert-parallel rank loads only its
        shard); `quant` is the weights' scheme (`model.quant`: "none", "int8", "fp8", "int4"),
        `quant_attention` the attention projections' (the same names; None: `quant`'s, "int8"
        under "int4"), `quant_lm_head` the LM head's (int8 when true);
        `tensor_parallel` = (rank, world): a tensor-parallel rank's shard of the `parallel`
        scheme ("tp" or "tp_sp", see the class). `model.pack_cache.load_model` loads through a
        packed weight store instead."""
        args = (dtype, expert_range, progress, quant, mtp, tensor_parallel, parallel)
        with cls.open_checkpoint(model_dir, *args, quant_attention) as (cfg, weights, expert_range):
            model = cls(
                cfg,
                weights,
                dtype,
                expert_range,
                quant,
                mtp,
                tensor_parallel,
                parallel,
                quant_lm_head=quant_lm_head,
                quant_attention=quant_attention,
            )
        model.model_dir = Path(model_dir)
        return model

    @classmethod
    @contextmanager
    def open_checkpoint(
        cls,
        model_dir,
        dtype,
        expert_range,
        progress,
        quant,
        mtp,
        tensor_parallel,
        parallel,
        quant_attention=None,
    ):
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
        # GPTQ or compressed-tensors: both int4 forms the reader hands over as `GptqWeight`s
        int4 = cfg.quant if cfg.quant and cfg.quant.fmt == "int4" else None
        keep_stored = quantizer(quant, dtype, quant_attention=quant_attention).keeps_stored
        with CheckpointReader(
            model_dir, shapes, dtype, block, keep_stored, progress, int4
        ) as weights:
            yield cfg, weights, expert_range
            unread = weights.unread()
        if unread:  # checkpoint_shapes and the model disagree: a bug, not the user's input
            raise RuntimeError(f"the model did not read {len(unread)} tensors: {unread[:3]}")

    @classmethod
    def from_pack(
        cls,
        cfg: ModelConfig,
        pack: MappedPack,
        dtype: torch.dtype,
        expert_range: range | None,
        quant: str | None,
        mtp: bool,
        tensor_parallel: tuple[int, int] | None,
        parallel: str,
        quant_lm_head: bool = False,
        quant_attention: str | None = None,
    ) -> DeepseekModel:
        """The model around a mapped pack's weights (`model.weight_pack`), which must be of
        these arguments (`model.pack_cache.load_model` checks its spec)."""
        whole = pack.spec.expert_range is None and pack.spec.tensor_parallel is None
        q = quantizer(quant, dtype, quant_lm_head, quant_attention)
        source = PackSource(pack, q, cfg.n_routed_experts if whole else None)
        model = cls(
            cfg,
            source,
            dtype,
            expert_range,
            quant,
            mtp,
            tensor_parallel,
            parallel,
            quant_lm_head=quant_lm_head,
            quant_attention=quant_attention,
        )
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
        Returns the logits of the draft head (`set_draft_head`; rows as `forward`'s: each
        sequence's last token, then `extra_logit_index`; or, with `logit_rows`, those packed
        rows only: a draft needs one request's last) and the output hidden states: [T, D], or with `logit_rows` of a
        decode-path batch those rows' only (the other rows stop after writing their KV)."""
        if self.mtp is None:
            raise RuntimeError("the model was loaded without its MTP layer (mtp=True)")
        embedded = self.embed_tokens.index_select(0, batch.input_ids)
        kv_cache = pool.layer(self.cfg.num_hidden_layers)
        head = self.draft_lm_head or self.lm_head
        if logit_rows is not None and batch.is_decode:
            hidden = self.mtp.hidden(embedded, main_hidden, batch, kv_cache, keep=logit_rows)
            return head(self.mtp.head_input(hidden)).float(), hidden
        hidden = self.mtp.hidden(embedded, main_hidden, batch, kv_cache)
        rows = self.logit_rows(batch) if logit_rows is None else logit_rows
        x = self.mtp.head_input(hidden[rows])
        return head(x).float(), hidden

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

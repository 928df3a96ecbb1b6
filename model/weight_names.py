"""The tensors of a Hugging Face DeepSeek-V2/V3 checkpoint: names and shapes, from the config.

The model, the loader and the tiny-model writer all take their list from here, so a name is
spelled in one place.
"""

from __future__ import annotations

from collections.abc import Callable

from control.model_config import ModelConfig

Shape = tuple[int, ...]


def attention_shapes(cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
    h, d = cfg.num_attention_heads, cfg.hidden_size
    shapes: dict[str, Shape] = {}
    if cfg.q_lora_rank is None:
        shapes[f"{prefix}.q_proj.weight"] = (h * cfg.qk_head_dim, d)
    else:
        shapes[f"{prefix}.q_a_proj.weight"] = (cfg.q_lora_rank, d)
        shapes[f"{prefix}.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes[f"{prefix}.q_b_proj.weight"] = (h * cfg.qk_head_dim, cfg.q_lora_rank)
    shapes[f"{prefix}.kv_a_proj_with_mqa.weight"] = (cfg.kv_row_width, d)
    shapes[f"{prefix}.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    shapes[f"{prefix}.kv_b_proj.weight"] = (
        h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
        cfg.kv_lora_rank,
    )
    shapes[f"{prefix}.o_proj.weight"] = (d, h * cfg.v_head_dim)
    return shapes


def mlp_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, Shape]:
    return {
        f"{prefix}.gate_proj.weight": (intermediate, hidden),
        f"{prefix}.up_proj.weight": (intermediate, hidden),
        f"{prefix}.down_proj.weight": (hidden, intermediate),
    }


def layer_shapes(
    cfg: ModelConfig, layer_idx: int, keep_expert: Callable[[int], bool] | None = None
) -> dict[str, Shape]:
    """Tensors of one decoder layer; `keep_expert(e)` limits the routed experts listed (EP)."""
    prefix = f"model.layers.{layer_idx}"
    d = cfg.hidden_size
    shapes = {
        f"{prefix}.input_layernorm.weight": (d,),
        f"{prefix}.post_attention_layernorm.weight": (d,),
    }
    shapes.update(attention_shapes(cfg, f"{prefix}.self_attn"))
    if not cfg.is_moe_layer(layer_idx):
        shapes.update(mlp_shapes(f"{prefix}.mlp", d, cfg.intermediate_size))
        return shapes
    shapes[f"{prefix}.mlp.gate.weight"] = (cfg.n_routed_experts, d)
    if cfg.uses_correction_bias:
        shapes[f"{prefix}.mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
    for e in range(cfg.n_routed_experts):
        if keep_expert is None or keep_expert(e):
            shapes.update(mlp_shapes(f"{prefix}.mlp.experts.{e}", d, cfg.moe_intermediate_size))
    if cfg.n_shared_experts:
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        shapes.update(mlp_shapes(f"{prefix}.mlp.shared_experts", d, shared))
    return shapes


def checkpoint_shapes(
    cfg: ModelConfig, keep_expert: Callable[[int], bool] | None = None
) -> dict[str, Shape]:
    """Every tensor the model needs, in checkpoint order (embeddings, layers, norm, head)."""
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        shapes.update(layer_shapes(cfg, i, keep_expert))
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def mtp_prefix(cfg: ModelConfig) -> str:
    """DeepSeek-V3 numbers its MTP layer after the main ones: model.layers.{num_hidden_layers}."""
    return f"model.layers.{cfg.num_hidden_layers}"


def mtp_shapes(
    cfg: ModelConfig, keep_expert: Callable[[int], bool] | None = None
) -> dict[str, Shape]:
    """The MTP layer's own tensors (DeepSeek-V3 layout; the first MTP layer, the one the engine
    loads: V3 has exactly one): the two input norms, the projection of [embedding | hidden]
    back to the hidden size, one decoder layer and the head's norm. Not the copies of the
    embedding and the head the checkpoint also stores (`mtp_copy_names`): the layer shares the
    main model's."""
    prefix, d = mtp_prefix(cfg), cfg.hidden_size
    shapes: dict[str, Shape] = {
        f"{prefix}.enorm.weight": (d,),
        f"{prefix}.hnorm.weight": (d,),
        f"{prefix}.eh_proj.weight": (d, 2 * d),
    }
    shapes.update(layer_shapes(cfg, cfg.num_hidden_layers, keep_expert))
    shapes[f"{prefix}.shared_head.norm.weight"] = (d,)
    return shapes


def mtp_copy_names(cfg: ModelConfig) -> dict[str, str]:
    """The MTP layer's copies of shared tensors: copy name -> the main tensor it equals."""
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    prefix = mtp_prefix(cfg)
    return {
        f"{prefix}.embed_tokens.weight": "model.embed_tokens.weight",
        f"{prefix}.shared_head.head.weight": head,
    }


def is_norm_or_bias(name: str) -> bool:
    """Tensors kept in full precision and never quantized (norm weights, router bias, gate)."""
    return (
        name.endswith("layernorm.weight") or name.endswith("norm.weight") or (".mlp.gate." in name)
    )


def keeps_fp32(name: str) -> bool:
    """Router tensors stay float32 whatever the model dtype: routing is computed in fp32."""
    return name.endswith(".mlp.gate.weight") or name.endswith(".e_score_correction_bias")

"""Model configuration: the fields of a Hugging Face DeepSeek-V2/V3 `config.json`.

Both key styles are accepted: the original DeepSeek one (`rope_theta` + `rope_scaling` with
`type: yarn`) and the newer transformers one (`rope_parameters` with `rope_type`). Everything is
validated here, once, so the model code can trust the values.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from control.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `kind` is "default" or "yarn"."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
        if scale <= 1.0:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    @property
    def attention_factor(self) -> float:
        """Multiplier of cos/sin (YaRN); 1.0 for the default rope."""
        if self.kind != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.factor, self.mscale) / self.yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return self.yarn_mscale(self.factor)

    @property
    def softmax_scale_multiplier(self) -> float:
        """Extra factor on the attention softmax scale (DeepSeek's mscale_all_dim squared)."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        m = self.yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m


@dataclass(frozen=True)
class QuantConfig:
    """Checkpoint weight quantization: FP8 e4m3 with blocks (DeepSeek-V3), GPTQ 4-bit
    (`model.gptq`: its group size, and whether its zeros are stored minus one, the "gptq" v1
    format, or as they are, "gptq_v2"), or compressed-tensors' symmetric packed int4
    (`model.compressed_tensors`: its group size)."""

    method: str  # "fp8" | "gptq" | "compressed-tensors"
    fmt: str  # "e4m3" | "int4"
    weight_block_size: tuple[int, int] | None = None  # fp8
    group_size: int = 0  # gptq
    zeros_minus_one: bool = True  # gptq


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    quant: QuantConfig | None = None
    # MTP: DeepSeek-V3's next-token-prediction layers after the main ones (0 or 1).
    num_nextn_predict_layers: int = 0

    # ---- derived values -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_width(self) -> int:
        """Width of one cached latent row: [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_scale_multiplier

    @property
    def uses_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    def fingerprint(self) -> dict[str, Any]:
        """The fields two nodes must agree on to exchange KV rows."""
        return {
            "model_type": self.model_type,
            "num_hidden_layers": self.num_hidden_layers,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }

    # ---- parsing --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return _parse(raw)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot parse config.json ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: config.json must hold a JSON object")
        try:
            return _parse(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


def _require(raw: dict[str, Any], key: str, kind: type) -> Any:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"missing required field '{key}'")
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"field '{key}' must be {kind.__name__}, got {value!r}")
    return value


def _optional(raw: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    if raw.get(key) is None:
        return default
    return _require(raw, key, kind)


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # Newer transformers style: everything under rope_parameters (rope_theta included).
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError("field 'rope_parameters' must be an object")
        theta = params.get("rope_theta", raw.get("rope_theta"))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = params if kind != "default" else None
    else:
        theta = raw.get("rope_theta", 10000.0)
        if scaling is not None and not isinstance(scaling, dict):
            raise ConfigError("field 'rope_scaling' must be an object or null")
        kind = (scaling or {}).get("type", (scaling or {}).get("rope_type", "default"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"rope theta must be a positive number, got {theta!r}")
    if kind == "default" or scaling is None:
        return RopeConfig(theta=float(theta))
    if kind != "yarn":
        raise ConfigError(f"unsupported rope scaling type '{kind}' (supported: yarn)")
    factor = float(_require(scaling, "factor", float))
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("yarn rope scaling needs 'original_max_position_embeddings'")
    return RopeConfig(
        theta=float(theta),
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=int(original),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=float(scaling.get("mscale") or 1.0),
        mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
    )


def _parse_quant(raw: dict[str, Any]) -> QuantConfig | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError("field 'quantization_config' must be an object")
    method = q.get("quant_method")
    if method == "gptq":
        return _parse_gptq(q)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q)
    if method != "fp8":
        raise ConfigError(
            f"unsupported quantization method {method!r} (supported: fp8, gptq, compressed-tensors)"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"unsupported fp8 format {fmt!r} (supported: e4m3)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        raise ConfigError("fp8 quantization needs 'weight_block_size' as [rows, cols]")
    return QuantConfig(method="fp8", fmt="e4m3", weight_block_size=(block[0], block[1]))


def _parse_compressed_tensors(q: dict[str, Any]) -> QuantConfig:
    """compressed-tensors' weight-only int4 ("pack-quantized"): every config group symmetric,
    group-wise, of one group size (the only form `model.compressed_tensors` reads)."""
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("compressed-tensors quantization needs 'config_groups'")
    sizes = set()
    for key, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise ConfigError(f"compressed-tensors config group {key!r} has no 'weights'")
        fmt = group.get("format") or q.get("format")
        w = group["weights"]
        if fmt != "pack-quantized" or w.get("num_bits") != 4 or w.get("type", "int") != "int":
            raise ConfigError(
                f"unsupported compressed-tensors group {key!r}: format {fmt!r}, "
                f"{w.get('num_bits')!r}-bit {w.get('type')!r} (supported: pack-quantized 4-bit int)"
            )
        if group.get("input_activations") is not None:
            raise ConfigError(
                f"compressed-tensors group {key!r} quantizes activations (supported: weight-only)"
            )
        if w.get("symmetric") is not True or w.get("strategy") != "group":
            raise ConfigError(
                f"unsupported compressed-tensors group {key!r}: symmetric={w.get('symmetric')!r}, "
                f"strategy {w.get('strategy')!r} (supported: symmetric, group)"
            )
        size = w.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ConfigError(f"compressed-tensors group {key!r} needs a positive 'group_size'")
        sizes.add(size)
    if len(sizes) != 1:
        raise ConfigError(f"compressed-tensors groups of several group sizes {sorted(sizes)}")
    return QuantConfig(method="compressed-tensors", fmt="int4", group_size=sizes.pop())


def _parse_gptq(q: dict[str, Any]) -> QuantConfig:
    bits, group = q.get("bits"), q.get("group_size")
    if bits != 4:
        raise ConfigError(f"unsupported gptq bits {bits!r} (supported: 4)")
    if not isinstance(group, int) or group <= 0:
        # group_size -1 (one group per column) has no per-group scales to map
        raise ConfigError(f"gptq quantization needs a positive 'group_size', got {group!r}")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"unsupported gptq checkpoint_format {fmt!r} (supported: gptq, gptq_v2)")
    return QuantConfig(method="gptq", fmt="int4", group_size=group, zeros_minus_one=fmt == "gptq")


def _parse_eos(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        return tuple(eos)
    raise ConfigError(f"field 'eos_token_id' must be an int or a list of ints, got {eos!r}")


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    is_v3 = model_type == "deepseek_v3"
    n_routed = _require(raw, "n_routed_experts", int)
    topk_method = _optional(raw, "topk_method", str, "noaux_tc" if is_v3 else "greedy")
    scoring = _optional(raw, "scoring_func", str, "sigmoid" if is_v3 else "softmax")
    if topk_method not in TOPK_METHODS:
        raise ConfigError(f"unsupported topk_method {topk_method!r} (supported: {TOPK_METHODS})")
    if scoring not in SCORING_FUNCS:
        raise ConfigError(f"unsupported scoring_func {scoring!r} (supported: {SCORING_FUNCS})")
    n_group = _optional(raw, "n_group", int, 1)
    topk_group = _optional(raw, "topk_group", int, 1)
    top_k = _require(raw, "num_experts_per_tok", int)
    q_lora_rank = raw.get("q_lora_rank")
    if q_lora_rank is not None and (not isinstance(q_lora_rank, int) or q_lora_rank <= 0):
        raise ConfigError(
            f"field 'q_lora_rank' must be null or a positive int, got {q_lora_rank!r}"
        )

    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=_require(raw, "vocab_size", int),
        hidden_size=_require(raw, "hidden_size", int),
        intermediate_size=_require(raw, "intermediate_size", int),
        moe_intermediate_size=_require(raw, "moe_intermediate_size", int),
        num_hidden_layers=_require(raw, "num_hidden_layers", int),
        num_attention_heads=_require(raw, "num_attention_heads", int),
        q_lora_rank=q_lora_rank,
        kv_lora_rank=_require(raw, "kv_lora_rank", int),
        qk_nope_head_dim=_require(raw, "qk_nope_head_dim", int),
        qk_rope_head_dim=_require(raw, "qk_rope_head_dim", int),
        v_head_dim=_require(raw, "v_head_dim", int),
        n_routed_experts=n_routed,
        n_shared_experts=_optional(raw, "n_shared_experts", int, 0),
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        topk_method=topk_method,
        scoring_func=scoring,
        norm_topk_prob=bool(_optional(raw, "norm_topk_prob", bool, False)),
        routed_scaling_factor=float(_optional(raw, "routed_scaling_factor", float, 1.0)),
        first_k_dense_replace=_optional(raw, "first_k_dense_replace", int, 0),
        moe_layer_freq=_optional(raw, "moe_layer_freq", int, 1),
        rms_norm_eps=float(_optional(raw, "rms_norm_eps", float, 1e-6)),
        max_position_embeddings=_require(raw, "max_position_embeddings", int),
        rope=_parse_rope(raw),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=_parse_eos(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        quant=_parse_quant(raw),
        num_nextn_predict_layers=_optional(raw, "num_nextn_predict_layers", int, 0),
    )
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    positive = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
        "kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim max_position_embeddings "
        "moe_layer_freq n_group topk_group"
    ).split()
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"field '{name}' must be positive, got {getattr(cfg, name)}")
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError("field 'qk_rope_head_dim' must be even")
    if cfg.n_routed_experts < 0 or cfg.n_shared_experts < 0:
        raise ConfigError("expert counts must not be negative")
    if cfg.n_routed_experts:
        if cfg.moe_intermediate_size <= 0:
            raise ConfigError("field 'moe_intermediate_size' must be positive")
        if not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise ConfigError("'num_experts_per_tok' must be in [1, n_routed_experts]")
        if cfg.n_routed_experts % cfg.n_group:
            raise ConfigError("'n_routed_experts' must be divisible by 'n_group'")
        if cfg.topk_group > cfg.n_group:
            raise ConfigError("'topk_group' must not exceed 'n_group'")
        if cfg.topk_method == "noaux_tc" and cfg.n_routed_experts // cfg.n_group < 2:
            raise ConfigError("noaux_tc routing needs at least 2 experts per group")
        per_group = cfg.n_routed_experts // cfg.n_group
        if cfg.num_experts_per_tok > per_group * cfg.topk_group:
            raise ConfigError("'num_experts_per_tok' exceeds the experts of the selected groups")
    if cfg.num_nextn_predict_layers < 0:
        raise ConfigError("field 'num_nextn_predict_layers' must not be negative")
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers:
        raise ConfigError("'first_k_dense_replace' must be in [0, num_hidden_layers]")

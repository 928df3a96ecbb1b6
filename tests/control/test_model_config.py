"""Config parsing: both key styles, derived values, and one-line errors for bad configs."""

import json

import pytest

from control.errors import ConfigError
from control.model_config import ModelConfig

BASE = {
    "model_type": "deepseek_v3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 512,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "eos_token_id": 1,
}


def test_deepseek_style_yarn():
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40
    assert cfg.kv_row_width == 40 and cfg.qk_head_dim == 24
    # V3: mscale == mscale_all_dim, so cos/sin are unscaled and the softmax scale grows.
    assert cfg.rope.attention_factor == pytest.approx(1.0)
    m = 0.1 * 1.0 * __import__("math").log(40) + 1.0
    assert cfg.softmax_scale == pytest.approx(24**-0.5 * m * m)
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    assert cfg.eos_token_id == (1,)


def test_transformers_style_rope_parameters_equal_deepseek_style():
    new_style = {k: v for k, v in BASE.items() if k not in ("rope_theta", "rope_scaling")}
    new_style["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000,
        **{k: v for k, v in BASE["rope_scaling"].items() if k != "type"},
    }
    assert ModelConfig.from_dict(new_style).rope == ModelConfig.from_dict(BASE).rope


def test_v2_lite_defaults():
    raw = dict(BASE, model_type="deepseek_v2", q_lora_rank=None, rope_scaling=None)
    for key in ("topk_method", "scoring_func", "n_group", "topk_group"):
        raw.pop(key)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.q_lora_rank is None and cfg.topk_method == "greedy"
    assert cfg.scoring_func == "softmax" and cfg.rope.kind == "default"


def test_fp8_quantization_config():
    raw = dict(
        BASE,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    )
    assert ModelConfig.from_dict(raw).quant.weight_block_size == (128, 128)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "unsupported model_type"),
        ({"kv_lora_rank": None}, "missing required field 'kv_lora_rank'"),
        ({"hidden_size": "64"}, "field 'hidden_size' must be int"),
        ({"topk_method": "bogus"}, "unsupported topk_method"),
        ({"n_group": 3}, "divisible by 'n_group'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2}}, "unsupported rope scaling"),
        ({"quantization_config": {"quant_method": "awq"}}, "unsupported quantization"),
    ],
)
def test_bad_configs_raise_one_line_errors(change, message):
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_dict({**BASE, **change})
    assert "\n" not in str(err.value)


def test_from_model_dir_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="gpt2")))
    with pytest.raises(ConfigError, match=str(tmp_path)):
        ModelConfig.from_model_dir(tmp_path)

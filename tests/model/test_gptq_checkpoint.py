"""GPTQ 4-bit checkpoints (model.gptq): the config, the reader's unpacking against weights the test
computes from its own quantization grid, a symmetric checkpoint kept bit for bit by quant =
"int4" (at the checkpoint's group size) and checked against the plain-torch twins, and the
forms the int4 kernels cannot take as stored (zero points) quantized again from their values."""

import json

import pytest
import torch
from quant_checkpoints import gptq_checkpoint
from test_quant_int4 import _every_position

from control.errors import ConfigError, WeightLoadError
from control.model_config import ModelConfig
from model.checkpoint_reader import SINGLE_FILE
from model.deepseek import DeepseekModel
from model.gptq import unpack_int32_nibbles
from model.safetensors_reader import SafetensorsFile
from model.weights import save_checkpoint
from native import ops
from native._int4_ops import PackedLinearInt4
from native._quant_ops import PackedLinearInt8
from tinymodel.make import make_tiny_model

GROUP = 16  # divides every K of the tiny model (48 for q_b_proj)
IDS = list(range(3, 60, 3))
needs_native = pytest.mark.skipif(not ops.native_available(), reason="packing needs the kernels")


def _load(model_dir, quant=None) -> DeepseekModel:
    return DeepseekModel.from_pretrained(model_dir, torch.bfloat16, progress=False, quant=quant)


def _logits(model: DeepseekModel) -> torch.Tensor:
    return _every_position(model, IDS)


def _float_twin(tmp_path, meant: dict[str, torch.Tensor]):
    """The tiny model with the weights the GPTQ checkpoint stands for, in fp32."""
    model_dir = make_tiny_model(tmp_path / "meant")
    with SafetensorsFile(model_dir / SINGLE_FILE) as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert meant.keys() <= tensors.keys()
    tensors.update(meant)
    save_checkpoint(model_dir, tensors)
    return model_dir


@pytest.fixture(scope="module")
def sym(tmp_path_factory):
    return gptq_checkpoint(tmp_path_factory.mktemp("gptq-sym"), GROUP, sym=True)


def test_unpacking_words_by_hand():
    words = torch.tensor([[0x76543210, -0x1]], dtype=torch.int32)  # -1: every nibble 15
    assert unpack_int32_nibbles(words, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7] + [15] * 8]
    column = torch.tensor([[0x000000F1], [0x2]], dtype=torch.int32)
    assert (
        unpack_int32_nibbles(column, 0)[:, 0].tolist() == [1, 15, 0, 0, 0, 0, 0, 0] + [2] + [0] * 7
    )


@pytest.mark.parametrize("sym_grid", [True, False])
@pytest.mark.parametrize("v1", [True, False], ids=["gptq", "gptq_v2"])
def test_dequantized_load_is_the_meant_model(tmp_path, sym_grid, v1):
    """quant = none reads every GPTQ linear as (q - z) * scale: the model equals the float model
    of those values, bit for bit, in both zero formats, symmetric or not."""
    model_dir, meant = gptq_checkpoint(tmp_path / "gptq", GROUP, sym=sym_grid, zeros_minus_one=v1)
    cfg = ModelConfig.from_model_dir(model_dir)
    assert (cfg.quant.method, cfg.quant.group_size, cfg.quant.zeros_minus_one) == ("gptq", 16, v1)
    assert torch.equal(_logits(_load(model_dir)), _logits(_load(_float_twin(tmp_path, meant))))


@needs_native
def test_int4_keeps_a_symmetric_checkpoint_as_stored(sym):
    model_dir, meant = sym
    model = _load(model_dir, "int4")
    dense = model.layers[0].mlp
    assert isinstance(dense.w13.weight, PackedLinearInt4) and dense.w13.weight.group_size == GROUP
    # The kept values are the checkpoint's grid: (q - 8) * scale, gate then up.
    prefix = "model.layers.0.mlp."
    want = torch.cat([meant[prefix + "gate_proj.weight"], meant[prefix + "up_proj.weight"]])
    from native.reference_int4 import dequantize_int4

    assert torch.equal(dequantize_int4(dense.w13.weight.unpack()), want)
    experts = model.layers[1].mlp.experts.w13
    assert experts.group_size == GROUP
    expert3 = torch.cat(
        [meant[f"model.layers.1.mlp.experts.3.{p}.weight"] for p in ("gate_proj", "up_proj")]
    )
    assert torch.equal(dequantize_int4(experts.unpack())[3], expert3)


@needs_native
def test_int4_attention_keeps_a_symmetric_checkpoints_attention_as_stored(sym):
    """With quant_attention = "int4" the attention projections are the checkpoint's grid as
    well, at its group size (the default, int8 attention, quantizes them again)."""
    from native.reference_int4 import dequantize_int4

    model_dir, meant = sym
    model = DeepseekModel.from_pretrained(
        model_dir, torch.bfloat16, progress=False, quant="int4", quant_attention="int4"
    )
    names = {"q_a_proj": "q_a_proj", "q_b_proj": "q_b_proj", "kv_a_proj": "kv_a_proj_with_mqa"}
    for attr, name in {**names, "o_proj": "o_proj"}.items():
        weight = getattr(model.layers[1].attn, attr).weight
        assert isinstance(weight, PackedLinearInt4) and weight.group_size == GROUP
        want = meant[f"model.layers.1.self_attn.{name}.weight"]
        assert torch.equal(dequantize_int4(weight.unpack()), want), attr
    default = _load(model_dir, "int4").layers[1].attn.o_proj.weight
    assert isinstance(default, PackedLinearInt8)


@needs_native
def test_int4_on_the_kernels_against_the_plain_torch_twins(sym):
    """The int4 model of the symmetric checkpoint on the C++ kernels vs with the kernels off
    (plain-torch twins on the same kept values): logits within 3% of their scale, as in
    tests/model/test_quant_int4.py; and both near the float model of the meant values (the
    activations' int8 rounding and the int8 attention apart: relative error under 0.1)."""
    model_dir, _ = sym
    native = _logits(_load(model_dir, "int4"))
    ops.set_native_enabled(False)
    try:
        plain = _logits(_load(model_dir, "int4"))
    finally:
        ops.set_native_enabled(True)
    scale = plain.abs().max().item()
    assert (native - plain).abs().max().item() <= 0.03 * scale
    meant_model = _logits(_load(model_dir))
    rel = ((native - meant_model).norm(dim=-1) / meant_model.norm(dim=-1)).median().item()
    assert 0 < rel < 0.1, rel


@needs_native
def test_zero_points_are_quantized_again(tmp_path):
    """An asymmetric checkpoint has no exact int4 form here (zero points): quant = int4 quantizes
    its values again at the default group size; int8 and fp8 dequantize it as any scheme does."""
    model_dir, _ = gptq_checkpoint(tmp_path / "asym", GROUP, sym=False)
    from control.quant_schemes import INT4_GROUP_SIZE

    model = _load(model_dir, "int4")
    assert model.layers[0].mlp.w13.weight.group_size == INT4_GROUP_SIZE
    want = _logits(_load(model_dir))
    for quant in ("int4", "int8", "fp8"):
        got = _logits(_load(model_dir, quant))
        rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).median().item()
        assert 0 < rel < 0.3, (quant, rel)


def test_bad_gptq_configs_and_tensors(sym, tmp_path):
    model_dir, _ = sym
    config = json.loads((model_dir / "config.json").read_text())
    for change, match in [
        ({"bits": 8}, "gptq bits 8"),
        ({"group_size": -1}, "positive 'group_size'"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ]:
        bad = dict(config, quantization_config={**config["quantization_config"], **change})
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_model_dir(tmp_path)
    # A linear whose zeros are missing is named in one line.
    with SafetensorsFile(model_dir / SINGLE_FILE) as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(config))
    del tensors["model.layers.1.self_attn.o_proj.qzeros"]
    save_checkpoint(broken, tensors)
    with pytest.raises(WeightLoadError, match=r"o_proj.weight' is missing \(and so is its GPTQ"):
        _load(broken)

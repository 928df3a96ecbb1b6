"""compressed-tensors "pack-quantized" int4 checkpoints (model.compressed_tensors): the config and
its refusals, the dequantized load against weights the test computes from its own grid, quant =
"int4" keeping the checkpoint bit for bit, and the same int4 model as the GPTQ checkpoint of the
same grid."""

import json

import pytest
import torch
from quant_checkpoints import compressed_tensors_checkpoint, gptq_checkpoint
from test_gptq_checkpoint import GROUP, _float_twin, _load, _logits

from control.errors import ConfigError, WeightLoadError
from control.model_config import ModelConfig
from model.checkpoint_reader import SINGLE_FILE
from model.safetensors_reader import SafetensorsFile
from model.weights import save_checkpoint
from native import ops
from native._int4_ops import PackedLinearInt4

needs_native = pytest.mark.skipif(not ops.native_available(), reason="packing needs the kernels")


@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    return compressed_tensors_checkpoint(tmp_path_factory.mktemp("ct"), GROUP)


def test_config_is_read(ct):
    cfg = ModelConfig.from_model_dir(ct[0])
    assert (cfg.quant.method, cfg.quant.fmt, cfg.quant.group_size) == (
        "compressed-tensors",
        "int4",
        GROUP,
    )


def test_dequantized_load_is_the_meant_model(ct, tmp_path):
    """quant = none reads every linear as (q - 8) * scale: the model equals the float model of
    those values, bit for bit."""
    model_dir, meant = ct
    assert torch.equal(_logits(_load(model_dir)), _logits(_load(_float_twin(tmp_path, meant))))


@needs_native
def test_int4_keeps_the_checkpoint_as_stored_and_as_gptq_would(ct, tmp_path):
    from native.reference_int4 import dequantize_int4

    model_dir, meant = ct
    model = _load(model_dir, "int4")
    dense = model.layers[0].mlp
    assert isinstance(dense.w13.weight, PackedLinearInt4) and dense.w13.weight.group_size == GROUP
    prefix = "model.layers.0.mlp."
    want = torch.cat([meant[prefix + "gate_proj.weight"], meant[prefix + "up_proj.weight"]])
    assert torch.equal(dequantize_int4(dense.w13.weight.unpack()), want)
    experts = model.layers[1].mlp.experts.w13
    expert3 = torch.cat(
        [meant[f"model.layers.1.mlp.experts.3.{p}.weight"] for p in ("gate_proj", "up_proj")]
    )
    assert experts.group_size == GROUP
    assert torch.equal(dequantize_int4(experts.unpack())[3], expert3)
    # The GPTQ checkpoint of the same grid packs to the same bytes.
    gptq_dir, _ = gptq_checkpoint(tmp_path / "gptq", GROUP, sym=True)
    gptq = _load(gptq_dir, "int4")
    assert torch.equal(gptq.layers[0].mlp.w13.weight.packed, dense.w13.weight.packed)
    assert torch.equal(gptq.layers[1].mlp.experts.w2.packed, model.layers[1].mlp.experts.w2.packed)
    assert torch.equal(_logits(gptq), _logits(model))


def _with_group(config: dict, **weights) -> dict:
    q = json.loads(json.dumps(config["quantization_config"]))
    q["config_groups"]["group_0"]["weights"].update(weights)
    return dict(config, quantization_config=q)


def test_bad_configs_and_tensors(ct, tmp_path):
    model_dir, _ = ct
    config = json.loads((model_dir / "config.json").read_text())
    q = config["quantization_config"]
    second = {"group_1": dict(q["config_groups"]["group_0"], weights={
        **q["config_groups"]["group_0"]["weights"], "group_size": 2 * GROUP})}  # fmt: skip
    for bad, match in [
        (_with_group(config, symmetric=False), "symmetric=False"),
        (_with_group(config, strategy="channel"), "strategy 'channel'"),
        (_with_group(config, num_bits=8), "8-bit"),
        (_with_group(config, group_size=0), "positive 'group_size'"),
        (dict(config, quantization_config={**q, "format": "float-quantized"}), "float-quantized"),
        (dict(config, quantization_config={**q, "config_groups": {}}), "config_groups"),
        (
            dict(
                config, quantization_config={**q, "config_groups": {**q["config_groups"], **second}}
            ),
            "several group sizes",
        ),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_model_dir(tmp_path)
    activations = json.loads(json.dumps(config))
    activations["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8
    }
    (tmp_path / "config.json").write_text(json.dumps(activations))
    with pytest.raises(ConfigError, match="weight-only"):
        ModelConfig.from_model_dir(tmp_path)
    # A weight whose stored shape disagrees, and one whose scales are missing, in one line each.
    with SafetensorsFile(model_dir / SINGLE_FILE) as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name, change, match in [
        ("model.layers.1.self_attn.o_proj.weight_shape", torch.tensor([1, 2]), "weight_shape"),
        ("model.layers.1.self_attn.o_proj.weight_scale", None, "compressed-tensors '"),
    ]:
        broken = tmp_path / name.rsplit(".", 1)[1]
        broken.mkdir()
        (broken / "config.json").write_text(json.dumps(config))
        changed = dict(tensors)
        if change is None:
            del changed[name]
        else:
            changed[name] = change
        save_checkpoint(broken, changed)
        with pytest.raises(WeightLoadError, match=match):
            _load(broken)

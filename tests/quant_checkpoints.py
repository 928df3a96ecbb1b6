"""Checkpoints for the quantization suites (imported as `quant_checkpoints`)."""

import json
from pathlib import Path

import torch

from model.checkpoint_reader import SCALE_SUFFIX, SINGLE_FILE
from model.fp8_blocks import quantize_fp8_blockwise
from model.safetensors_reader import SafetensorsFile
from model.weights import save_checkpoint
from tinymodel.make import make_tiny_model


def fp8_checkpoint_with_blocks(out_dir: Path, block: tuple[int, int]) -> Path:
    """The tiny model as an FP8 checkpoint with `block`-sized scale blocks (DeepSeek's are
    128x128): every layer matrix the tiny FP8 variant stores in FP8, quantized from fp32."""
    model_dir = make_tiny_model(out_dir, fp8=True)  # its config and which tensors are FP8
    with SafetensorsFile(model_dir / SINGLE_FILE) as f:
        fp8_names = [n for n in f.keys() if f.dtype_of(n) == "F8_E4M3"]
    plain = make_tiny_model(out_dir / "fp32")  # the same seed: the same weights in fp32
    with SafetensorsFile(plain / SINGLE_FILE) as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name in fp8_names:
        tensors[name], tensors[name + SCALE_SUFFIX] = quantize_fp8_blockwise(tensors[name], block)
    save_checkpoint(model_dir, tensors)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = list(block)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


# Every linear of the decoder layers, as GPTQ tools quantize them (the router gate is a
# parameter, not a linear; the embedding and the head stay as they are).
GPTQ_LINEARS = (
    "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


def _pack_words(values: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit values [..] packed 8 to an int32 along `dim`, the first in the lowest bits."""
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.reshape(*v.shape[:-1], -1, 8)
    words = sum(v[..., j] << (4 * j) for j in range(8))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def gptq_quantize(w: torch.Tensor, group: int, sym: bool):
    """GPTQ's round-to-nearest grid of a weight [N, K], per group of `group` inputs of a row:
    (q [K, N] in [0, 15], zeros [K/G, N], scales fp16 [K/G, N]) with w ~= (q - z) * scale.
    sym: scale = 2 max|w| / 15, z = 8 (GPTQ's sym=True); else scale = (max - min) / 15 and
    z = round(-min / scale), at least 1."""
    n, k = w.shape
    g = w.float().T.reshape(k // group, group, n)
    if sym:
        scale = 2 * g.abs().amax(1) / 15
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
        scale = (hi - lo) / 15
        # z >= 1: the v1 format stores z - 1 in 4 bits, where a zero point of 0 wraps to 15
        # and reads back as 16 (the format's known flaw, which gptq_v2 fixes)
        zero = torch.round(-lo / scale).clamp(1, 15)
    scale = scale.half().float()  # the checkpoint stores fp16 scales
    q = torch.clamp(torch.round(g / scale[:, None]) + zero[:, None], 0, 15)
    return q.reshape(k, n).to(torch.int64), zero.to(torch.int64), scale.half()


def _tiny_linears(out_dir: Path):
    """The tiny model's dir, its tensors, and the names of the decoder linears among them."""
    model_dir = make_tiny_model(out_dir)
    with SafetensorsFile(model_dir / SINGLE_FILE) as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    ends = tuple(f".{p}.weight" for p in GPTQ_LINEARS)
    return model_dir, tensors, [n for n in tensors if n.endswith(ends)]


def gptq_checkpoint(out_dir: Path, group: int, sym: bool, zeros_minus_one: bool = True):
    """The tiny model as a GPTQ 4-bit checkpoint: every decoder linear as qweight / qzeros /
    scales / g_idx (the "gptq" v1 format stores z - 1; "gptq_v2" z), quantized from fp32.
    -> (model dir, {weight name: the fp32 weight [N, K] it stands for, (q - z) * scale}), the
    values computed here from the grid, not by the loader under test."""
    model_dir, tensors, linears = _tiny_linears(out_dir)
    meant = {}
    for name in linears:
        w = tensors.pop(name)
        q, zero, scale = gptq_quantize(w, group, sym)
        groups = torch.arange(w.shape[1]) // group
        meant[name] = ((q - zero[groups]).float() * scale.float()[groups]).T.contiguous()
        stem = name.removesuffix(".weight")
        tensors[f"{stem}.qweight"] = _pack_words(q, 0)
        tensors[f"{stem}.qzeros"] = _pack_words(zero - (1 if zeros_minus_one else 0), 1)
        tensors[f"{stem}.scales"] = scale
        tensors[f"{stem}.g_idx"] = groups.to(torch.int32)
    save_checkpoint(model_dir, tensors)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "sym": sym,
        "desc_act": False,
        "checkpoint_format": "gptq" if zeros_minus_one else "gptq_v2",
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir, meant


def compressed_tensors_checkpoint(out_dir: Path, group: int):
    """The tiny model as a compressed-tensors "pack-quantized" W4A16 checkpoint (symmetric,
    group-wise, as llm-compressor writes it): every decoder linear as weight_packed [N, K/8]
    (the signed 4-bit value + 8, packed along K, the first in the lowest bits), weight_scale
    [N, K/G] and weight_shape, on the same grid as `gptq_checkpoint(..., sym=True)`.
    -> (model dir, {weight name: the fp32 weight [N, K] it stands for, (q - 8) * scale})."""
    model_dir, tensors, linears = _tiny_linears(out_dir)
    meant = {}
    for name in linears:
        w = tensors.pop(name)
        q, _, scale = gptq_quantize(w, group, sym=True)  # q [K, N] in [0, 15], zero point 8
        groups = torch.arange(w.shape[1]) // group
        meant[name] = ((q - 8).float() * scale.float()[groups]).T.contiguous()
        stem = name.removesuffix(".weight")
        tensors[f"{stem}.weight_packed"] = _pack_words(q.T, 1)
        tensors[f"{stem}.weight_scale"] = scale.T.contiguous()
        tensors[f"{stem}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
    save_checkpoint(model_dir, tensors)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group,
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir, meant

"""Checkpoints for the quantization suites (imported as `quant_checkpoints`)."""

import json
from pathlib import Path

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

"""Checkpoint loading and writing: safetensors, single file or sharded with an index.

`load_checkpoint` reads exactly the tensors the caller expects (an EP rank asks only for its own
experts) into a dict, shard by shard (`model.checkpoint_reader`: plain reads, no memory map).
The model itself is built from the reader directly, so that it packs each tensor as it is read.
FP8 e4m3 block-quantized weights (`X` + `X_scale_inv`, DeepSeek-V3 style) are dequantized at
load. Every failure is a `WeightLoadError` whose one-line message names the tensor and the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.checkpoint_reader import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointReader,
)


# ---- loading ------------------------------------------------------------------------------------
def load_checkpoint(
    model_dir: str | Path,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    progress: bool = True,
    fp8_block: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the `expected` tensors of a safetensors checkpoint.

    Args:
        model_dir: folder with `model.safetensors`, or shards plus `model.safetensors.index.json`.
        expected: tensor name -> shape (from `weight_names.checkpoint_shapes`). Only these are
            read; other names (the MTP layer, experts of other EP ranks, scales) are skipped.
        dtype: dtype of the returned tensors, except router tensors (`keeps_fp32`) in float32.
        progress: show a tqdm bar on stderr (only when stderr is a terminal).
        fp8_block: (rows, cols) of the FP8 scale blocks, from the config's
            `quantization_config.weight_block_size`; needed only if FP8 tensors are present.

    Returns:
        name -> contiguous CPU tensor of the expected shape, in `expected` order.

    Raises:
        WeightLoadError: missing/corrupt file, missing or mis-shaped tensor, unsupported dtype.
    """
    with CheckpointReader(model_dir, expected, dtype, fp8_block, progress=progress) as reader:
        return reader.read_all()


# ---- writing ------------------------------------------------------------------------------------
def _shards(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Greedy packing in insertion order; a tensor larger than the limit gets its own shard."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def save_checkpoint(
    model_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write `tensors` as `model.safetensors`, or, when they exceed `max_shard_bytes`, as
    `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json`.

    Returns the safetensors files written. Tensors are saved contiguous, as given (no cast).
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in tensors.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    metadata = {"format": "pt"}  # transformers refuses files without it
    if max_shard_bytes is None or total <= max_shard_bytes:
        path = model_dir / SINGLE_FILE
        save_file(tensors, str(path), metadata=metadata)
        return [path]

    shards = list(_shards(tensors, max_shard_bytes))
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / file_name), metadata=metadata)
        paths.append(model_dir / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    tmp = model_dir / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, model_dir / INDEX_FILE)
    return paths

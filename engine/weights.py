"""Checkpoint loading and writing: safetensors, single file or sharded with an index.

`load_checkpoint` reads exactly the tensors the caller expects (an EP rank asks only for its own
experts), one at a time with plain reads (`engine.safetensors_reader`, not a memory map), so host
memory holds the result and one tensor in flight, never a shard's pages. FP8 e4m3 block-quantized weights (`X` + `X_scale_inv`, DeepSeek-V3
style) are dequantized at load. Every failure is a `WeightLoadError` whose one-line message names
the tensor and the file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.errors import WeightLoadError
from engine.safetensors_reader import SafetensorsFile

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
FP8_MAX = 448.0  # largest finite float8_e4m3fn value

# safetensors dtype strings we read; anything else is refused with a clear message.
_FLOAT_DTYPES = {"BF16", "F16", "F32"}
_FP8_DTYPE = "F8_E4M3"


def keeps_fp32(name: str) -> bool:
    """Router tensors stay float32 whatever the model dtype: routing is computed in fp32."""
    return name.endswith(".mlp.gate.weight") or name.endswith(".e_score_correction_bias")


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
    model_dir = Path(model_dir)
    weight_map = _weight_map(model_dir)
    if weight_map is not None:
        for name in expected:
            if name not in weight_map:
                raise WeightLoadError(f"tensor '{name}' is missing from {model_dir / INDEX_FILE}")

    out: dict[str, torch.Tensor] = {}
    bar = tqdm(
        total=len(expected),
        desc=f"loading {model_dir.name}",
        unit="tensor",
        disable=True if not progress else None,  # None: tqdm turns itself off off a tty
        leave=False,
    )
    with ExitStack() as stack, bar:
        files = _FileCache(model_dir, weight_map, stack)
        # Read shard by shard (a stable sort keeps checkpoint order within a shard).
        for name in sorted(expected, key=files.file_of):
            out[name] = _load_one(files, name, expected[name], dtype, fp8_block)
            bar.update(1)
    return {name: out[name] for name in expected}


def _weight_map(model_dir: Path) -> dict[str, str] | None:
    """Tensor name -> shard file name from the index; None for a single-file checkpoint."""
    index_path = model_dir / INDEX_FILE
    single_path = model_dir / SINGLE_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise WeightLoadError(f"{index_path}: unreadable index ({exc})") from None
        return {str(k): str(v) for k, v in weight_map.items()}
    if single_path.is_file():
        return None
    raise WeightLoadError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} in the model directory")


class _FileCache:
    """Finds the file of each tensor and opens each file once, lazily; the ExitStack closes them."""

    def __init__(self, model_dir: Path, weight_map: dict[str, str] | None, stack: ExitStack):
        self._dir = model_dir
        self._map = weight_map
        self._stack = stack
        self._open: dict[str, object] = {}
        self._names: dict[str, set[str]] = {}

    def file_of(self, tensor: str) -> str:
        return SINGLE_FILE if self._map is None else self._map.get(tensor, "")

    def path_of(self, tensor: str) -> Path:
        return self._dir / self.file_of(tensor)

    def handle(self, tensor: str):
        """The open SafetensorsFile holding `tensor` (WeightLoadError if it has none)."""
        file_name, path = self.file_of(tensor), self.path_of(tensor)
        if not file_name:
            raise WeightLoadError(f"tensor '{tensor}' is missing from {self._dir / INDEX_FILE}")
        if file_name not in self._open:
            if not path.is_file():
                raise WeightLoadError(
                    f"tensor '{tensor}': shard {path} named by the index does not exist"
                )
            try:
                handle = self._stack.enter_context(SafetensorsFile(path))
                names = set(handle.keys())
            except Exception as exc:  # safetensors raises its own error types, and OSError
                raise WeightLoadError(
                    f"tensor '{tensor}': {path} is a corrupt or unreadable safetensors file ({exc})"
                ) from None
            self._open[file_name], self._names[file_name] = handle, names
        if tensor not in self._names[file_name]:
            raise WeightLoadError(f"tensor '{tensor}' is missing from {path}")
        return self._open[file_name]


def _read(files: _FileCache, name: str) -> tuple[torch.Tensor, Path]:
    """The raw tensor `name` and the path of its file (for messages)."""
    handle = files.handle(name)
    path = files.path_of(name)
    try:
        dtype = handle.dtype_of(name)
        if dtype not in _FLOAT_DTYPES and dtype != _FP8_DTYPE:
            raise WeightLoadError(
                f"tensor '{name}' in {path}: unsupported dtype {dtype} "
                "(supported: BF16, F16, F32, F8_E4M3 with a scale)"
            )
        return handle.get_tensor(name), path
    except WeightLoadError:
        raise
    except Exception as exc:
        raise WeightLoadError(f"tensor '{name}' in {path}: cannot read ({exc})") from None


def _load_one(
    files: _FileCache,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    fp8_block: tuple[int, int] | None,
) -> torch.Tensor:
    raw, path = _read(files, name)
    if tuple(raw.shape) != tuple(shape):
        raise WeightLoadError(
            f"tensor '{name}' in {path}: expected shape {list(shape)}, got {list(raw.shape)}"
        )
    target = torch.float32 if keeps_fp32(name) else dtype
    if raw.dtype != torch.float8_e4m3fn:
        return raw.to(target).contiguous()

    scale_name = name + SCALE_SUFFIX
    if fp8_block is None:
        raise WeightLoadError(
            f"tensor '{name}' in {path} is FP8 but the config has no "
            "quantization_config.weight_block_size"
        )
    if raw.dim() != 2:
        raise WeightLoadError(f"tensor '{name}' in {path}: FP8 tensors must be 2-D")
    scale, scale_path = _read(files, scale_name)
    blocks = (math.ceil(raw.shape[0] / fp8_block[0]), math.ceil(raw.shape[1] / fp8_block[1]))
    if tuple(scale.shape) != blocks:
        raise WeightLoadError(
            f"tensor '{scale_name}' in {scale_path}: expected shape {list(blocks)} for "
            f"block {list(fp8_block)}, got {list(scale.shape)}"
        )
    return dequantize_fp8_blockwise(raw, scale, fp8_block).to(target).contiguous()


# ---- FP8 block quantization ---------------------------------------------------------------------
def _padded_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 copy of `w` [N, K] zero-padded to whole blocks, viewed as [N/b0, b0, K/b1, b1]."""
    n, k = w.shape
    b0, b1 = block
    nb0, nb1 = math.ceil(n / b0), math.ceil(k / b1)
    padded = torch.zeros(nb0 * b0, nb1 * b1, dtype=torch.float32)
    padded[:n, :k] = w
    return padded.view(nb0, b0, nb1, b1)


def dequantize_fp8_blockwise(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """w [N, K] float32 = w_fp8 [N, K] * scale_inv [ceil(N/b0), ceil(K/b1)] per block.

    Edge blocks are partial: the padding is dropped after the multiply.
    """
    n, k = w_fp8.shape
    blocks = _padded_blocks(w_fp8, block)  # [N/b0, b0, K/b1, b1]
    blocks.mul_(scale_inv.float()[:, None, :, None])
    return blocks.view(blocks.shape[0] * block[0], -1)[:n, :k]


def quantize_fp8_blockwise(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize w [N, K] to (w_fp8 [N, K] float8_e4m3fn, scale_inv [N/b0, K/b1] float32).

    scale_inv = amax(|block|) / 448, so each block's largest value maps to the fp8 maximum;
    an all-zero block gets scale_inv 1.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_blockwise needs a 2-D tensor, got shape {list(w.shape)}")
    n, k = w.shape
    blocks = _padded_blocks(w.float(), block)  # [N/b0, b0, K/b1, b1]
    amax = blocks.abs().amax(dim=(1, 3))  # [N/b0, K/b1]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q = q.view(blocks.shape[0] * block[0], -1)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()


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

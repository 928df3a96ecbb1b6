"""Reading a safetensors checkpoint (single file, or shards with an index) tensor by tensor, at
the moment the model takes each one.

`CheckpointReader` is the mapping `DeepseekModel` is built from: `pop(name)` reads the tensor
from its file with plain reads (`model.safetensors_reader`, no memory map) and hands it over
without keeping it, so the model packs or quantizes each matrix as it is read and the raw copy
is freed at once. Loading thus holds the model as held (bf16, int8 or fp8) plus one tensor in
flight, never the checkpoint's pages or a second copy of the weights. The model hands the routed
experts to their packers as loaders that pop each expert when it is packed
(`native._gemm_ops.take_expert`).

FP8 e4m3 block-quantized weights (`X` + `X_scale_inv`, DeepSeek-V3 style), GPTQ 4-bit
linears (`X.qweight`, `X.qzeros`, `X.scales` in place of `X.weight`: `model.gptq`) and
compressed-tensors packed int4 ones (`X.weight_packed`, `X.weight_scale`, `X.weight_shape`:
`model.compressed_tensors`, read as the GPTQ weights they equal) are dequantized to the model dtype, or with `keep_stored` handed over as stored (`Fp8Weight`,
`GptqWeight`) for a quantizer to keep or re-quantize. Every failure is a `WeightLoadError`
whose one-line message names the tensor and the file.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from control.errors import WeightLoadError
from control.model_config import QuantConfig
from model import compressed_tensors
from model.fp8_blocks import dequantize_fp8_blockwise
from model.gptq import G_IDX, SUFFIXES, GptqWeight
from model.safetensors_reader import SafetensorsFile
from model.weight_names import keeps_fp32

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"

# safetensors dtype strings we read; anything else is refused with a clear message.
_FLOAT_DTYPES = {"BF16", "F16", "F32"}
_FP8_DTYPE = "F8_E4M3"


class Fp8Weight(NamedTuple):
    """A matrix of an FP8 checkpoint as stored: weight float8_e4m3fn [N, K] and its scales
    [ceil(N/b0), ceil(K/b1)] for blocks `block` = (b0, b1); `name` for error messages."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    name: str

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8_blockwise(self.weight, self.scale_inv, self.block).to(dtype)


class CheckpointReader:
    """The `expected` tensors of a checkpoint, each read when first asked for.

    Args:
        model_dir: folder with `model.safetensors`, or shards plus `model.safetensors.index.json`.
        expected: tensor name -> shape (from `weight_names.checkpoint_shapes`). Only these are
            read; other names (the MTP layer, experts of other EP ranks, scales) are skipped.
        dtype: dtype of the tensors handed out, except router tensors (`keeps_fp32`) in float32.
        fp8_block: (rows, cols) of the FP8 scale blocks, from the config's
            `quantization_config.weight_block_size`; needed only if FP8 tensors are present.
        keep_stored: `pop` hands FP8 and int4 weights over as stored (`Fp8Weight`,
            `GptqWeight`) instead of dequantizing them.
        int4: the config's int4 quantization (`QuantConfig` of format "int4": method "gptq" or
            "compressed-tensors"), if any: an expected `X.weight` the checkpoint does not have
            is then read from the method's tensors (`X.qweight`, `X.qzeros`, `X.scales` and, if
            present, `X.g_idx`; or `X.weight_packed`, `X.weight_scale`, `X.weight_shape`).
        progress: a tqdm bar on stderr of the bytes read and their rate (only on a tty).

    `reader[name]` reads once and keeps the tensor (norms, the embedding: what the model holds
    as read); `pop(name)` reads and keeps nothing. Use as a context manager: leaving it closes
    the files and the bar. Raises WeightLoadError (missing or corrupt file, missing or
    mis-shaped tensor, unsupported dtype); names missing from the index are found up front.
    """

    def __init__(
        self,
        model_dir: str | Path,
        expected: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        fp8_block: tuple[int, int] | None = None,
        keep_stored: bool = False,
        progress: bool = True,
        int4: QuantConfig | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.expected = expected
        self.dtype = dtype
        self.fp8_block = fp8_block
        self.keep_stored = keep_stored
        self.int4 = int4
        weight_map = _weight_map(self.model_dir)
        if weight_map is not None:
            stored_as = "qweight" if int4 is None else _INT4_FORMS[int4.method][0][0]
            for name in expected:
                if name not in weight_map and _part_name(name, stored_as) not in weight_map:
                    raise WeightLoadError(
                        f"tensor '{name}' is missing from {self.model_dir / INDEX_FILE}"
                    )
        self._stack = ExitStack()
        self._files = _FileCache(self.model_dir, weight_map, self._stack)
        self._kept: dict[str, torch.Tensor] = {}
        self._read_names: set[str] = set()
        self._bar = self._stack.enter_context(
            tqdm(
                desc=f"reading {self.model_dir.name}",
                unit="B",
                unit_scale=True,
                unit_divisor=1000,  # GB and GB/s, as disks are rated
                disable=True if not progress else None,  # None: tqdm turns itself off off a tty
                leave=False,
            )
        )

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._kept.clear()
        self._stack.close()

    def __contains__(self, name: object) -> bool:
        return name in self.expected

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._kept:
            self._kept[name] = self._take(name, keep_stored=False)
        return self._kept[name]

    def pop(self, name: str) -> torch.Tensor | Fp8Weight:
        if name in self._kept:
            return self._kept.pop(name)
        return self._take(name, keep_stored=self.keep_stored)

    def unread(self) -> list[str]:
        """Expected tensors nobody asked for (a model that skips one has a bug)."""
        return [name for name in self.expected if name not in self._read_names]

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every expected tensor, read shard by shard (a stable sort keeps checkpoint order
        within a shard), returned in `expected` order."""
        order = sorted(self.expected, key=self._files.file_of)
        out = {name: self.pop(name) for name in order}
        return {name: out[name] for name in self.expected}

    def _take(self, name: str, keep_stored: bool) -> torch.Tensor | Fp8Weight | GptqWeight:
        if name not in self.expected:
            raise KeyError(name)
        if self.int4 is not None and not self._files.has(name):
            tensor = _load_int4(
                self._files, name, self.expected[name], self.dtype, self.int4, keep_stored
            )
        else:
            tensor = _load_one(
                self._files, name, self.expected[name], self.dtype, self.fp8_block, keep_stored
            )
        self._read_names.add(name)
        self._bar.update(self._files.bytes_read - self._bar.n)
        return tensor

    @property
    def bytes_read(self) -> int:
        """Bytes of the checkpoint's files read so far (as stored)."""
        return self._files.bytes_read


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
        self.bytes_read = 0

    def file_of(self, tensor: str) -> str:
        return SINGLE_FILE if self._map is None else self._map.get(tensor, "")

    def path_of(self, tensor: str) -> Path:
        return self._dir / self.file_of(tensor)

    def _read_ahead(self, file_name: str) -> None:
        """Asks the kernel to read this file and the next one (by name) into the page cache in
        the background: the disk reads while the tensors already read are packed."""
        names = sorted(set(self._map.values())) if self._map else [file_name]
        following = names[names.index(file_name) + 1 : names.index(file_name) + 2]
        for name in (file_name, *following):
            try:
                fd = os.open(self._dir / name, os.O_RDONLY)
            except OSError:
                continue  # reported when it is opened for its tensors
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def has(self, tensor: str) -> bool:
        """Whether the checkpoint holds `tensor` (its file is opened to know)."""
        if self._map is not None:
            return tensor in self._map
        self.handle_of_file(SINGLE_FILE, tensor)
        return tensor in self._names[SINGLE_FILE]

    def handle(self, tensor: str):
        """The open SafetensorsFile holding `tensor` (WeightLoadError if it has none)."""
        file_name, path = self.file_of(tensor), self.path_of(tensor)
        if not file_name:
            raise WeightLoadError(f"tensor '{tensor}' is missing from {self._dir / INDEX_FILE}")
        self.handle_of_file(file_name, tensor)
        if tensor not in self._names[file_name]:
            raise WeightLoadError(f"tensor '{tensor}' is missing from {path}")
        return self._open[file_name]

    def handle_of_file(self, file_name: str, tensor: str):
        """The open SafetensorsFile `file_name` (opened on first use), asked for `tensor`."""
        path = self._dir / file_name
        if file_name not in self._open:
            if not path.is_file():
                raise WeightLoadError(
                    f"tensor '{tensor}': shard {path} named by the index does not exist"
                )
            try:
                handle = self._stack.enter_context(SafetensorsFile(path))
                names = set(handle.keys())
                self._read_ahead(file_name)
            except Exception as exc:  # safetensors raises its own error types, and OSError
                raise WeightLoadError(
                    f"tensor '{tensor}': {path} is a corrupt or unreadable safetensors file ({exc})"
                ) from None
            self._open[file_name], self._names[file_name] = handle, names
        return self._open[file_name]


def _read(files: _FileCache, name: str) -> tuple[torch.Tensor, Path]:
    """The raw tensor `name` and the path of its file (for messages): a float or FP8 one."""
    return _read_raw(files, name, _FLOAT_DTYPES | {_FP8_DTYPE})


def _read_raw(
    files: _FileCache, name: str, dtypes: set[str] | None = None
) -> tuple[torch.Tensor, Path]:
    """The raw tensor `name` and the path of its file, of one of `dtypes` (None: any)."""
    handle = files.handle(name)
    path = files.path_of(name)
    try:
        dtype = handle.dtype_of(name)
        if dtypes is not None and dtype not in dtypes:
            raise WeightLoadError(
                f"tensor '{name}' in {path}: unsupported dtype {dtype} "
                "(supported: BF16, F16, F32, F8_E4M3 with a scale)"
            )
        tensor = handle.get_tensor(name)
        files.bytes_read += tensor.numel() * tensor.element_size()
        return tensor, path
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
    keep_stored: bool = False,
) -> torch.Tensor | Fp8Weight:
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
    if keep_stored:
        return Fp8Weight(raw, scale.float(), tuple(fp8_block), name)
    return dequantize_fp8_blockwise(raw, scale, fp8_block).to(target).contiguous()


def _part_name(weight_name: str, suffix: str) -> str:
    """The stored tensor `suffix` of the linear whose weight is `weight_name` (X.weight ->
    X.suffix): a quantized linear's parts."""
    return weight_name.removesuffix(".weight") + "." + suffix


def _load_int4(
    files: _FileCache,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    config: QuantConfig,
    keep_stored: bool,
) -> torch.Tensor | GptqWeight:
    """The int4 linear standing for `name` [N, K]: its method's stored tensors, checked, as the
    `GptqWeight` they stand for (kept as stored) or dequantized."""
    if not name.endswith(".weight") or len(shape) != 2:
        raise WeightLoadError(f"tensor '{name}' is missing from the checkpoint")
    suffixes, label, read = _INT4_FORMS[config.method]
    parts, path = {}, None
    for suffix in suffixes:
        stored = _part_name(name, suffix)
        if not files.has(stored):
            raise WeightLoadError(f"tensor '{name}' is missing (and so is its {label} '{stored}')")
        parts[suffix], path = _read_raw(files, stored)
    weight = read(files, name, shape, config, parts, path)
    if keep_stored:
        return weight
    return weight.dequantize(torch.float32 if keeps_fp32(name) else dtype)


def _compressed_tensors_weight(
    files: _FileCache, name: str, shape, config: QuantConfig, parts: dict, path
) -> GptqWeight:
    """The compressed-tensors linear standing for `name` (`model.compressed_tensors`), checked
    against `shape` [N, K]."""
    n, k = shape
    group = config.group_size
    packed, scale, stored_shape = (parts[s] for s in compressed_tensors.SUFFIXES)
    if (
        k % 8
        or tuple(packed.shape) != (n, k // 8)
        or packed.dtype != torch.int32
        or tuple(scale.shape) != (n, -(-k // group))
        or not scale.is_floating_point()
        or stored_shape.tolist() != [n, k]
    ):
        raise WeightLoadError(
            f"tensor '{name}' in {path}: a compressed-tensors [{n}, {k}] weight with group size "
            f"{group} needs weight_packed [{n}, {k // 8}] int32, weight_scale "
            f"[{n}, {-(-k // group)}] float and weight_shape [{n}, {k}]; got "
            f"{list(packed.shape)} {packed.dtype}, {list(scale.shape)} {scale.dtype}, "
            f"{stored_shape.tolist()}"
        )
    return compressed_tensors.as_gptq(packed, scale, group, name)


def _gptq_weight(
    files: _FileCache, name: str, shape, gptq: QuantConfig, parts: dict, path
) -> GptqWeight:
    """The GPTQ linear standing for `name` (`model.gptq`), checked against `shape` [N, K]."""
    g_idx_name = _part_name(name, G_IDX)
    g_idx = _read_raw(files, g_idx_name)[0] if files.has(g_idx_name) else None
    n, k = shape
    group = gptq.group_size
    want = {
        "qweight": ((k // 8, n), torch.int32),
        "qzeros": ((-(-k // group), -(-n // 8)), torch.int32),
        "scales": ((-(-k // group), n), None),
    }
    for suffix, (want_shape, want_dtype) in want.items():
        tensor = parts[suffix]
        if tuple(tensor.shape) != want_shape or (want_dtype and tensor.dtype != want_dtype):
            raise WeightLoadError(
                f"tensor '{_part_name(name, suffix)}' in {path}: expected {list(want_shape)} "
                f"{want_dtype or 'float'} for a GPTQ [{n}, {k}] weight with group size {group}, "
                f"got {list(tensor.shape)} {tensor.dtype}"
            )
    if k % 8 or (g_idx is not None and tuple(g_idx.shape) != (k,)):
        raise WeightLoadError(f"tensor '{name}': a GPTQ weight needs K % 8 == 0 and g_idx [K]")
    return GptqWeight(
        parts["qweight"], parts["qzeros"], parts["scales"], g_idx, group, gptq.zeros_minus_one, name
    )


# method -> (its stored parts, the first one in the index; its name in messages; their reader)
_INT4_FORMS = {
    "gptq": (SUFFIXES, "GPTQ", _gptq_weight),
    compressed_tensors.METHOD: (
        compressed_tensors.SUFFIXES,
        "compressed-tensors",
        _compressed_tensors_weight,
    ),
}

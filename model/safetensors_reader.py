"""A safetensors file read with plain reads, not a memory map.

`safetensors.safe_open` maps the whole file and hands out tensors that live in that mapping:
every page a tensor touched stays resident, counted against the process, for as long as any
tensor of the file is alive (a norm weight kept as it is keeps the whole shard's mapping). A
loader then holds the checkpoint twice, once as the file's pages and once as the weights it
made of them. Here each tensor is read into its own freshly allocated memory (`readinto`), so
the process holds exactly the tensors it keeps; the file's pages stay in the page cache, which
the kernel reclaims at will.

Format: an unsigned little-endian 64-bit header length, that many bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data;
offsets count from the end of the header.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit


class SafetensorsError(ValueError):
    """The file is not a well-formed safetensors file (the message says why)."""


class SafetensorsFile:
    """One open file: `keys()`, `dtype_of(name)` (the format's dtype string), `get_tensor(name)`
    (a new CPU tensor that owns its memory). Use as a context manager, or `close()`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close() / __exit__
        try:
            self._entries, self._data_start = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> tuple[dict[str, dict[str, Any]], int]:
        size = os.fstat(self._file.fileno()).st_size
        raw = self._file.read(8)
        if len(raw) != 8:
            raise SafetensorsError("shorter than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise SafetensorsError(f"header length {header_len} exceeds the file")
        try:
            header = json.loads(self._file.read(header_len))
        except (UnicodeDecodeError, ValueError) as exc:
            raise SafetensorsError(f"header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise SafetensorsError("header is not a JSON object")
        header.pop("__metadata__", None)
        data_start, data_len = 8 + header_len, size - 8 - header_len
        for name, entry in header.items():
            _check_entry(name, entry, data_len)
        return header, data_start

    def keys(self) -> list[str]:
        return list(self._entries)

    def dtype_of(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`, read into new memory (KeyError if absent; SafetensorsError for a
        dtype torch cannot hold or a short read)."""
        entry = self._entries[name]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise SafetensorsError(f"tensor '{name}': unknown dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        out = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin:
            self._file.seek(self._data_start + begin)
            view = memoryview(out.numpy())
            got = 0
            while got < len(view):
                n = self._file.readinto(view[got:])
                if not n:
                    raise SafetensorsError(f"tensor '{name}': the file ends inside its data")
                got += n
        return out.view(dtype).reshape(entry["shape"])

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_entry(name: str, entry: Any, data_len: int) -> None:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise SafetensorsError(f"tensor '{name}': malformed header entry")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise SafetensorsError(f"tensor '{name}': dtype is not a string")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise SafetensorsError(f"tensor '{name}': malformed shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise SafetensorsError(f"tensor '{name}': data offsets {offsets!r} outside the file")
    itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else None
    if itemsize is not None and offsets[1] - offsets[0] != math.prod(shape) * itemsize:
        raise SafetensorsError(f"tensor '{name}': {offsets[1] - offsets[0]} bytes for {shape}")

"""The packed weight store: a model's weights as the kernels read them, in one file to map.

A pack holds every weight a node's model holds, after packing and quantization for one scheme
and one shard, so a process maps it and hands the kernels pointers into the mapping: no read
into the heap, no re-quantization, and every process of a host that maps the same file shares
one copy of it in the page cache (prefill and decode nodes of the same scheme, ranks of the
same shard).

File layout (little-endian):

    [tensor bytes, each at a 64-byte aligned offset] [manifest: UTF-8 JSON] [footer, 32 bytes:
    manifest offset u64, manifest length u64, crc32 of the manifest u64, magic b"DUETPAK1"]

The manifest holds the `PackSpec` (what the pack is of: checkpoint fingerprint, scheme, dtype,
shard, MTP layer, the LM head's and the attention projections' schemes, packed layout and its
version), the data size, and per weight its entry
(`native.packed_state`: classes by name, sizes, and per tensor offset, bytes, dtype, shape and
checksum). Mapping checks the footer, the manifest, the size, the spec against what the node
expects, and (by default) every tensor's checksum (`ops.checksum`, at memory speed), and refuses
anything else with a `PackError` naming the file and the reason.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from control.errors import WeightLoadError
from control.quant_schemes import attention_scheme
from native import ops
from native.packed_state import from_state, to_state

LAYOUT_VERSION = 1  # bump whenever a packed class or the file layout changes
MAGIC = b"DUETPAK1"
_FOOTER = struct.Struct("<QQQ8s")
_ALIGN = 64
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int32,
        torch.int64,
        torch.int8,
        torch.uint8,
        torch.float8_e4m3fn,
    )
}


class PackError(WeightLoadError):
    """A pack that cannot be used: missing, truncated, corrupt, stale or of another model."""


@dataclass(frozen=True)
class PackSpec:
    """What a pack holds: the checkpoint (its fingerprint, `model.pack_cache`), the weights'
    scheme and dtype, the shard (routed experts held; tensor-parallel rank and scheme), whether
    the MTP layer is in, the LM head's scheme (`lm_head`: "none" in the model dtype, "int8" with
    `quant_lm_head`), the attention projections' (`attention`: the node's `quant_attention`
    resolved, `control.quant_schemes.attention_scheme`; "" is `quant`'s default), and the packed
    layout (`native` kernels' or the `reference` twins')."""

    fingerprint: str
    quant: str
    dtype: str
    expert_range: tuple[int, int] | None = None
    tensor_parallel: tuple[int, int] | None = None
    parallel: str = "tp"
    mtp: bool = False
    lm_head: str = "none"
    attention: str = ""
    layout: str = "native"
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if not self.attention:  # frozen: set once, here
            object.__setattr__(self, "attention", attention_scheme(self.quant))

    def to_json(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        # Packs made before the head had a scheme of its own hold it in the model dtype and
        # name no `lm_head`: a model-dtype head's spec leaves it out too, so such a pack (and its
        # cache key, a hash of this) stays valid, and `from_json` reads the absence as "none".
        # An int8 head's spec names it, so its key and its manifest differ from those packs'.
        if raw["lm_head"] == "none":
            del raw["lm_head"]
        # Likewise the attention's scheme: named only where it is not `quant`'s default (packs
        # made before it had a scheme of its own hold that one), so those stay valid too.
        if raw["attention"] == attention_scheme(self.quant):
            del raw["attention"]
        return raw

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PackSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in fields}
        return cls(**values)

    def mismatch(self, other: PackSpec) -> str | None:
        """The first field in which `other` (the pack's) differs from this one (the wanted), as
        a phrase, or None."""
        for field in dataclasses.fields(self):
            want, got = getattr(self, field.name), getattr(other, field.name)
            if want != got:
                return f"{field.name} is {got!r}, this process needs {want!r}"
        return None


class PackWriter:
    """Writes a pack to `path` (atomically: a temporary file renamed at `finish`). `add(key,
    obj)` stores one weight (any object `native.packed_state` knows)."""

    def __init__(self, path: str | Path, spec: PackSpec):
        self.path = Path(path)
        self.spec = spec
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed by finish / abort)
        self._pos = 0
        self._entries: dict[str, Any] = {}

    def add(self, key: str, obj: object) -> None:
        if key in self._entries:
            raise ValueError(f"pack: weight {key!r} stored twice")
        self._entries[key] = to_state(obj, self._put)

    def _put(self, tensor: torch.Tensor) -> dict[str, Any]:
        tensor = tensor.detach().contiguous()
        if str(tensor.dtype).removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"pack: cannot store a {tensor.dtype} tensor")
        self._pad_to(_ALIGN)
        raw = tensor.view(-1).view(torch.uint8)
        self._file.write(memoryview(raw.numpy()))
        ref = {
            "offset": self._pos,
            "nbytes": raw.numel(),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "checksum": ops.checksum(raw),
        }
        self._pos += raw.numel()
        return ref

    def _pad_to(self, align: int) -> None:
        pad = -self._pos % align
        if pad:
            self._file.write(b"\0" * pad)
            self._pos += pad

    def finish(self) -> Path:
        """Writes the manifest and footer, syncs, and renames the pack into place."""
        self._pad_to(_ALIGN)
        manifest = {"spec": self.spec.to_json(), "data_bytes": self._pos, "entries": self._entries}
        body = json.dumps(manifest, separators=(",", ":")).encode()
        self._file.write(body)
        self._file.write(_FOOTER.pack(self._pos, len(body), zlib.crc32(body), MAGIC))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the pack at `path`, after the checks that need no tensor: footer, magic,
    sizes, the manifest's crc and the layout version. PackError otherwise."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _FOOTER.size:
                raise PackError(f"pack {path}: truncated ({size} bytes, no footer)")
            f.seek(size - _FOOTER.size)
            offset, length, crc, magic = _FOOTER.unpack(f.read(_FOOTER.size))
            if magic != MAGIC:
                raise PackError(f"pack {path}: not a duet-serve pack (no {MAGIC.decode()} footer)")
            if offset + length + _FOOTER.size != size:
                raise PackError(
                    f"pack {path}: truncated or padded ({size} bytes, the footer says "
                    f"{offset + length + _FOOTER.size})"
                )
            f.seek(offset)
            body = f.read(length)
    except OSError as exc:
        raise PackError(f"pack {path}: cannot read it ({exc.strerror})") from None
    if zlib.crc32(body) != crc:
        raise PackError(f"pack {path}: corrupt manifest (crc32 mismatch)")
    manifest = json.loads(body)
    version = manifest.get("spec", {}).get("layout_version")
    if version != LAYOUT_VERSION:
        raise PackError(
            f"pack {path}: stale layout version {version} (this build reads {LAYOUT_VERSION}); "
            "rebuild it with duet pack"
        )
    if manifest["data_bytes"] != offset:
        raise PackError(f"pack {path}: corrupt manifest (data size {manifest['data_bytes']})")
    return manifest


class MappedPack:
    """A pack mapped read-only and shared (`mmap`); `object(key)` rebuilds one weight around
    views of the mapping. `expect` (the spec the process needs) is compared with the pack's,
    and with `verify` every tensor's checksum too; PackError on any difference."""

    def __init__(self, path: str | Path, expect: PackSpec | None = None, verify: bool = True):
        self.path = Path(path)
        manifest = read_manifest(self.path)
        self.spec = PackSpec.from_json(manifest["spec"])
        if expect is not None and (why := expect.mismatch(self.spec)):
            raise PackError(f"pack {self.path}: made for another model, scheme or shard: {why}")
        self._entries: dict[str, Any] = manifest["entries"]
        self.data_bytes: int = manifest["data_bytes"]
        self.nbytes = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # huge pages where the file system gives them
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        with warnings.catch_warnings():  # read-only by design: a write would fault, not corrupt
            warnings.simplefilter("ignore", UserWarning)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        if verify:
            self.verify()

    @property
    def address(self) -> int:
        """Where the mapping starts in this process (to find it in /proc/self/smaps)."""
        return self._bytes.data_ptr()

    def _tensor(self, ref: dict[str, Any]) -> torch.Tensor:
        offset, nbytes = ref["offset"], ref["nbytes"]
        if offset + nbytes > self.data_bytes:
            raise PackError(f"pack {self.path}: corrupt manifest (a tensor past the data)")
        dtype = _DTYPES[ref["dtype"]]
        return self._bytes[offset : offset + nbytes].view(dtype).view(ref["shape"])

    def has(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def object(self, key: str) -> object:
        if key not in self._entries:
            raise PackError(f"pack {self.path}: has no weight {key!r} (built from another model)")
        return from_state(self._entries[key], self._tensor)

    def _refs(self) -> list[dict[str, Any]]:
        refs: list[dict[str, Any]] = []

        def collect(entry):
            if entry["kind"] == "tensor":
                refs.append(entry["ref"])
            refs.extend(entry.get("tensors", {}).values())
            for item in entry.get("items", ()):
                collect(item)

        for entry in self._entries.values():
            collect(entry)
        return sorted(refs, key=lambda r: r["offset"])

    def verify(self) -> None:
        """Every tensor's checksum against the manifest's (reads the whole pack once, which
        also brings it into the page cache)."""
        for ref in self._refs():
            end = ref["offset"] + ref["nbytes"]
            data = self._bytes[ref["offset"] : end]
            if end > self.data_bytes or ops.checksum(data) != ref["checksum"]:
                raise PackError(
                    f"pack {self.path}: corrupt (checksum mismatch at byte {ref['offset']})"
                )

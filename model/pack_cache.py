"""Loading a model through packed weights: build a pack once, map it everywhere.

`load_model` is how nodes and the CLI load a model:
- `pack=PATH` maps that pack (made by `duet pack`); any mismatch or corruption is an error;
- `weights_cache=True` maps the pack of this checkpoint, scheme and shard under
  `$DUET_CACHE_DIR/packs/`, building it first if it is missing, stale or corrupt (under a file
  lock, so concurrent processes build it once; a bad one is logged and rebuilt);
- neither: the checkpoint is read and packed in the process's heap (`from_pretrained`).

A pack is keyed by content: `checkpoint_fingerprint` hashes config.json, every safetensors
file's name, size and header (names, dtypes, shapes, offsets), and 64 KiB samples at four places
of each file's data; the key adds the scheme, dtype, shard, MTP layer, the LM head's scheme
(`quant_lm_head`), the attention projections' (`quant_attention`) and packed layout.

Where the weights live (`weights_backing`): on a host with a tmpfs that serves huge pages
(`$DUET_HUGEPAGE_DIR`, or /dev/shm when it is mounted `huge=always|within_size|advise`), the
pack is copied there once and mapped from the copy, since a bandwidth-bound decode reads its
weights faster on 2 MiB pages; elsewhere the file is mapped with MADV_HUGEPAGE, which the file
system honours or not. A process bound to one NUMA node of several (`control.placement`) maps a
copy of its own node in /dev/shm (written while bound there, so its pages are that node's),
never weights across the interconnect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from control.builtin_model import cache_root
from control.file_lock import FileLock
from control.model_config import ModelConfig
from control.quant_schemes import attention_scheme, lm_head_scheme
from model.checkpoint_reader import INDEX_FILE, SINGLE_FILE
from model.heap import release_free_heap
from model.weight_pack import MappedPack, PackError, PackSpec, PackWriter, read_manifest
from native import ops

log = logging.getLogger("duet.pack")
PACK_LOCK_TIMEOUT_S = 3600.0  # a full-depth pack takes minutes to build
_SAMPLES, _SAMPLE_BYTES = 4, 64 << 10


def cache_dir() -> Path:
    """`$DUET_CACHE_DIR/packs` (the cache defaulting to ~/.cache/duet-serve)."""
    return cache_root() / "packs"


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """A content hash of a checkpoint that reads a few MB however large it is (see module)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", INDEX_FILE):
        if (model_dir / name).is_file():
            h.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    files = sorted(p for p in model_dir.glob("*.safetensors"))
    if not files:
        raise PackError(f"{model_dir}: no {SINGLE_FILE} or shards to fingerprint")
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + f.read(min(header_len, size)))
            data_start = 8 + header_len
            for i in range(_SAMPLES):
                f.seek(data_start + (size - data_start) * i // _SAMPLES)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def pack_spec(
    model_dir,
    dtype: torch.dtype,
    quant: str | None,
    expert_range: range | None = None,
    tensor_parallel=None,
    parallel: str = "tp",
    mtp: bool = False,
    quant_lm_head: bool = False,
    quant_attention: str | None = None,
) -> PackSpec:
    """The spec of the pack a process loading these arguments needs. An expert-parallel rank
    (an `expert_range` without tensor parallelism) maps the whole model's pack and takes its
    experts out of it, so every process of the host shares one pack: its spec names no shard."""
    if tensor_parallel is None:
        expert_range = None
    return PackSpec(
        fingerprint=checkpoint_fingerprint(model_dir),
        quant=quant or "none",
        dtype=str(dtype).removeprefix("torch."),
        expert_range=None if expert_range is None else (expert_range.start, expert_range.stop),
        tensor_parallel=None if tensor_parallel is None else tuple(tensor_parallel),
        parallel=parallel if tensor_parallel is not None else "tp",
        mtp=mtp,
        lm_head=lm_head_scheme(quant_lm_head),
        attention=attention_scheme(quant, quant_attention),
        layout="native" if ops.native_available() else "reference",
    )


@dataclass
class BuildStats:
    seconds: float
    checkpoint_bytes: int
    pack_bytes: int

    def __str__(self) -> str:
        rate = self.checkpoint_bytes / max(self.seconds, 1e-9) / 1e9
        return (
            f"read {self.checkpoint_bytes / 1e9:.2f} GB of checkpoint at {rate:.2f} GB/s, wrote "
            f"{self.pack_bytes / 1e9:.2f} GB of pack in {self.seconds:.1f} s"
        )


def build_pack(model_dir, out: str | Path, spec: PackSpec, progress: bool = True) -> BuildStats:
    """Reads the checkpoint once, packs every weight as `spec` says, and writes the pack to
    `out` (atomically). The model built on the way is a husk: each packed weight goes to the
    file and is freed, so building holds one weight in flight, not the model."""
    from model.deepseek import DeepseekModel  # built by the packer, not its caller

    start = time.perf_counter()
    writer = PackWriter(out, spec)
    try:
        expert_range = None if spec.expert_range is None else range(*spec.expert_range)
        with DeepseekModel.open_checkpoint(
            model_dir,
            getattr(torch, spec.dtype),
            expert_range,
            progress,
            spec.quant,
            spec.mtp,
            spec.tensor_parallel,
            spec.parallel,
            spec.attention,
        ) as (cfg, reader, experts):
            DeepseekModel(
                cfg,
                reader,
                getattr(torch, spec.dtype),
                experts,
                spec.quant,
                spec.mtp,
                spec.tensor_parallel,
                spec.parallel,
                sink=writer,
                quant_lm_head=spec.lm_head == "int8",
                quant_attention=spec.attention,
            )
            read = reader.bytes_read
        path = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        release_free_heap()  # the husk's temporaries, kept in the heap while it was built
    return BuildStats(time.perf_counter() - start, read, path.stat().st_size)


def load_model(
    model_dir,
    dtype: torch.dtype = torch.bfloat16,
    quant: str | None = None,
    expert_range: range | None = None,
    tensor_parallel=None,
    parallel: str = "tp",
    mtp: bool = False,
    progress: bool = True,
    pack: str | Path | None = None,
    weights_cache: bool = False,
    numa_node: int | None = None,
    quant_lm_head: bool = False,
    quant_attention: str | None = None,
):
    """The model of `model_dir` as `from_pretrained` gives it, through a pack when asked (see
    the module). `numa_node`: the node this process is bound to, on a host of several;
    `quant_lm_head`: the LM head in int8, `quant_attention` the attention projections' scheme
    (None: `quant`'s; `model.quant`)."""
    from model.deepseek import DeepseekModel

    args = (dtype, expert_range, quant, mtp, tensor_parallel, parallel, quant_lm_head)
    if not pack and not weights_cache:
        return DeepseekModel.from_pretrained(
            model_dir,
            dtype,
            expert_range,
            progress,
            quant,
            mtp,
            tensor_parallel,
            parallel,
            quant_lm_head=quant_lm_head,
            quant_attention=quant_attention,
        )
    spec = pack_spec(
        model_dir,
        dtype,
        quant,
        expert_range,
        tensor_parallel,
        parallel,
        mtp,
        quant_lm_head,
        quant_attention,
    )
    if pack:
        mapped = MappedPack(local_copy(Path(pack), numa_node), expect=spec)
    else:
        path = ensure_cached_pack(model_dir, spec, progress)
        try:
            mapped = MappedPack(local_copy(path, numa_node), expect=spec)  # every checksum
        except PackError as exc:  # corrupt: rebuilt (once, whoever finds it first)
            log.warning("%s; rebuilding it", exc)
            path = ensure_cached_pack(model_dir, spec, progress, verify=True)
            mapped = MappedPack(local_copy(path, numa_node, refresh=True), expect=spec)
    cfg = ModelConfig.from_model_dir(model_dir)
    model = DeepseekModel.from_pack(cfg, mapped, *args, quant_attention=quant_attention)
    model.model_dir = Path(model_dir)
    model.weights_backing, detail = weights_backing(mapped)
    model.weights_detail = f"pack {mapped.path} ({mapped.nbytes / 1e9:.2f} GB), {detail}"
    log.info("weights: %s", model.weights_detail)
    return model


def ensure_cached_pack(
    model_dir, spec: PackSpec, progress: bool = True, verify: bool = False
) -> Path:
    """The cache's pack for `spec`, built once: a missing or stale one is rebuilt; with `verify`
    a corrupt one too (every checksum read: mapping it verifies it anyway)."""
    key = hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True).encode()).hexdigest()[:32]
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    head = "" if spec.lm_head == "none" else f"-{spec.lm_head}head"  # for whoever lists them
    default = spec.attention == attention_scheme(spec.quant)
    attention = "" if default else f"-{spec.attention}attn"
    path = folder / f"{Path(model_dir).name}-{spec.quant}{attention}{head}-{key}.pack"
    if not verify and _usable(path, spec):
        return path
    with FileLock(folder / f".{path.name}.lock", PACK_LOCK_TIMEOUT_S, f"the pack {path}"):
        if not _usable(path, spec, verify):  # another process may have built it meanwhile
            log.info("building %s from %s", path, model_dir)
            log.info("built %s: %s", path.name, build_pack(model_dir, path, spec, progress))
    return path


def _usable(path: Path, spec: PackSpec, verify: bool = False) -> bool:
    """Whether the cached pack exists, is whole (footer, sizes, manifest) and of `spec`; with
    `verify` its tensors' checksums too."""
    if not path.exists():
        return False
    try:
        manifest = read_manifest(path)
        if why := spec.mismatch(PackSpec.from_json(manifest["spec"])):
            raise PackError(f"pack {path}: {why}")
        if verify:
            MappedPack(path, expect=spec)
        return True
    except PackError as exc:
        log.warning("%s; rebuilding it", exc)
        return False


def _mount_of(path: str | Path, mounts: str | None = None) -> tuple[str, list[str]]:
    """(file system type, mount options) of the mount holding `path`, from /proc/mounts (or the
    `mounts` text given); ("", []) if unreadable."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return "", []
    path, best = str(path), ("", "", [])
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best[0]):
            best = (point, fields[2], fields[3].split(","))
    return best[1], best[2]


def hugepage_dir(mounts: str | None = None) -> Path | None:
    """A tmpfs that gives huge pages: $DUET_HUGEPAGE_DIR, or /dev/shm when mounted with huge=
    (`mounts`: /proc/mounts' text, read when not given)."""
    if env := os.environ.get("DUET_HUGEPAGE_DIR"):
        return Path(env)
    fstype, options = _mount_of("/dev/shm", mounts)
    huge = ("huge=always", "huge=within_size", "huge=advise")
    return Path("/dev/shm") if fstype == "tmpfs" and any(o in options for o in huge) else None


def local_copy(path: Path, numa_node: int | None, refresh: bool = False) -> Path:
    """The file this process maps: a huge-page or NUMA-node copy of the pack where the host
    calls for one (see the module), made once per host under a lock (again with `refresh`: the
    copy of a rebuilt pack); else the pack itself."""
    if numa_node is not None:
        folder, suffix = Path(os.environ.get("DUET_NUMA_COPY_DIR", "/dev/shm")), f"node{numa_node}"
    elif (huge := hugepage_dir()) is not None:
        folder, suffix = huge, "huge"
    else:
        return path
    copy = folder / "duet-packs" / f"{path.stem}.{suffix}.pack"
    copy.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(copy.parent / f".{copy.name}.lock", PACK_LOCK_TIMEOUT_S, f"the copy {copy}"):
        if not refresh and copy.exists() and copy.stat().st_size == path.stat().st_size:
            return copy  # its checksums are verified when mapped
        free = shutil.disk_usage(copy.parent).free
        if free < path.stat().st_size:
            log.warning("no room for a %s copy of %s in %s: mapping the file", suffix, path, folder)
            return path
        tmp = copy.with_name(f".{copy.name}.{os.getpid()}.tmp")
        try:
            shutil.copyfile(path, tmp)  # written by this process: its NUMA binding places it
            os.replace(tmp, copy)
        finally:
            tmp.unlink(missing_ok=True)
    return copy


def weights_backing(mapped: MappedPack) -> tuple[str, str]:
    """How the mapping is backed: (one of `control.quant_schemes.WEIGHT_BACKINGS`, a description
    with how much of what is resident sits on 2 MiB pages, from /proc/self/smaps)."""
    fields = _smaps_fields(mapped.address)
    kind = "shmem" if _mount_of(mapped.path.resolve())[0] == "tmpfs" else "file"
    huge = fields.get("ShmemPmdMapped" if kind == "shmem" else "FilePmdMapped", 0)
    rss = fields.get("Rss", 0)
    on_huge = huge > 0 and huge >= rss // 2
    label = f"{kind}_hugepages" if on_huge else kind
    pages = "huge pages" if on_huge else "4 KiB pages"
    detail = f"{kind} mapping on {pages} ({huge >> 10} of {rss >> 10} MiB resident on 2 MiB pages)"
    return label, detail


def _smaps_fields(address: int) -> dict[str, int]:
    """The kB fields of the mapping holding `address` in /proc/self/smaps ({} if unreadable)."""
    fields: dict[str, int] = {}
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if not head[0].endswith(":"):  # a mapping's first line: its address range
                    low, high = (int(x, 16) for x in head[0].split("-"))
                    inside = low <= address < high
                elif inside and len(head) >= 2 and head[1].isdigit():
                    fields[head[0][:-1]] = int(head[1])
    except (OSError, ValueError):
        return {}
    return fields

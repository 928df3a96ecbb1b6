"""A host-wide second tier for the prefill prefix cache: KV pages on local disk.

Content-addressed: a page is one file named by its chained page name (`control.kv_events`:
the hash of the whole prefix it ends), under a directory per KV layout (model fingerprint, KV
dtype, layers, row width, page size and the node's weight scheme, whose rows differ). So every
prefill node of the same model and layout on the host shares one store without a lock: a page
is written to a temporary file and renamed into place (a reader sees a whole file or none), two
nodes spilling the same page write the same bytes, and the store outlives every node: a
restarted node's first hits come from it.

A file is a small header (magic, version, payload length, XXH3-64 of the payload) and the
page's rows [layers, page_size, W] as stored in the pool. A file that fails any check (torn,
truncated, bit rot, another layout) is deleted and reported as a miss: the prefill computes
those tokens instead. Bounded: past `max_bytes` the least recently used files go (a hit
refreshes a file's time), measured by a scan of the directory, so the bound holds for all the
processes sharing it.

Read-ahead: `prefetch(names)` reads pages on a helper thread into a bounded staging area as soon
as a prompt arrives, so by the time the prompt starts (behind the queue, or the forward running
now) `get` finds them in memory; what was not read ahead yet is read then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

log = logging.getLogger(__name__)

MAGIC = b"DKV1"
HEADER = struct.Struct("<4sIQQ")  # magic, version, payload bytes, xxh3-64 of the payload
VERSION = 1
TRIM_TO = 0.9  # a trim leaves the store at this share of its bound
STAGING_BYTES = 256 * 2**20  # pages read ahead and not yet taken, at most
WAIT_FOR_READ_S = 0.5  # a prompt's load waits this long in all for pages the helper is reading


def layout_key(layout: dict[str, Any]) -> str:
    """The directory name of a KV layout (a short hash of its canonical JSON)."""
    canonical = json.dumps(layout, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode(), digest_size=12).hexdigest()


class DiskKVStore:
    """Pages of one KV layout under `root` (see the module docstring). Thread-safe: the node's
    loop reads and writes, nothing else of the process does."""

    def __init__(
        self,
        root: str | Path,
        layout: dict[str, Any],
        page_shape: tuple[int, int, int],
        dtype: torch.dtype,
        max_bytes: int,
    ):
        if max_bytes <= 0:
            raise ValueError("the disk KV store needs a positive size bound")
        self.dir = Path(root) / layout_key(layout)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "layout.json").write_text(json.dumps(layout, sort_keys=True, default=str))
        self.page_shape = page_shape
        self.dtype = dtype
        self.payload_bytes = page_shape[0] * page_shape[1] * page_shape[2] * dtype.itemsize
        self.file_bytes = HEADER.size + self.payload_bytes
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._bytes_since_trim = 0
        # Cumulative counters (the heartbeat reports them).
        self.num_stored = 0  # pages written
        self.num_loaded = 0  # pages read back (hits)
        self.num_corrupt = 0  # files that failed a check: deleted, computed instead
        self.num_trimmed = 0  # files removed to stay within the bound
        self.num_prefetched = 0  # pages read ahead on the helper thread
        # Read-ahead: pages read on the helper thread, oldest first, until `get` takes them.
        self._staged: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._pending: set[bytes] = set()  # asked for, not read yet
        self._max_staged = max(1, STAGING_BYTES // self.payload_bytes)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self._read_done = threading.Condition(self._lock)  # a page asked for was read
        self.trim()

    def _path(self, name: bytes) -> Path:
        return self.dir / f"{name.hex()}.kv"

    def contains(self, name: bytes) -> bool:
        return self._path(name).exists()

    def put(self, name: bytes, rows: torch.Tensor) -> None:
        """Stores one page's rows [layers, page_size, W] (a no-op if it is there already)."""
        path = self._path(name)
        if path.exists():
            return
        if tuple(rows.shape) != self.page_shape or rows.dtype != self.dtype:
            raise ValueError(f"page rows {tuple(rows.shape)} {rows.dtype} are not this layout's")
        payload = rows.contiguous().view(torch.uint8).numpy().tobytes()
        header = HEADER.pack(MAGIC, VERSION, len(payload), xxhash.xxh3_64_intdigest(payload))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only disk loses the page, never the request
            log.warning("disk KV store: cannot write %s: %s", path.name, exc)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self.num_stored += 1
            self._bytes_since_trim += self.file_bytes
            due = self._bytes_since_trim > self.max_bytes * (1 - TRIM_TO)
        if due:
            self.trim()

    def get(self, name: bytes, wait_s: float = WAIT_FOR_READ_S) -> torch.Tensor | None:
        """The page's rows, or None (absent, or a file that failed a check: deleted). A page
        read ahead comes from memory; one the helper is reading is waited for, `wait_s` at
        most, then read here."""
        with self._read_done:  # the helper reading it now: wait rather than read it twice
            self._read_done.wait_for(lambda: name not in self._pending, max(0.0, wait_s))
            rows = self._staged.pop(name, None)
        if rows is None:
            rows = self._read(name)
        if rows is not None:
            with self._lock:
                self.num_loaded += 1
        return rows

    def prefetch(self, names: list[bytes]) -> None:
        """Reads these pages on the helper thread, in order, until one is missing (a prompt's
        pages after its cached prefix: only a leading run can be used). Never blocks."""
        with self._lock:
            names = [n for n in names if n not in self._staged and n not in self._pending]
            self._pending.update(names)
        if names:
            self._reader.submit(self._read_ahead, names)

    def _read_ahead(self, names: list[bytes]) -> None:
        try:
            for name in names:
                rows = self._read(name)
                with self._read_done:
                    self._pending.discard(name)
                    if rows is not None:
                        self._staged[name] = rows
                        self.num_prefetched += 1
                        while len(self._staged) > self._max_staged:  # the oldest go
                            self._staged.popitem(last=False)
                    self._read_done.notify_all()
                if rows is None:
                    break
        finally:
            with self._read_done:
                self._pending.difference_update(names)
                self._read_done.notify_all()

    def close(self) -> None:
        """Stops the helper thread (after the read in progress) and drops what it staged."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._staged.clear()

    def _read(self, name: bytes) -> torch.Tensor | None:
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
        except OSError:
            return None
        problem = self._problem(data)
        if problem:
            log.warning("disk KV store: %s %s: deleted", path.name, problem)
            path.unlink(missing_ok=True)
            with self._lock:
                self.num_corrupt += 1
            return None
        try:
            os.utime(path)  # recently used: trimmed last
        except OSError:
            pass  # trimmed by another node meanwhile: the rows in hand are still whole
        payload = bytearray(data[HEADER.size :])
        return torch.frombuffer(payload, dtype=self.dtype).view(self.page_shape)

    def _problem(self, data: bytes) -> str | None:
        if len(data) != self.file_bytes:
            return f"has {len(data)} bytes, not {self.file_bytes}"
        magic, version, length, digest = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION or length != self.payload_bytes:
            return "has a foreign header"
        if xxhash.xxh3_64_intdigest(memoryview(data)[HEADER.size :]) != digest:
            return "fails its checksum"
        return None

    def trim(self) -> int:
        """Deletes the least recently used files until the store is within TRIM_TO of its
        bound (every process's files count); returns how many went."""
        files = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".kv"):
                try:
                    stat = entry.stat()
                except OSError:
                    continue  # deleted meanwhile
                files.append((stat.st_mtime, entry.name, stat.st_size))
        total = sum(size for _, _, size in files)
        removed = 0
        if total > self.max_bytes:
            for _, file_name, size in sorted(files):
                if total <= self.max_bytes * TRIM_TO:
                    break
                (self.dir / file_name).unlink(missing_ok=True)
                total -= size
                removed += 1
        with self._lock:
            self._bytes_since_trim = 0
            self.num_trimmed += removed
        return removed

    def num_bytes(self) -> int:
        """The store's size on disk now (a scan)."""
        return sum(e.stat().st_size for e in os.scandir(self.dir) if e.name.endswith(".kv"))

"""An exclusive flock with a bounded wait: how concurrent processes of a host build a cached
artifact once (the tiny model, a weight pack) while the others wait for it."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class LockTimeout(RuntimeError):
    pass


class FileLock:
    """An exclusive flock on `path`, waited for at most `timeout_s`; `what` names the artifact
    being built in the timeout's message."""

    def __init__(self, path: Path, timeout_s: float, what: str):
        self.path, self.timeout_s, self.what = Path(path), timeout_s, what

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise LockTimeout(
                        f"waited {self.timeout_s:.0f} s for another process to build "
                        f"{self.what} (lock {self.path}); remove the lock's holder or the cache"
                    ) from None
                time.sleep(0.2)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)

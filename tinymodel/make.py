"""The built-in model, made to order (`make_tiny_model`) or trained once into the cache and
reused (`ensure_tiny_model`, what the local cluster and the tests serve).

`python -m tinymodel` ensures the cached copy and prints its path: torch-free processes (the
router, the launcher) get the model that way (`control.builtin_model`) without importing the
trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from control.builtin_model import builtin_model_dir
from control.file_lock import FileLock, LockTimeout
from tinymodel.builder import TINY_MODEL_VERSION, VERSION_FILE, _write_json, make_random_tiny_model
from tinymodel.train_model import make_trained_tiny_model, training_key


def make_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    fp8: bool = False,
    max_shard_bytes: int | None = None,
    random: bool = True,
) -> Path:
    """A tiny deepseek_v3 model directory at `out_dir`: random (`make_random_tiny_model`, which
    the options shape), or with `random=False` trained (`make_trained_tiny_model`: the tiny
    config with one MTP layer, float32, a tokenizer of its own; it takes only a seed)."""
    if random:
        return make_random_tiny_model(out_dir, seed, overrides, dtype, fp8, max_shard_bytes)
    if overrides or fp8 or max_shard_bytes is not None or dtype != torch.float32:
        raise ValueError("the trained tiny model takes only a seed")
    return make_trained_tiny_model(out_dir, seed=seed)


# A second process waits this long for the first one's training before giving up.
LOCK_TIMEOUT_S = 900.0


def _is_current(model_dir: Path, key: str) -> bool:
    try:
        info = json.loads((model_dir / VERSION_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(info, dict)
        and info.get("version") == TINY_MODEL_VERSION
        and info.get("key") == key
    )


def _default_key() -> str:
    return training_key()


def _build_default(out_dir: Path) -> None:
    """Writes the default model (trained, seed 0) into `out_dir`."""
    make_trained_tiny_model(out_dir)


def ensure_tiny_model() -> Path:
    """The default tiny model (trained, seed 0, float32), trained once into the cache and reused
    while its key (`tinymodel.train_model.training_key`) is unchanged.

    Safe under concurrency: an exclusive file lock makes one process train while the others wait
    (at most LOCK_TIMEOUT_S); the model is built in a temporary folder and renamed into place
    (atomic), so a reader without the lock sees either nothing or a complete model.
    """
    final = builtin_model_dir()
    key = _default_key()
    if _is_current(final, key):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / ".tiny-model.lock"):
        if not _is_current(final, key):  # another process may have built it meanwhile
            _publish(final, key)
    return final


TinyModelLockTimeout = LockTimeout


def _locked(path: Path) -> FileLock:
    """The tiny model's build lock, waited for at most LOCK_TIMEOUT_S."""
    return FileLock(path, LOCK_TIMEOUT_S, "the tiny model")


def _publish(final: Path, key: str) -> None:
    """Builds the model in a temporary folder next to `final` and renames it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=final.parent))
    try:
        _build_default(tmp)
        info = json.loads((tmp / VERSION_FILE).read_text())
        info.update(version=TINY_MODEL_VERSION, key=key)
        _write_json(tmp / VERSION_FILE, info)
        if final.exists():
            # An older version: move it aside first (rename is atomic).
            stale = Path(tempfile.mkdtemp(prefix=".tiny-model-stale-", dir=final.parent))
            try:
                os.rename(final, stale / "old")
            except OSError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

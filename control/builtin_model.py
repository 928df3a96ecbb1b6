"""Where the built-in model and the other cached artifacts live, and how a torch-free process
gets the built-in model: `python -m tinymodel` ensures it (trains it once, under a file lock)
and prints its directory, so the router and the launcher never import the trainer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from control.errors import ConfigError

# Training the built-in model takes a few minutes the first time; another process's training
# may be waited for (tinymodel.make.LOCK_TIMEOUT_S) before that.
ENSURE_TIMEOUT_S = 1800.0


def cache_root() -> Path:
    """`$DUET_CACHE_DIR`, defaulting to `~/.cache/duet-serve`."""
    return Path(os.environ.get("DUET_CACHE_DIR") or Path.home() / ".cache" / "duet-serve")


def builtin_model_dir() -> Path:
    """The built-in (tiny) model's directory in the cache."""
    return cache_root() / "tiny-model"


def ensure_builtin_model() -> Path:
    """The built-in model's directory, built first when it is missing or stale, in a child
    process (its progress goes to this process's stderr)."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tinymodel"],
            stdout=subprocess.PIPE,
            text=True,
            timeout=ENSURE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"building the built-in model took over {ENSURE_TIMEOUT_S:.0f} s; "
            "run `python -m tinymodel` to see why"
        ) from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise ConfigError(
            f"building the built-in model failed (exit {done.returncode}); "
            "run `python -m tinymodel` to see why"
        )
    return Path(lines[-1])

"""control.builtin_model: a torch-free process gets the built-in model from a child process
(`python -m tinymodel`), the same directory the trainer's own `ensure_tiny_model` returns; a
child that fails or prints nothing is a ConfigError naming the command to run."""

import subprocess

import pytest

from control import builtin_model
from control.errors import ConfigError
from tinymodel.make import ensure_tiny_model


def test_the_child_returns_the_cached_model(monkeypatch, tmp_path):
    expected = ensure_tiny_model()  # built (or found) in this process's cache first
    assert builtin_model.ensure_builtin_model() == expected == builtin_model.builtin_model_dir()
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    assert builtin_model.builtin_model_dir() == tmp_path / "tiny-model"
    assert builtin_model.cache_root() == tmp_path


@pytest.mark.parametrize(("code", "out"), [(1, "/somewhere\n"), (0, "")])
def test_a_failed_child_is_a_config_error(monkeypatch, code, out):
    def run(*args, **kwargs):
        return subprocess.CompletedProcess(args, code, stdout=out)

    monkeypatch.setattr(builtin_model.subprocess, "run", run)
    with pytest.raises(ConfigError, match="python -m tinymodel"):
        builtin_model.ensure_builtin_model()

"""The layering of DESIGN.md, checked two ways: statically (scripts/import_graph.py over the
sources: no cycle, no import across floors) and at run time (the gateway, the launcher and the
benchmark client load in a fresh interpreter without torch, the model or the kernels)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import import_graph  # noqa: E402


def test_the_project_has_no_cycle_and_no_crossed_floor():
    edges, external = import_graph.build_graph()
    assert "router.app" in edges and "model.deepseek" in edges  # it read the project
    assert import_graph.cycles(edges) == []
    assert import_graph.violations(edges, external) == []


def test_cycles_are_found_whatever_their_length():
    edges = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {"e": 1}}
    assert import_graph.cycles(edges) == [["a", "b", "c"]]
    assert import_graph.cycles({"a": {"b": 1}, "b": {}}) == []


def test_a_crossed_floor_and_a_heavy_import_are_reported():
    edges = {
        "router.app": {"model.deepseek": 3, "control.protocol": 4},
        "kvtransfer.wire": {"model.kv_pool": 5, "model.deepseek": 6},
        "model.deepseek": {},
        "model.kv_pool": {},
        "control.protocol": {},
    }
    external = {m: {} for m in edges} | {"control.protocol": {"torch": 9}}
    found = import_graph.violations(edges, external)
    assert found == [
        "control.protocol:9 imports torch (must load without it)",
        "kvtransfer.wire:6 imports model.deepseek (kvtransfer may not import model)",
        "router.app:3 imports model.deepseek (router may not import model)",
    ]


def test_imports_are_read_everywhere_in_a_file(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import control.protocol\n"
        "if TYPE_CHECKING:\n    from model import deepseek\n"
        "def f():\n    from .sibling import x\n"
    )
    names = {name for name, _ in import_graph._imported_names("pkg.m", source)}
    assert {"control.protocol", "model.deepseek", "pkg.sibling", "pkg.sibling.x"} <= names


@pytest.mark.parametrize(
    "statement",
    [
        "import router.app",  # the gateway's app and everything it serves with
        "import router.__main__",
        "import deploy.cli",  # `duet`: its torch commands import their code when run
        "import deploy.local_cluster",  # the one-machine launcher
        "import deploy.k8s_render",
        "import bench.serve",  # the load generator
        "import bench.sweep",
        "import bench.router_start",
    ],
)
def test_torch_free_entry_points_load_without_torch(statement):
    code = (
        f"{statement}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'native', 'model', 'runtime', 'tinymodel', 'transformers'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    # only the model's shape rules (torch-free themselves) may come along
    assert [m for m in loaded if m not in import_graph.TORCH_FREE_MODULES] == []

"""The project's import graph, read from source (ast), checked against its floors.

Every import counts, at module level, inside a function or under ``if TYPE_CHECKING:``: a
lazy import still loads the module when it runs, and a type-only import is still a dependency
between the two files (each needs the other to be understood).

    python scripts/import_graph.py            # fails (exit 1) on a cycle or a crossed floor
    python scripts/import_graph.py --cycles   # lists the cycles only

The floors are those of DESIGN.md: a package imports only packages on floors below it (and
the third-party libraries its floor allows); roles never import each other.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> project packages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "native": set(),
    "control": set(),
    "model": {"native", "control"},
    "kvtransfer": {"control"},
    "runtime": {"model", "kvtransfer", "control", "native"},
    "prefill_node": {"runtime", "model", "kvtransfer", "control", "native"},
    "decode_node": {"runtime", "model", "kvtransfer", "control", "native"},
    "router": {"control"},
    "tinymodel": {"runtime", "model", "kvtransfer", "control", "native"},
    "deploy": {"router", "prefill_node", "decode_node", "runtime", "model", "kvtransfer"}
    | {"control", "native", "tinymodel"},
    "bench": {"router", "prefill_node", "decode_node", "runtime", "model", "kvtransfer"}
    | {"control", "native", "tinymodel", "deploy"},
}

# single modules a package may import from a floor it otherwise may not: the transport writes
# into and reads from the KV pool's pages
ALLOWED_MODULES: dict[str, set[str]] = {"kvtransfer": {"model.kv_pool"}}

# packages that must load without torch, the model or the kernels
TORCH_FREE = {"control", "router"}
HEAVY = {"torch", "safetensors", "transformers"}  # third-party roots they may not import

# modules of deploy/ and bench/ that the torch-free rule covers too: the launcher, the cluster
# tools and the benchmark clients, which a host without torch runs
TORCH_FREE_MODULES = {
    "deploy",
    "deploy.local_cluster",
    "deploy.supervisor",
    "deploy.status",
    "deploy.probe",
    "deploy.plan_model",
    "deploy.k8s_cluster",
    "deploy.k8s_manifests",
    "deploy.k8s_render",
    "deploy.k8s_yaml",
    "deploy.grafana",
    "deploy.k8s_resources",
    "bench",
    "bench.serve",
    "bench.serve_metrics",
    "bench.server_counters",
    "bench.multi_turn",
    "bench.datasets",
    "bench.plots",
    "bench.sweep",
    "bench.occupancy",
    "bench.stepped_load",
    "bench.pack_serving",
    "bench.router_start",
    # the shape rules the cluster tools size nodes with
    "model",
    "model.sharding",
    "model.weight_names",
}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _imported_names(module: str, path: Path) -> list[tuple[str, int]]:
    """(absolute dotted name, line) for each import in the file; relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.append((base, child.lineno))
                found.extend((f"{base}.{alias.name}", child.lineno) for alias in child.names)
            visit(child)

    visit(tree)
    return found


def build_graph() -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """(project edges, third-party roots) per module, each with the first line it happens on."""
    modules = project_modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    external: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for name, line in _imported_names(module, path):
            target = _resolve(name, modules)
            if target is not None:
                if target != module:
                    edges[module].setdefault(target, line)
            elif name.split(".")[0] not in ALLOWED:
                external[module].setdefault(name.split(".")[0], line)
    return edges, external


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an import name loads (longest known prefix), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _package(module: str) -> str:
    return module.split(".")[0]


def _torch_free(module: str) -> bool:
    return _package(module) in TORCH_FREE or module in TORCH_FREE_MODULES


def violations(edges, external) -> list[str]:
    found = []
    for module, targets in sorted(edges.items()):
        package = _package(module)
        for target, line in sorted(targets.items()):
            other = _package(target)
            crossing = other != package and other not in ALLOWED[package]
            if crossing and target not in ALLOWED_MODULES.get(package, ()):
                found.append(f"{module}:{line} imports {target} ({package} may not import {other})")
            elif _torch_free(module) and not _torch_free(target):
                found.append(f"{module}:{line} imports {target}, which is not torch-free")
        if _torch_free(module):
            for root, line in sorted(external[module].items()):
                if root in HEAVY:
                    found.append(f"{module}:{line} imports {root} (must load without it)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", action="store_true", help="list the cycles only")
    args = parser.parse_args(argv)
    edges, external = build_graph()
    loops = cycles(edges)
    for component in loops:
        print("cycle: " + " <-> ".join(component))
    problems = [] if args.cycles else violations(edges, external)
    for problem in problems:
        print(problem)
    print(f"{len(edges)} modules, {len(loops)} cycles, {len(problems)} crossed floors")
    return 1 if loops or problems else 0


if __name__ == "__main__":
    sys.exit(main())

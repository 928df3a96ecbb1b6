#!/usr/bin/env bash
# The README's test command: installs everything on a fresh machine, then runs the test suite,
# and the kernel tests once more on the portable (no SIMD) path and once with one thread.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
python -m ruff check . && python -m ruff format --check .
python scripts/import_graph.py  # no import cycle, no import across the floors of DESIGN.md
export DUET_CACHE_DIR="${DUET_CACHE_DIR:-$(mktemp -d)}"
python -m pytest -q tests
DUET_ISA=portable python -m pytest -q tests/native
DUET_TEST_THREADS=1 python -m pytest -q tests/native

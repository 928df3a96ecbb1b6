"""Kernel tests run once per ISA this CPU supports (down to the portable path), so a machine
without AVX-512 is covered by the same tests. DUET_ISA caps the list; DUET_TEST_THREADS sets the
kernel thread count for the session (CI also runs them with 1 thread, as the nodes run)."""

import os

import pytest

from native import ops

ISA_LEVELS = {"portable": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3, "amx": 4}


def _available_isas() -> list[str]:
    if not ops.native_available():
        return []
    from native import _C

    best = ISA_LEVELS[_C.active_isa()]
    return [name for name, level in ISA_LEVELS.items() if level <= best]


@pytest.fixture(scope="session", autouse=True)
def kernel_threads():
    threads = os.environ.get("DUET_TEST_THREADS")
    if threads:
        ops.set_num_threads(int(threads))
    yield


@pytest.fixture(params=_available_isas() or ["unavailable"])
def isa(request):
    """Selects the kernel ISA for one test and restores the best one afterwards."""
    if request.param == "unavailable":
        pytest.skip("native extension not built")
    from native import _C

    best = _C.active_isa()
    _C.set_active_isa(ISA_LEVELS[request.param])
    ops.set_native_enabled(True)
    yield request.param
    _C.set_active_isa(ISA_LEVELS[best])

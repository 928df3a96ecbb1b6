"""Builds the C++ extension `native._C` (pybind11, no torch headers: kernels take raw pointers).

Objects are compiled in parallel and only when their source (or a header in native/csrc) is newer
than the object, so editing one kernel file rebuilds one object.
"""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

HEADERS = glob.glob("native/csrc/*.h")


def _needs_recompile(obj: str, src: str) -> bool:
    if not os.path.exists(obj):
        return True
    obj_time = os.stat(obj).st_mtime
    return any(os.stat(path).st_mtime > obj_time for path in [src, *HEADERS])


ParallelCompile("DUET_BUILD_JOBS", default=0, needs_recompile=_needs_recompile).install()

extra_compile_args = [
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-fno-math-errno",
    "-Wall",
    "-Wno-unused-function",
]
extra_link_args = ["-fopenmp"]

ext = Pybind11Extension(
    "native._C",
    sorted(glob.glob("native/csrc/*.cpp")),
    include_dirs=["native/csrc"],
    depends=HEADERS,
    extra_compile_args=extra_compile_args,
    extra_link_args=extra_link_args,
    cxx_std=17,
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})

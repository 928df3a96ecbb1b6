// Runtime queries exposed to Python: CPU features, active ISA, thread count.
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>

#include "cpu_features.h"

namespace py = pybind11;

namespace duet {

void register_runtime(py::module_& m) {
  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    return std::map<std::string, bool>{
        {"avx2", f.avx2},           {"fma", f.fma},
        {"avx512f", f.avx512f},     {"avx512bw", f.avx512bw},
        {"avx512vl", f.avx512vl},   {"avx512dq", f.avx512dq},
        {"avx512_bf16", f.avx512_bf16}, {"avx512_vnni", f.avx512_vnni},
        {"avx512_vbmi", f.avx512_vbmi}, {"amx_bf16", f.amx_bf16},
        {"amx_int8", f.amx_int8},
    };
  });
  m.def("active_isa", [] { return isa_name(active_isa()); });
  m.def("set_active_isa", [](int isa) { return isa_name(set_active_isa(static_cast<Isa>(isa))); },
        "Caps the ISA (0 portable, 1 avx2, 2 avx512, 3 avx512_bf16, 4 amx); returns the one in effect.");
  m.def("set_num_threads", [](int n) { omp_set_num_threads(n > 0 ? n : 1); });
  m.def("get_num_threads", [] { return omp_get_max_threads(); });
}

}  // namespace duet

// MLA decode (placeholder while the kernel is written).
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace duet {
void register_mla_decode(py::module_& m) { (void)m; }
}  // namespace duet

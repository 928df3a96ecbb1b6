// pybind11 module `native._C`. Each op family registers itself through a `register_*` function
// declared here and defined next to its kernels; bindings only check sizes and pass pointers.
#include <pybind11/pybind11.h>

#include "cpu_features.h"

namespace py = pybind11;

namespace duet {
void register_runtime(py::module_& m);
void register_norm(py::module_& m);  // norm.cpp (rms_norm, silu_and_mul)
void register_rope(py::module_& m);
void register_topk(py::module_& m);
void register_router_logits(py::module_& m);  // router_logits.cpp (the MoE gate)
void register_membw(py::module_& m);       // membw.cpp (stream_read_probe)
void register_peak_probe(py::module_& m);  // peak_probe.cpp (peak_rate)
void register_gemm(py::module_& m);  // gemm.cpp (linear_bf16)
void register_gemm_fp8(py::module_& m);  // gemm_fp8.cpp (linear_fp8)
void register_gemm_int8(py::module_& m);  // gemm_int8.cpp (linear_int8)
void register_gemm_int4(py::module_& m);  // gemm_int4.cpp (linear_int4)
void register_moe(py::module_& m);   // moe.cpp (fused_moe_bf16)
void register_moe_int8(py::module_& m);  // moe_int8.cpp (fused_moe_int8)
void register_moe_int4(py::module_& m);  // moe_int4.cpp (fused_moe_int4)
void register_moe_fp8(py::module_& m);  // moe_fp8.cpp (fused_moe_fp8)
void register_bmm(py::module_& m);   // bmm.cpp (bmm_bf16)
void register_extend_attention(py::module_& m);  // extend_attention.cpp
void register_mla_decode(py::module_& m);        // mla_decode.cpp
void register_mla_absorbed(py::module_& m);      // mla_absorbed.cpp (mla_decode_absorbed)
void register_sampling(py::module_& m);  // sampling.cpp (race_sample, random_uniform)
void register_argmax(py::module_& m);    // argmax.cpp (argmax_rows)
void register_shm_allreduce(py::module_& m);  // shm_allreduce.cpp (ShmAllReduce)
void register_checksum(py::module_& m);  // checksum.cpp (checksum)
void register_weight_quant(py::module_& m);  // weight_quant.cpp (load-time conversions)
void register_weight_quant_int4(py::module_& m);  // weight_quant_int4.cpp (quantize_pack_int4)
}  // namespace duet

PYBIND11_MODULE(_C, m) {
  m.doc() = "duet-serve native CPU kernels";
  m.attr("__version__") = "0.1.0";
  duet::register_runtime(m);
  duet::register_norm(m);
  duet::register_rope(m);
  duet::register_topk(m);
  duet::register_router_logits(m);
  duet::register_membw(m);
  duet::register_peak_probe(m);
  duet::register_gemm(m);
  duet::register_gemm_fp8(m);
  duet::register_gemm_int8(m);
  duet::register_gemm_int4(m);
  duet::register_moe(m);
  duet::register_moe_int8(m);
  duet::register_moe_int4(m);
  duet::register_moe_fp8(m);
  duet::register_bmm(m);
  duet::register_extend_attention(m);
  duet::register_mla_decode(m);
  duet::register_mla_absorbed(m);
  duet::register_sampling(m);
  duet::register_argmax(m);
  duet::register_shm_allreduce(m);
  duet::register_checksum(m);
  duet::register_weight_quant(m);
  duet::register_weight_quant_int4(m);
}

// The MoE gate's router logits, twin of native/reference.py's router_logits:
// logits[t][e] = sum_k x[t][k] * w[e][k] in fp32, x and w bf16 or fp32 (widened exactly).
// Routing runs in fp32, as the reference checkpoints' gate does; the weight may stay in the
// checkpoint's bf16, which fp32 holds exactly, so a decode token reads half the bytes (the gate
// is cold by the time a layer routes: its read, not its arithmetic, is the cost). Sums run in 4 x 16 lanes (AVX-512) or 4 scalar
// partial sums (portable) folded at the end, so the two paths round differently in the last
// bits, as torch's kernels do among themselves.
#include <immintrin.h>
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "common.h"
#include "cpu_features.h"
#include "vec.h"

namespace py = pybind11;

namespace duet {
namespace {

template <typename T, typename W>
float dot_portable(const T* x, const W* w, int64_t k) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 4 <= k; i += 4) {
    for (int j = 0; j < 4; ++j) acc[j] += vec::to_f32(x[i + j]) * vec::to_f32(w[i + j]);
  }
  for (; i < k; ++i) acc[0] += vec::to_f32(x[i]) * vec::to_f32(w[i]);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

template <typename T, typename W>
DUET_TARGET_AVX512 float dot_avx512(const T* x, const W* w, int64_t k) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    a0 = _mm512_fmadd_ps(vec::load16(x + i, 0xffff), vec::load16(w + i, 0xffff), a0);
    a1 = _mm512_fmadd_ps(vec::load16(x + i + 16, 0xffff), vec::load16(w + i + 16, 0xffff), a1);
    a2 = _mm512_fmadd_ps(vec::load16(x + i + 32, 0xffff), vec::load16(w + i + 32, 0xffff), a2);
    a3 = _mm512_fmadd_ps(vec::load16(x + i + 48, 0xffff), vec::load16(w + i + 48, 0xffff), a3);
  }
  for (; i < k; i += 16) {
    const __mmask16 m = vec::mask16(k - i);
    a0 = _mm512_fmadd_ps(vec::load16(x + i, m), vec::load16(w + i, m), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

template <typename T, typename W>
void router_logits_impl(const T* x, int64_t x_stride, const W* w, float* out, int64_t tokens,
                        int64_t experts, int64_t k) {
  const bool avx512 = active_isa() >= Isa::kAvx512;
  // Rows of at least ~16K multiply-adds a thread: one decode token's gate (a few hundred KB
  // from DRAM) is read by both threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(k, 1));
  parallel_for(tokens * experts, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const T* xr = x + item / experts * x_stride;
      const W* wr = w + item % experts * k;
      out[item] = avx512 ? dot_avx512<T, W>(xr, wr, k) : dot_portable<T, W>(xr, wr, k);
    }
  }, grain);
}

}  // namespace

void register_router_logits(py::module_& m) {
  m.def(
      "router_logits",
      [](uintptr_t x, int64_t x_stride, int x_dtype, uintptr_t w, int w_dtype, uintptr_t out,
         int64_t tokens, int64_t experts, int64_t k) {
        if (tokens < 0 || experts < 0 || k < 0 || (tokens > 1 && x_stride < k)) {
          throw std::invalid_argument("router_logits: bad sizes or strides");
        }
        auto* o = reinterpret_cast<float*>(out);
        const auto bf16 = static_cast<int>(DType::kBFloat16);
        const auto f32 = static_cast<int>(DType::kFloat32);
        if ((x_dtype != bf16 && x_dtype != f32) || (w_dtype != bf16 && w_dtype != f32)) {
          throw std::invalid_argument("router_logits: x and w must be float32 or bfloat16");
        }
        const auto* xb = reinterpret_cast<const bf16_t*>(x);
        const auto* xf = reinterpret_cast<const float*>(x);
        const auto* wb = reinterpret_cast<const bf16_t*>(w);
        const auto* wf = reinterpret_cast<const float*>(w);
        if (x_dtype == bf16) {
          w_dtype == bf16 ? router_logits_impl(xb, x_stride, wb, o, tokens, experts, k)
                          : router_logits_impl(xb, x_stride, wf, o, tokens, experts, k);
        } else {
          w_dtype == bf16 ? router_logits_impl(xf, x_stride, wb, o, tokens, experts, k)
                          : router_logits_impl(xf, x_stride, wf, o, tokens, experts, k);
        }
      },
      py::call_guard<py::gil_scoped_release>(),
      "out[T, E] fp32 (contiguous) = x[T, K] (rows strided) @ w[E, K]^T (contiguous), x and w "
      "bf16 or fp32, fp32 sums.");
}

}  // namespace duet

// Per-token elementwise ops: RMSNorm, RMSNorm fused with the residual add, and SiLU-and-mul.
// Twins of native/reference.py's rms_norm / fused_add_rms_norm / silu_and_mul: fp32 math, and
// every intermediate the reference stores in the tensor dtype (the normalized row, the residual
// sum) is rounded the same way here, so bf16 results agree to the last bit but for summation order.
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>

#include "common.h"
#include "cpu_features.h"
#include "small_ops_simd.h"

namespace py = pybind11;

namespace duet {
namespace {

using small::from_f32;
using small::round_to;
using small::to_f32;

// Rows handed to one thread at least, so decode batches (a few rows) run inline without fork/join.
int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_len, 1)); }

// ---- portable --------------------------------------------------------------------------------

// out = w * round(s * rsqrt(mean(s^2) + eps)), s = x (or round(x + res), also written to sum).
template <typename T, bool kFused>
void rms_row_portable(const T* x, const T* res, const T* w, T* out, T* sum, int64_t d, float eps) {
  float acc = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    float s = to_f32(x[i]);
    if (kFused) {
      const T rounded = from_f32<T>(s + to_f32(res[i]));
      sum[i] = rounded;
      s = to_f32(rounded);
    }
    acc += s * s;
  }
  const float r = 1.f / std::sqrt(acc / static_cast<float>(d) + eps);
  const T* src = kFused ? sum : x;
  for (int64_t i = 0; i < d; ++i) {
    out[i] = from_f32<T>(to_f32(w[i]) * round_to<T>(to_f32(src[i]) * r));
  }
}

template <typename T>
void silu_mul_row_portable(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_f32(gate[i]);
    out[i] = from_f32<T>(g / (1.f + std::exp(-g)) * to_f32(up[i]));
  }
}

// ---- AVX-512 ---------------------------------------------------------------------------------

template <typename T, bool kFused>
DUET_TARGET_AVX512 void rms_row_avx512(const T* x, const T* res, const T* w, T* out, T* sum,
                                       int64_t d, float eps) {
  using namespace small;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = lane_mask(d - i);
    __m512 s = load16(x + i, m);
    if (kFused) {
      s = round16(_mm512_add_ps(s, load16(res + i, m)), static_cast<T*>(nullptr));
      store16(sum + i, s, m);
    }
    // Two accumulators: the adds are latency-bound otherwise.
    if ((i & 16) == 0) {
      acc0 = _mm512_fmadd_ps(s, s, acc0);
    } else {
      acc1 = _mm512_fmadd_ps(s, s, acc1);
    }
  }
  const float total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(total / static_cast<float>(d) + eps));
  const T* src = kFused ? sum : x;
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = lane_mask(d - i);
    const __m512 y = round16(_mm512_mul_ps(load16(src + i, m), r), static_cast<T*>(nullptr));
    store16(out + i, _mm512_mul_ps(load16(w + i, m), y), m);
  }
}

template <typename T>
DUET_TARGET_AVX512 void silu_mul_row_avx512(const T* gate, const T* up, T* out, int64_t n) {
  using namespace small;
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    const __m512 g = load16(gate + i, m);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
    store16(out + i, _mm512_mul_ps(silu, load16(up + i, m)), m);
  }
}

// ---- drivers ---------------------------------------------------------------------------------

template <typename T, bool kFused>
void rms_norm_impl(const T* x, int64_t x_stride, const T* res, int64_t res_stride, const T* w,
                   T* out, T* sum, int64_t rows, int64_t d, float eps) {
  const bool simd = active_isa() >= Isa::kAvx512;
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * x_stride;
      const T* rr = kFused ? res + t * res_stride : nullptr;
      T* sr = kFused ? sum + t * d : nullptr;
      if (simd) {
        rms_row_avx512<T, kFused>(xr, rr, w, out + t * d, sr, d, eps);
      } else {
        rms_row_portable<T, kFused>(xr, rr, w, out + t * d, sr, d, eps);
      }
    }
  }, row_grain(d));
}

template <typename T>
void silu_and_mul_impl(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t n) {
  const bool simd = active_isa() >= Isa::kAvx512;
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = x + t * x_stride;
      if (simd) {
        silu_mul_row_avx512<T>(gate, gate + n, out + t * n, n);
      } else {
        silu_mul_row_portable<T>(gate, gate + n, out + t * n, n);
      }
    }
  }, row_grain(n));
}

template <typename T>
const T* cptr(uintptr_t p) { return reinterpret_cast<const T*>(p); }
template <typename T>
T* mptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

void check_dtype(int dtype) {
  if (dtype != static_cast<int>(DType::kFloat32) && dtype != static_cast<int>(DType::kBFloat16)) {
    throw std::invalid_argument("small ops support float32 and bfloat16 only");
  }
}

}  // namespace

void register_norm(py::module_& m) {
  m.def(
      "rms_norm",
      [](uintptr_t x, int64_t x_stride, uintptr_t w, uintptr_t out, int64_t rows, int64_t d,
         double eps, int dtype) {
        check_dtype(dtype);
        if (dtype == static_cast<int>(DType::kBFloat16)) {
          rms_norm_impl<bf16_t, false>(cptr<bf16_t>(x), x_stride, nullptr, 0, cptr<bf16_t>(w),
                                       mptr<bf16_t>(out), nullptr, rows, d, float(eps));
        } else {
          rms_norm_impl<float, false>(cptr<float>(x), x_stride, nullptr, 0, cptr<float>(w),
                                      mptr<float>(out), nullptr, rows, d, float(eps));
        }
      },
      py::call_guard<py::gil_scoped_release>(),
      "out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps); x rows strided, w and out contiguous.");
  m.def(
      "fused_add_rms_norm",
      [](uintptr_t x, int64_t x_stride, uintptr_t res, int64_t res_stride, uintptr_t w,
         uintptr_t out, uintptr_t sum, int64_t rows, int64_t d, double eps, int dtype) {
        check_dtype(dtype);
        if (dtype == static_cast<int>(DType::kBFloat16)) {
          rms_norm_impl<bf16_t, true>(cptr<bf16_t>(x), x_stride, cptr<bf16_t>(res), res_stride,
                                      cptr<bf16_t>(w), mptr<bf16_t>(out), mptr<bf16_t>(sum), rows,
                                      d, float(eps));
        } else {
          rms_norm_impl<float, true>(cptr<float>(x), x_stride, cptr<float>(res), res_stride,
                                     cptr<float>(w), mptr<float>(out), mptr<float>(sum), rows, d,
                                     float(eps));
        }
      },
      py::call_guard<py::gil_scoped_release>(),
      "sum = x + res; out = rms_norm(sum); sum and out contiguous [rows, d].");
  m.def(
      "silu_and_mul",
      [](uintptr_t x, int64_t x_stride, uintptr_t out, int64_t rows, int64_t n, int dtype) {
        check_dtype(dtype);
        if (dtype == static_cast<int>(DType::kBFloat16)) {
          silu_and_mul_impl<bf16_t>(cptr<bf16_t>(x), x_stride, mptr<bf16_t>(out), rows, n);
        } else {
          silu_and_mul_impl<float>(cptr<float>(x), x_stride, mptr<float>(out), rows, n);
        }
      },
      py::call_guard<py::gil_scoped_release>(),
      "out[t] = silu(x[t, :n]) * x[t, n:2n]; x rows strided, out contiguous [rows, n].");
}

}  // namespace duet

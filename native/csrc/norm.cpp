// Per-token elementwise ops: RMSNorm, RMSNorm fused with the residual add, and SiLU-and-mul.
// Twins of native/reference.py's rms_norm / fused_add_rms_norm / silu_and_mul: fp32 math, and
// every intermediate the reference stores in the tensor dtype (the normalized row, the residual
// sum) is rounded the same way here, so bf16 results agree to the last bit but for summation order.
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>

#include "common.h"
#include "cpu_features.h"
#include "decode_parts.h"
#include "small_ops_simd.h"

namespace py = pybind11;

namespace duet {
namespace {

using vec::from_f32;
using vec::round_to;
using vec::to_f32;

// Rows handed to one thread at least (~64K elements: a fork/join costs a few microseconds, and one
// core nearly saturates memory bandwidth here), so decode batches run inline.
int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_len, 1));
}

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

// Loads lanes i.. of the row being normalized; the fused form first stores round(x + res).
template <class Cvt, typename T, bool kFused>
DUET_TARGET_SMALL inline __m512 rms_load(const T* x, const T* res, T* sum, int64_t i,
                                         __mmask16 m) {
  if constexpr (!kFused) {
    return vec::load16(x + i, m);
  } else {
    const __m512 s = _mm512_add_ps(vec::load16(x + i, m), vec::load16(res + i, m));
    return small::store_round16<Cvt>(sum + i, s, m);
  }
}

template <class Cvt, typename T>
DUET_TARGET_SMALL inline void rms_store(const T* src, const T* w, T* out, __m512 r, __mmask16 m) {
  const __m512 y = small::round16<Cvt, T>(_mm512_mul_ps(vec::load16(src, m), r));
  small::store16<Cvt>(out, _mm512_mul_ps(vec::load16(w, m), y), m);
}

template <class Cvt, typename T, bool kFused>
DUET_TARGET_SMALL void rms_row_avx512(const T* x, const T* res, const T* w, T* out, T* sum,
                                      int64_t d, float eps) {
  const __mmask16 all = vec::mask16(16);
  // Two accumulators: the adds are latency-bound otherwise.
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    const __m512 s0 = rms_load<Cvt, T, kFused>(x, res, sum, i, all);
    const __m512 s1 = rms_load<Cvt, T, kFused>(x, res, sum, i + 16, all);
    acc0 = _mm512_fmadd_ps(s0, s0, acc0);
    acc1 = _mm512_fmadd_ps(s1, s1, acc1);
  }
  for (; i < d; i += 16) {
    const __m512 s = rms_load<Cvt, T, kFused>(x, res, sum, i, vec::mask16(d - i));
    acc0 = _mm512_fmadd_ps(s, s, acc0);
  }
  const float total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(total / static_cast<float>(d) + eps));
  const T* src = kFused ? sum : x;
  for (i = 0; i + 16 <= d; i += 16) rms_store<Cvt, T>(src + i, w + i, out + i, r, all);
  if (i < d) rms_store<Cvt, T>(src + i, w + i, out + i, r, vec::mask16(d - i));
}

template <class Cvt, typename T>
DUET_TARGET_SMALL inline void silu_mul16(const T* gate, const T* up, T* out, __mmask16 m) {
  const __m512 g = vec::load16(gate, m);
  const __m512 e = vec::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  small::store16<Cvt>(out, _mm512_mul_ps(silu, vec::load16(up, m)), m);
}

template <class Cvt, typename T>
DUET_TARGET_SMALL void silu_mul_row_avx512(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) silu_mul16<Cvt, T>(gate + i, up + i, out + i, vec::mask16(16));
  if (i < n) silu_mul16<Cvt, T>(gate + i, up + i, out + i, vec::mask16(n - i));
}

// ---- drivers ---------------------------------------------------------------------------------

template <typename T, bool kFused>
void rms_norm_impl(const T* x, int64_t x_stride, const T* res, int64_t res_stride, const T* w,
                   T* out, int64_t out_stride, T* sum, int64_t rows, int64_t d, float eps) {
  const Isa isa = active_isa();
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * x_stride;
      const T* rr = kFused ? res + t * res_stride : nullptr;
      T* sr = kFused ? sum + t * d : nullptr;
      if (isa >= Isa::kAvx512Bf16) {
        rms_row_avx512<small::CvtAvx512Bf16, T, kFused>(xr, rr, w, out + t * out_stride, sr, d,
                                                          eps);
      } else if (isa >= Isa::kAvx512) {
        rms_row_avx512<small::CvtAvx512, T, kFused>(xr, rr, w, out + t * out_stride, sr, d, eps);
      } else {
        rms_row_portable<T, kFused>(xr, rr, w, out + t * out_stride, sr, d, eps);
      }
    }
  }, row_grain(d));
}

template <typename T>
void silu_and_mul_impl(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t n) {
  const Isa isa = active_isa();
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = x + t * x_stride;
      if (isa >= Isa::kAvx512Bf16) {
        silu_mul_row_avx512<small::CvtAvx512Bf16, T>(gate, gate + n, out + t * n, n);
      } else if (isa >= Isa::kAvx512) {
        silu_mul_row_avx512<small::CvtAvx512, T>(gate, gate + n, out + t * n, n);
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

void rms_norm_rows_bf16(const bf16_t* x, int64_t x_stride, const bf16_t* w, bf16_t* out,
                        int64_t out_stride, int64_t rows, int64_t d, float eps) {
  rms_norm_impl<bf16_t, false>(x, x_stride, nullptr, 0, w, out, out_stride, nullptr, rows, d, eps);
}

void register_norm(py::module_& m) {
  m.def(
      "rms_norm",
      [](uintptr_t x, int64_t x_stride, uintptr_t w, uintptr_t out, int64_t rows, int64_t d,
         double eps, int dtype) {
        check_dtype(dtype);
        if (dtype == static_cast<int>(DType::kBFloat16)) {
          rms_norm_impl<bf16_t, false>(cptr<bf16_t>(x), x_stride, nullptr, 0, cptr<bf16_t>(w),
                                       mptr<bf16_t>(out), d, nullptr, rows, d, float(eps));
        } else {
          rms_norm_impl<float, false>(cptr<float>(x), x_stride, nullptr, 0, cptr<float>(w),
                                      mptr<float>(out), d, nullptr, rows, d, float(eps));
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
                                      cptr<bf16_t>(w), mptr<bf16_t>(out), d, mptr<bf16_t>(sum), rows,
                                      d, float(eps));
        } else {
          rms_norm_impl<float, true>(cptr<float>(x), x_stride, cptr<float>(res), res_stride,
                                     cptr<float>(w), mptr<float>(out), d, mptr<float>(sum), rows, d,
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

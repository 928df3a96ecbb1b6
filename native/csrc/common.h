// Shared helpers of the CPU kernels: dtype tags, bf16 conversion, ISA target attributes,
// and the one place threads are used (OpenMP; the count is set through runtime.cpp).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace duet {

// Element type tags passed from Python (native/ops.py) with every raw pointer.
enum class DType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kInt8 = 5,  // INT8 W8A8 packed weights (gemm_int8.cpp)
};

using bf16_t = uint16_t;

inline float bf16_to_float(bf16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline bf16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>(bits >> 16);
}

// Per-function ISA targets: one binary carries every path and runtime dispatch picks one.
#define DUET_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DUET_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define DUET_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c")))

inline int num_threads() { return omp_get_max_threads(); }

// Calls f(begin, end) on contiguous, near-equal slices of [0, n), one per thread.
// Falls back to one inline call when n is below `grain` (a fork/join costs more than the work).
template <typename F>
inline void parallel_for(int64_t n, F&& f, int64_t grain = 1) {
  const int threads = static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, n / std::max<int64_t>(grain, 1))));
  if (threads <= 1 || n <= 1) {
    f(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    const int64_t chunk = (n + threads - 1) / threads;
    const int64_t begin = std::min<int64_t>(n, tid * chunk);
    const int64_t end = std::min<int64_t>(n, begin + chunk);
    if (begin < end) f(begin, end);
  }
}

}  // namespace duet

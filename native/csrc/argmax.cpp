// Row-wise argmax of fp32 logits, the greedy token: torch.argmax(x, -1)'s answer (the first index
// of the largest value; a NaN counts as larger than any number, so a row's first NaN wins). Twin:
// native/reference_sampling.py argmax_rows. torch's own reduction is scalar here (42 us a row of
// 32,000 on a 2-core Xeon, 0.67 ms at 32 rows); 16 lanes keep a running maximum and its index.
#include <pybind11/pybind11.h>
#include <immintrin.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "cpu_features.h"

namespace py = pybind11;

namespace duet {
namespace {

// Below this many values a fork/join costs more than the scan.
constexpr int64_t kMinParallelValues = 1 << 16;

int64_t argmax_portable(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// Lane j keeps the largest of x[j], x[j + 16], ... and its first index (a strict > keeps the
// earlier of equal values); the row's answer is the lowest index among the lanes holding the
// maximum. A NaN anywhere sends the row to the scalar scan, which returns the first one.
DUET_TARGET_AVX512 int64_t argmax_avx512(const float* x, int64_t n) {
  if (n < 16) return argmax_portable(x, n);
  __m512 best = _mm512_loadu_ps(x);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i best_index = index;
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  const __m512i step = _mm512_set1_epi32(16);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    index = _mm512_add_epi32(index, step);
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
  }
  if (nan) return argmax_portable(x, n);
  alignas(64) float lane_top[16];
  alignas(64) int32_t lane_index[16];
  _mm512_store_ps(lane_top, best);
  _mm512_store_si512(lane_index, best_index);
  float top = lane_top[0];
  int64_t result = lane_index[0];
  for (int j = 1; j < 16; ++j) {  // the largest; of equal ones, the lowest index
    if (lane_top[j] > top || (lane_top[j] == top && lane_index[j] < result)) {
      top = lane_top[j], result = lane_index[j];
    }
  }
  for (; i < n; ++i) {  // the tail, after every earlier index
    if (std::isnan(x[i])) return i;
    if (x[i] > top) top = x[i], result = i;
  }
  return result;
}

void argmax_rows(const float* x, int64_t rows, int64_t vocab, int64_t ld, int64_t* out) {
  const Isa isa = active_isa();
  parallel_tasks(rows, rows * vocab >= kMinParallelValues, [&](int64_t r) {
    const float* row = x + r * ld;
    out[r] = isa >= Isa::kAvx512 ? argmax_avx512(row, vocab) : argmax_portable(row, vocab);
  });
}

}  // namespace

void register_argmax(py::module_& m) {
  m.def(
      "argmax_rows",
      [](uintptr_t x, uintptr_t out, int64_t rows, int64_t vocab, int64_t ld,
         const std::vector<int>& tags) {
        check_dtypes("argmax_rows", tags, {{"x", DType::kFloat32}, {"out", DType::kInt64}});
        if (rows < 0 || vocab < 1 || vocab > std::numeric_limits<int32_t>::max() - 16 ||
            ld < vocab) {
          throw std::invalid_argument("argmax_rows: need rows >= 0, 1 <= vocab < 2^31 - 16 "
                                      "and a row stride >= vocab");
        }
        argmax_rows(reinterpret_cast<const float*>(x), rows, vocab, ld,
                    reinterpret_cast<int64_t*>(out));
      },
      py::call_guard<py::gil_scoped_release>(),
      "x fp32 [R, V] (row stride ld, unit stride in a row) -> out int64 [R]: torch.argmax(x, -1) "
      "(the first index of the maximum; the first NaN when a row has one).");
}

}  // namespace duet

// Interleaved (DeepSeek) rotary embedding, twin of native/reference.py's apply_rope.
//
// NOTE: layout. A rope row of R values holds R/2 pairs (x[2i], x[2i+1]); pair i of a token at
// position p rotates by the angle whose cos is cos_sin[p, i] and sin is cos_sin[p, R/2 + i].
// The AVX-512 path handles 8 pairs (16 lanes) at a time: it duplicates cos into both lanes of a
// pair, sets sin to (-s, +s), and adds x * cos to swap_pairs(x) * sin. Products and sum are kept
// as separate roundings (no FMA) so fp32 results match the reference bit for bit.
#include <pybind11/pybind11.h>

// GCC contracts a*b + c*d into an FMA in C++ by default, which changes the last bit.
#pragma GCC optimize("fp-contract=off")

#include <stdexcept>
#include <string>

#include "common.h"
#include "cpu_features.h"
#include "small_ops_simd.h"

namespace py = pybind11;

namespace duet {
namespace {

using small::from_f32;
using small::to_f32;

template <typename T>
void rope_row_portable(const T* x, T* out, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = to_f32(x[2 * i]), x1 = to_f32(x[2 * i + 1]);
    out[2 * i] = from_f32<T>(x0 * cos[i] - x1 * sin[i]);
    out[2 * i + 1] = from_f32<T>(x0 * sin[i] + x1 * cos[i]);
  }
}

template <typename T>
DUET_TARGET_AVX512 void rope_row_avx512(const T* x, T* out, const float* cos, const float* sin,
                                        int64_t half) {
  using namespace small;
  // Lane 2j and 2j+1 both read pair j; sin is negated on the even lanes.
  const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512 sign = _mm512_set_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  const int64_t r = 2 * half;
  for (int64_t i = 0; i < r; i += 16) {
    const int64_t lanes = std::min<int64_t>(16, r - i);
    const __mmask16 m = lane_mask(lanes);
    const __mmask16 mh = lane_mask(lanes / 2);
    const __m512 c = _mm512_permutexvar_ps(dup, _mm512_maskz_loadu_ps(mh, cos + i / 2));
    const __m512 s = _mm512_mul_ps(sign, _mm512_permutexvar_ps(dup, _mm512_maskz_loadu_ps(mh, sin + i / 2)));
    const __m512 v = load16(x + i, m);
    const __m512 swapped = _mm512_permute_ps(v, 0xB1);  // (x1, x0) in every pair
    store16(out + i, _mm512_add_ps(_mm512_mul_ps(v, c), _mm512_mul_ps(swapped, s)), m);
  }
}

// Row `j` of token t: j < heads are the query heads, j == heads is the key.
template <typename T>
void apply_rope_impl(const T* q, int64_t q_tok_stride, int64_t q_head_stride, const T* k,
                     int64_t k_tok_stride, const int64_t* positions, const float* cos_sin,
                     int64_t max_pos, T* q_out, T* k_out, int64_t tokens, int64_t heads,
                     int64_t r) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (positions[t] < 0 || positions[t] >= max_pos) {
      throw std::out_of_range("apply_rope: position " + std::to_string(positions[t]) +
                              " outside the cos/sin table of " + std::to_string(max_pos) + " rows");
    }
  }
  const int64_t half = r / 2;
  const bool simd = active_isa() >= Isa::kAvx512;
  const int64_t rows = tokens * (heads + 1);
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / (heads + 1), j = row % (heads + 1);
      const float* cos = cos_sin + positions[t] * r;
      const T* src = j < heads ? q + t * q_tok_stride + j * q_head_stride : k + t * k_tok_stride;
      T* dst = j < heads ? q_out + (t * heads + j) * r : k_out + t * r;
      if (simd) {
        rope_row_avx512<T>(src, dst, cos, cos + half, half);
      } else {
        rope_row_portable<T>(src, dst, cos, cos + half, half);
      }
    }
  }, std::max<int64_t>(1, 16384 / std::max<int64_t>(r, 1)));
}

}  // namespace

void register_rope(py::module_& m) {
  m.def(
      "apply_rope",
      [](uintptr_t q, int64_t q_tok_stride, int64_t q_head_stride, uintptr_t k,
         int64_t k_tok_stride, uintptr_t positions, uintptr_t cos_sin, int64_t max_pos,
         uintptr_t q_out, uintptr_t k_out, int64_t tokens, int64_t heads, int64_t r, int dtype) {
        if (r % 2 != 0) throw std::invalid_argument("apply_rope: rope dim must be even");
        const auto* pos = reinterpret_cast<const int64_t*>(positions);
        const auto* cs = reinterpret_cast<const float*>(cos_sin);
        if (dtype == static_cast<int>(DType::kBFloat16)) {
          apply_rope_impl<bf16_t>(reinterpret_cast<const bf16_t*>(q), q_tok_stride, q_head_stride,
                                  reinterpret_cast<const bf16_t*>(k), k_tok_stride, pos, cs,
                                  max_pos, reinterpret_cast<bf16_t*>(q_out),
                                  reinterpret_cast<bf16_t*>(k_out), tokens, heads, r);
        } else if (dtype == static_cast<int>(DType::kFloat32)) {
          apply_rope_impl<float>(reinterpret_cast<const float*>(q), q_tok_stride, q_head_stride,
                                 reinterpret_cast<const float*>(k), k_tok_stride, pos, cs, max_pos,
                                 reinterpret_cast<float*>(q_out), reinterpret_cast<float*>(k_out),
                                 tokens, heads, r);
        } else {
          throw std::invalid_argument("apply_rope supports float32 and bfloat16 only");
        }
      },
      py::call_guard<py::gil_scoped_release>(),
      "Rotates q [T, H, R] (strided) and k [T, R] (strided) into contiguous q_out, k_out; "
      "positions int64 [T], cos_sin fp32 [max_pos, R] contiguous.");
}

}  // namespace duet

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
#include "decode_parts.h"
#include "small_ops_simd.h"

namespace py = pybind11;

namespace duet {
namespace {

using vec::from_f32;
using vec::to_f32;

template <typename T>
void rope_row_portable(const T* x, T* out, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = to_f32(x[2 * i]), x1 = to_f32(x[2 * i + 1]);
    out[2 * i] = from_f32<T>(x0 * cos[i] - x1 * sin[i]);
    out[2 * i + 1] = from_f32<T>(x0 * sin[i] + x1 * cos[i]);
  }
}

// One token: H query rows (strided) and the key row, each [R], into contiguous outputs.
template <typename T>
void rope_token_portable(const T* q, int64_t q_head_stride, const T* k, T* q_out,
                         int64_t qo_head_stride, T* k_out, const float* cos, const float* sin,
                         int64_t heads, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    rope_row_portable<T>(q + h * q_head_stride, q_out + h * qo_head_stride, cos, sin, half);
  }
  rope_row_portable<T>(k, k_out, cos, sin, half);
}

// 8 pairs: dst = src * cos_lanes + swap_pairs(src) * signed_sin_lanes.
template <class Cvt, typename T>
DUET_TARGET_SMALL inline void rotate16(const T* src, T* dst, __m512 c, __m512 s, __mmask16 m) {
  const __m512 v = vec::load16(src, m);
  const __m512 swapped = _mm512_permute_ps(v, 0xB1);  // (x1, x0) in every pair
  small::store16<Cvt>(dst, _mm512_add_ps(_mm512_mul_ps(v, c), _mm512_mul_ps(swapped, s)), m);
}

template <class Cvt, typename T>
DUET_TARGET_SMALL void rope_token_avx512(const T* q, int64_t q_head_stride, const T* k, T* q_out,
                                         int64_t qo_head_stride, T* k_out, const float* cos,
                                         const float* sin, int64_t heads, int64_t half) {
  // Lane 2j and 2j+1 both read pair j; sin is negated on the even lanes.
  const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512 sign = _mm512_set_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  const int64_t r = 2 * half;
  // Chunk-major: the cos/sin lanes of a chunk are built once and reused by every head.
  for (int64_t i = 0; i < r; i += 16) {
    const int64_t lanes = std::min<int64_t>(16, r - i);
    const __mmask16 m = vec::mask16(lanes);
    const __mmask16 mh = vec::mask16(lanes / 2);
    const __m512 c = _mm512_permutexvar_ps(dup, _mm512_maskz_loadu_ps(mh, cos + i / 2));
    const __m512 s =
        _mm512_mul_ps(sign, _mm512_permutexvar_ps(dup, _mm512_maskz_loadu_ps(mh, sin + i / 2)));
    for (int64_t h = 0; h < heads; ++h) {
      rotate16<Cvt>(q + h * q_head_stride + i, q_out + h * qo_head_stride + i, c, s, m);
    }
    rotate16<Cvt>(k + i, k_out + i, c, s, m);
  }
}

template <typename T>
void apply_rope_impl(const T* q, int64_t q_tok_stride, int64_t q_head_stride, const T* k,
                     int64_t k_tok_stride, const int64_t* positions, const float* cos_sin,
                     int64_t max_pos, T* q_out, int64_t qo_tok_stride, int64_t qo_head_stride,
                     T* k_out, int64_t ko_tok_stride, int64_t tokens, int64_t heads, int64_t r) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (positions[t] < 0 || positions[t] >= max_pos) {
      throw std::out_of_range("apply_rope: position " + std::to_string(positions[t]) +
                              " outside the cos/sin table of " + std::to_string(max_pos) + " rows");
    }
  }
  const int64_t half = r / 2;
  const Isa isa = active_isa();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>((heads + 1) * r, 1));
  parallel_for(tokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + positions[t] * r;
      const T* qt = q + t * q_tok_stride;
      const T* kt = k + t * k_tok_stride;
      T* qo = q_out + t * qo_tok_stride;
      T* ko = k_out + t * ko_tok_stride;
      if (isa >= Isa::kAvx512Bf16) {
        rope_token_avx512<small::CvtAvx512Bf16, T>(qt, q_head_stride, kt, qo, qo_head_stride, ko,
                                                   cos, cos + half, heads, half);
      } else if (isa >= Isa::kAvx512) {
        rope_token_avx512<small::CvtAvx512, T>(qt, q_head_stride, kt, qo, qo_head_stride, ko, cos,
                                               cos + half, heads, half);
      } else {
        rope_token_portable<T>(qt, q_head_stride, kt, qo, qo_head_stride, ko, cos, cos + half,
                               heads, half);
      }
    }
  }, grain);
}

}  // namespace

void apply_rope_bf16(const RopeArgs& a) {
  apply_rope_impl<bf16_t>(a.q, a.q_tok, a.q_head, a.k, a.k_tok, a.positions, a.cos_sin, a.max_pos,
                          a.q_out, a.qo_tok, a.qo_head, a.k_out, a.ko_tok, a.tokens, a.heads, a.r);
}

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
                                  max_pos, reinterpret_cast<bf16_t*>(q_out), heads * r, r,
                                  reinterpret_cast<bf16_t*>(k_out), r, tokens, heads, r);
        } else if (dtype == static_cast<int>(DType::kFloat32)) {
          apply_rope_impl<float>(reinterpret_cast<const float*>(q), q_tok_stride, q_head_stride,
                                 reinterpret_cast<const float*>(k), k_tok_stride, pos, cs, max_pos,
                                 reinterpret_cast<float*>(q_out), heads * r, r,
                                 reinterpret_cast<float*>(k_out), r, tokens, heads, r);
        } else {
          throw std::invalid_argument("apply_rope supports float32 and bfloat16 only");
        }
      },
      py::call_guard<py::gil_scoped_release>(),
      "Rotates q [T, H, R] (strided) and k [T, R] (strided) into contiguous q_out, k_out; "
      "positions int64 [T], cos_sin fp32 [max_pos, R] contiguous.");
}

}  // namespace duet

// Helpers of the small per-token ops (norm.cpp, rope.cpp, topk.cpp): element access for fp32 and
// bf16 in scalar code, and 16-lane fp32 vectors loaded from / stored to either type with AVX-512.
// Callers of the vector helpers carry DUET_TARGET_SMALL too.
#pragma once

#include <immintrin.h>

// GCC 12 flags the deliberately undefined vectors inside its AVX-512 intrinsics (`__Y = __Y`)
// when they are inlined into per-function-target code; silence that false positive here.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.h"

namespace duet {
namespace small {

// ---- scalar ----------------------------------------------------------------------------------

inline float to_f32(float v) { return v; }
inline float to_f32(bf16_t v) { return bf16_to_float(v); }

template <typename T>
inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) {
  return v;
}
template <>
inline bf16_t from_f32<bf16_t>(float v) {
  return float_to_bf16(v);
}

// Rounds through T and back: what storing an intermediate in the tensor dtype does in torch.
template <typename T>
inline float round_to(float v) {
  return to_f32(from_f32<T>(v));
}

// ---- AVX-512, 16 fp32 lanes ------------------------------------------------------------------
//
// NOTE: every vector helper and kernel carries the AVX512_BF16 target so that one template body
// serves both ISA levels; the `Cvt` policy decides whether vcvtneps2bf16 is used (kBf16Insn) or
// the integer rounding sequence. Instantiations with CvtAvx512 use no BF16/VNNI intrinsic, and
// GCC 12 emits those instructions only for the intrinsics, so they run on plain AVX-512 CPUs.
#define DUET_TARGET_SMALL DUET_TARGET_AVX512_BF16

struct CvtAvx512 {
  static constexpr bool kBf16Insn = false;
};
struct CvtAvx512Bf16 {
  static constexpr bool kBf16Insn = true;
};

// Mask of the first n (0..16) lanes.
inline __mmask16 lane_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

DUET_TARGET_SMALL inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
DUET_TARGET_SMALL inline __m512 load16(const bf16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 bits rounded to nearest even at bit 16 (bf16 in the high half); NaN kept a quiet NaN.
DUET_TARGET_SMALL inline __m512i round_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, lsb), _mm512_set1_epi32(0x7fff));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
}

// fp32 -> 16 bf16, round to nearest even as torch does.
template <class Cvt>
DUET_TARGET_SMALL inline __m256i cvt_bf16(__m512 v) {
  if constexpr (Cvt::kBf16Insn) {
    return (__m256i)_mm512_cvtneps_pbh(v);
  } else {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(v), 16));
  }
}

template <class Cvt>
DUET_TARGET_SMALL inline void store16(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
template <class Cvt>
DUET_TARGET_SMALL inline void store16(bf16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, cvt_bf16<Cvt>(v));
}

// Stores v in T and returns the stored values as fp32 (one conversion for both).
template <class Cvt, typename T>
DUET_TARGET_SMALL inline __m512 store_round16(T* p, __m512 v, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, m, v);
    return v;
  } else {
    const __m256i h = cvt_bf16<Cvt>(v);
    _mm256_mask_storeu_epi16(p, m, h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Rounds each lane through T and back, as storing an intermediate in the tensor dtype does.
template <class Cvt, typename T>
DUET_TARGET_SMALL inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (Cvt::kBf16Insn) {
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  } else {
    return _mm512_castsi512_ps(_mm512_and_si512(round_bits(v), _mm512_set1_epi32(-65536)));
  }
}

// exp(x) within ~2 ulp: 2^n * p(r) with r = x - n ln2 (Cody-Waite split), degree-6 polynomial,
// scalef for the power of two so large |x| saturates to 0 / inf as expf does.
DUET_TARGET_SMALL inline __m512 exp16(__m512 x) {
  // Constant first: min/max return their second operand on NaN, so NaN propagates.
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(88.7228f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace small
}  // namespace duet

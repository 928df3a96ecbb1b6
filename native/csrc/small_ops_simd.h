// The small per-token ops' layer over vec.h (norm.cpp, rope.cpp, topk.cpp): the `Cvt` policy
// that picks how fp32 lanes become bf16 at each AVX-512 level, and the stores and roundings built
// on it.
// Callers of the vector helpers carry DUET_TARGET_SMALL too.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "common.h"
#include "vec.h"

namespace duet {
namespace small {

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

// fp32 -> 16 bf16, round to nearest even as torch does (vec.h: the instruction form flushes
// denormal inputs to zero).
template <class Cvt>
DUET_TARGET_SMALL inline __m256i cvt_bf16(__m512 v) {
  if constexpr (Cvt::kBf16Insn) {
    return vec::f32x16_to_bf16_insn(v);
  } else {
    return vec::f32x16_to_bf16(v);
  }
}

template <class Cvt>
DUET_TARGET_SMALL inline void store16(float* p, __m512 v, __mmask16 m) {
  vec::store16(p, v, m);
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
    return vec::bf16x16_to_f32(h);
  }
}

// Rounds each lane through T and back, as storing an intermediate in the tensor dtype does.
template <class Cvt, typename T>
DUET_TARGET_SMALL inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (Cvt::kBf16Insn) {
    return vec::bf16x16_to_f32(vec::f32x16_to_bf16_insn(v));
  } else {
    const __m512i high_half = _mm512_set1_epi32(-65536);
    return _mm512_castsi512_ps(_mm512_and_si512(vec::round_bf16_bits(v), high_half));
  }
}

}  // namespace small
}  // namespace duet

// The one copy of the element and vector helpers the CPU kernels share: bf16 <-> fp32 (scalar and
// 16 lanes), lane masks, masked 16-lane loads and stores of fp32 or bf16 memory, the VNNI pair
// interleave, and exp.
//
// NOTE: targets. The AVX-512 helpers carry DUET_TARGET_AVX512, the smallest target any vector
// caller has; GCC inlines a function only into callers whose target is a superset of its own, so
// they inline into DUET_TARGET_AVX512 and DUET_TARGET_AVX512_BF16 (= DUET_TARGET_SMALL) callers
// alike. The one helper that needs AVX512_BF16 (f32x16_to_bf16_insn) says so and may only be
// called from such callers. The scalar helpers carry no target: portable paths use them on any
// CPU.
#pragma once

#include <immintrin.h>

// GCC 12's intrinsic headers self-initialize "undefined" vectors (`__Y = __Y`), which -Wall flags
// once they are inlined into per-function-target code at -O3: a known false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cstdint>
#include <cstring>

#include "common.h"

namespace duet {
namespace vec {

// ---- scalar bf16 <-> fp32 --------------------------------------------------------------------

// A bf16 is the high half of an fp32: widening is exact.
inline float bf16_to_f32(bf16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even at bit 16, as torch's .to(torch.bfloat16) does: add 0x7fff plus the
// lowest kept bit, then truncate (a carry out of the mantissa rounds up to the next binade, and
// the largest finite values round to inf). NaN is not rounded (the add could carry it into inf
// or, with the sign bit, into -0): it keeps its sign and top payload with the quiet bit set.
inline bf16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>(bits >> 16);
}

// Element access in dtype-generic scalar code (T = float or bf16_t).
inline float to_f32(float v) { return v; }
inline float to_f32(bf16_t v) { return bf16_to_f32(v); }

template <typename T>
inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) {
  return v;
}
template <>
inline bf16_t from_f32<bf16_t>(float v) {
  return f32_to_bf16(v);
}

// Rounds through T and back: what storing an intermediate in the tensor dtype does in torch.
template <typename T>
inline float round_to(float v) {
  return to_f32(from_f32<T>(v));
}

// ---- lane masks ------------------------------------------------------------------------------

// Masks of the first n lanes: all of them for n >= the width, none for n <= 0 (so a loop's
// `remaining` count may run past the end without a shift by a negative amount).
inline __mmask16 mask16(int64_t n) {
  if (n <= 0) return 0;
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}
inline __mmask32 mask32(int64_t n) {
  if (n <= 0) return 0;
  return n >= 32 ? static_cast<__mmask32>(0xffffffffu) : static_cast<__mmask32>((1u << n) - 1u);
}

// ---- AVX-512: 16 bf16 <-> 16 fp32 ------------------------------------------------------------

// 16 bf16 -> 16 fp32 (exact).
DUET_TARGET_AVX512 inline __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The fp32 bits of each lane rounded as f32_to_bf16 rounds (the bf16 in the high half, the low
// half garbage): nearest even, NaN kept a quiet NaN. Denormals round like any other value.
DUET_TARGET_AVX512 inline __m512i round_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, lsb), _mm512_set1_epi32(0x7fff));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
}

// 16 fp32 -> 16 bf16, bit for bit what f32_to_bf16 gives per lane.
DUET_TARGET_AVX512 inline __m256i f32x16_to_bf16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(v), 16));
}

// The same with vcvtneps2bf16 (AVX512_BF16 callers only): one instruction, also nearest even
// with NaN quieted, but it treats fp32 denormal inputs as zero, so results differ from
// f32x16_to_bf16 on |v| < 2^-126. Used where the kernel's reference tolerates that (attention
// probabilities, the small ops' bf16 path, which has always used it).
DUET_TARGET_AVX512_BF16 inline __m256i f32x16_to_bf16_insn(__m512 v) {
  return (__m256i)_mm512_cvtneps_pbh(v);
}

// ---- AVX-512: masked 16-lane loads and stores ------------------------------------------------

// 16 lanes of fp32 or bf16 memory as fp32; lanes outside m read as 0 and touch no memory.
DUET_TARGET_AVX512 inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
DUET_TARGET_AVX512 inline __m512 load16(const bf16_t* p, __mmask16 m) {
  return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}

// Stores the lanes in m as fp32, or as bf16 rounded by f32x16_to_bf16.
DUET_TARGET_AVX512 inline void store16(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
DUET_TARGET_AVX512 inline void store16(bf16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, f32x16_to_bf16(v));
}

// ---- AVX-512: VNNI pairs --------------------------------------------------------------------

// Interleaves the 16-bit elements of two rows a, b (32 each) into the pairs vdpbf16ps multiplies
// (the packed layouts of gemm_kernels.h and the attention tiles): lo = (a0 b0 a1 b1 .. a15 b15),
// hi = (a16 b16 .. a31 b31).
DUET_TARGET_AVX512 inline void interleave_pairs(__m512i a, __m512i b, __m512i* lo, __m512i* hi) {
  alignas(64) static const uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                               37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                               11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                               53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                               27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  *lo = _mm512_permutex2var_epi16(a, _mm512_load_si512(kLo), b);
  *hi = _mm512_permutex2var_epi16(a, _mm512_load_si512(kHi), b);
}

// ---- AVX-512: exp ----------------------------------------------------------------------------
//
// Both forms compute 2^n * p(r) with n = round(x / ln2) and r = x - n ln2, |r| <= ln2 / 2: ln2
// is split in two (Cody-Waite: 0.693359375 has few enough bits that n * it is exact) so r
// keeps full precision, and scalef applies 2^n without forming the exponent bits by hand (it
// goes to 0 or inf past the fp32 range instead of wrapping).

// p(r) ~ e^r on |r| <= ln2 / 2. Degree 6: the Cephes expf minimax coefficients, within ~2 ulp of
// expf over the whole range. Degree 4: the Taylor polynomial, within ~4e-5 relative, for values
// that are rounded to bf16 (8 bits) right after.
template <int Degree>
DUET_TARGET_AVX512 inline __m512 exp16_reduced(__m512 x) {
  static_assert(Degree == 4 || Degree == 6, "exp polynomials of degree 4 and 6 exist");
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p;
  if constexpr (Degree == 6) {
    p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  } else {
    p = _mm512_set1_ps(1.0f / 24);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  }
  return _mm512_scalef_ps(p, n);
}

// e^x for any x, within ~2 ulp of expf: NaN stays NaN; below -104 the result is 0 (as expf
// underflows there); x is capped at 88.7228 (just below ln FLT_MAX), so large x gives ~3.4e38
// rather than inf: its callers feed it to 1 / (1 + e) (sigmoid, SiLU) or give it x - max <= 0
// (softmax), where that is as good as inf.
DUET_TARGET_AVX512 inline __m512 exp16(__m512 x) {
  // Constant first: min/max return their second operand on NaN, so NaN propagates.
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(88.7228f), x));
  return exp16_reduced<6>(x);
}

// e^x for softmax arguments x = s - max <= 0 (no upper clamp: x > 0 is outside the contract).
// x is floored at -80, so -inf (and NaN, which max turns into the floor) give ~1.8e-35 instead
// of 0 or NaN: the arithmetic never sees -inf, and callers zero masked lanes explicitly. Degree
// 6 on the fp32 path; degree 4 where the probabilities are rounded to bf16 (see exp16_reduced).
// Same polynomials and reduction as exp16: on [-80, 0] degree 6 gives exp16's bits.
template <int Degree>
DUET_TARGET_AVX512 inline __m512 exp16_nonpos(__m512 x) {
  return exp16_reduced<Degree>(_mm512_max_ps(x, _mm512_set1_ps(-80.0f)));
}

}  // namespace vec
}  // namespace duet

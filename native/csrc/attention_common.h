// Helpers shared by the attention kernels (extend_attention.cpp, mla_decode.cpp): per-thread
// scratch, and AVX-512 building blocks (fast exp, 16x16 32-bit transpose, bf16 <-> fp32).
// Every AVX-512 helper carries DUET_TARGET_AVX512, so callers need that target or a superset.
#pragma once

// GCC 12's intrinsic headers self-initialize "undefined" vectors, which -Wall flags at -O3.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "common.h"

namespace duet {
namespace attn {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Per-thread scratch that outlives a call: OpenMP threads persist, so after the first call a
// kernel neither allocates nor page-faults. `slot` separates buffers that are alive together
// (the calling thread is also a worker of the parallel region).
inline char* thread_scratch(int slot, size_t bytes) {
  struct Buffer {
    char* data = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffers[2];
  Buffer& b = buffers[slot];
  if (b.size < bytes) {
    std::free(b.data);
    b.size = static_cast<size_t>(round_up(static_cast<int64_t>(bytes), 4096));
    b.data = static_cast<char*>(std::aligned_alloc(64, b.size));
    if (b.data == nullptr) throw std::bad_alloc();
  }
  return b.data;
}

// Carves 64-byte aligned arrays out of one scratch buffer. With a null base it only adds up the
// sizes: run a layout once that way, then allocate used() bytes and run it again for real.
class Arena {
 public:
  explicit Arena(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += round_up(count * static_cast<int64_t>(sizeof(T)), 64);
    return p;
  }
  int64_t used() const { return offset_; }

 private:
  char* base_;
  int64_t offset_ = 0;
};

// Bytes one Arena::take<T>(count) uses.
template <typename T>
inline int64_t arena_bytes(int64_t count) {
  return round_up(count * static_cast<int64_t>(sizeof(T)), 64);
}

template <typename T>
inline float to_float(T v);
template <>
inline float to_float<float>(float v) {
  return v;
}
template <>
inline float to_float<bf16_t>(bf16_t v) {
  return bf16_to_float(v);
}

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) {
  return v;
}
template <>
inline bf16_t from_float<bf16_t>(float v) {
  return float_to_bf16(v);
}

// ---- AVX-512 ---------------------------------------------------------------------------------

// Masks of the first n lanes (n <= 0: none).
inline __mmask16 mask16(int64_t n) {
  if (n <= 0) return 0;
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}
inline __mmask32 mask32(int64_t n) {
  if (n <= 0) return 0;
  return n >= 32 ? static_cast<__mmask32>(0xffffffffu) : static_cast<__mmask32>((1u << n) - 1u);
}

// exp(x) for x <= 0 (softmax arguments): x = n*ln2 + r, |r| <= ln2/2, exp(r) by a polynomial,
// 2^n applied with scalef. Degree 6 is within ~2 ulp (fp32 path); degree 4 within ~4e-5 relative,
// far below the bf16 rounding of the probabilities it feeds. Arguments below -80 give ~2e-35
// instead of 0 (callers zero masked lanes explicitly), which keeps -inf out of the arithmetic.
template <int Degree>
DUET_TARGET_AVX512 inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-80.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p;
  if constexpr (Degree >= 6) {
    // Cephes expf coefficients.
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

// 16 bf16 (masked, zero-filled) -> 16 fp32.
DUET_TARGET_AVX512 inline __m512 load_bf16_as_f32(const bf16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

DUET_TARGET_AVX512 inline __m512 load_f32(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
DUET_TARGET_AVX512 inline __m512 load_f32(const bf16_t* p, __mmask16 m) {
  return load_bf16_as_f32(p, m);
}

// 16 fp32 -> 16 bf16 bits, round to nearest even (NaN is not special-cased: attention outputs
// are finite for finite inputs).
DUET_TARGET_AVX512 inline __m256i f32_to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

DUET_TARGET_AVX512 inline void store_f32(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
DUET_TARGET_AVX512 inline void store_f32(bf16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, f32_to_bf16_bits(v));
}

// In-place transpose of a 16x16 matrix of 32-bit elements held one row per register.
DUET_TARGET_AVX512 inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + j], 128-bit lane L = column 4L + j of rows 4i .. 4i + 3.
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i x1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    r[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
}

// Interleaves the 16-bit elements of two rows a, b (32 each) into VNNI pairs:
// lo = (a0 b0 a1 b1 .. a15 b15), hi = (a16 b16 .. a31 b31).
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

}  // namespace attn
}  // namespace duet

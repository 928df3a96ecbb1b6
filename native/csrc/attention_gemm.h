// Register-tiled GEMM blocks for the attention kernels: C[M, 16*Nvec] (+)= A[M, K] * B[K, 16*Nvec].
//
// NOTE: layouts. B is "packed": row k holds the 16*Nvec output columns contiguously (b + k*b_ks),
// so one zmm load gives 16 columns. A is read one element at a time and broadcast, at
// a + r*a_rs + k*a_ks, so A may be row-major (a_ks = 1) or transposed (a_rs = 1) without a copy.
// In the bf16 form (vdpbf16ps) one "element" is a VNNI pair: A holds (x[2k], x[2k+1]) as one
// 32-bit word, B row k holds for every column j the pair (y[2k][j], y[2k+1][j]), and K counts
// pairs.
//
// With row_scale null, C = A*B; otherwise C = C*row_scale[r] + A*B (the online-softmax rescale
// of the output accumulator, fused into the load of the tile). M must be a multiple of R; the
// tile is R x C vectors with R*C = 24 accumulators, so R in {4, 6, 8, 12, 24}.
//
// An optional LinePrefetch hands the tiles a list of cache lines to prefetch, one every
// `k_steps_per_line` k steps:
// a kernel streaming scattered rows (mla_decode) pulls the next rows in while it computes,
// paced by the arithmetic instead of in one burst that would stall the core.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common.h"

namespace duet {
namespace attn {

struct LinePrefetch {
  const char* const* next = nullptr;
  const char* const* end = nullptr;
  int64_t k_steps_per_line = 1;  // a power of two
};

inline __attribute__((always_inline)) void prefetch_one(LinePrefetch* pf) {
  if (pf->next != pf->end) __builtin_prefetch(*pf->next++, 0, 2);
}

inline __attribute__((always_inline)) void prefetch_at(LinePrefetch* pf, int64_t k) {
  if (pf != nullptr && (k & (pf->k_steps_per_line - 1)) == 0) prefetch_one(pf);
}

// One R x C tile of fp32 FMAs.
template <int R, int C>
DUET_TARGET_AVX512 inline __attribute__((always_inline)) void tile_f32(
    const float* a, int64_t a_rs, int64_t a_ks, const float* b, int64_t b_ks, int64_t k_count,
    float* c, int64_t ldc, const float* row_scale, LinePrefetch* pf) {
  __m512 acc[R][C];
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      acc[r][j] = row_scale ? _mm512_mul_ps(_mm512_loadu_ps(c + r * ldc + 16 * j),
                                            _mm512_set1_ps(row_scale[r]))
                            : _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < k_count; ++k) {
    prefetch_at(pf, k);
    __m512 bv[C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) bv[j] = _mm512_loadu_ps(b + k * b_ks + 16 * j);
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * a_rs + k * a_ks]);
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[r][j] = _mm512_fmadd_ps(av, bv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
  }
}

// One R x C tile of bf16 pair dot products (vdpbf16ps), fp32 accumulation.
template <int R, int C>
DUET_TARGET_AVX512_BF16 inline __attribute__((always_inline)) void tile_bf16(
    const uint32_t* a, int64_t a_rs, int64_t a_ks, const uint32_t* b, int64_t b_ks, int64_t k_count,
    float* c, int64_t ldc, const float* row_scale, LinePrefetch* pf) {
  __m512 acc[R][C];
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      acc[r][j] = row_scale ? _mm512_mul_ps(_mm512_loadu_ps(c + r * ldc + 16 * j),
                                            _mm512_set1_ps(row_scale[r]))
                            : _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < k_count; ++k) {
    prefetch_at(pf, k);
    __m512bh bv[C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + k * b_ks + 16 * j);
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * a_rs + k * a_ks]));
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
    }
  }
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
  }
}

// Calls the R x cols tile, cols in 1 .. C (compile-time tile sizes for the column tail).
template <int R, int C>
DUET_TARGET_AVX512 void tile_any(int64_t cols, const float* a, int64_t a_rs, int64_t a_ks,
                                 const float* b, int64_t b_ks, int64_t k_count, float* c,
                                 int64_t ldc, const float* row_scale, LinePrefetch* pf = nullptr) {
  if constexpr (C > 1) {
    if (cols < C) {
      return tile_any<R, C - 1>(cols, a, a_rs, a_ks, b, b_ks, k_count, c, ldc, row_scale, pf);
    }
  }
  tile_f32<R, C>(a, a_rs, a_ks, b, b_ks, k_count, c, ldc, row_scale, pf);
}

template <int R, int C>
DUET_TARGET_AVX512_BF16 void tile_any(int64_t cols, const uint32_t* a, int64_t a_rs, int64_t a_ks,
                                      const uint32_t* b, int64_t b_ks, int64_t k_count, float* c,
                                      int64_t ldc, const float* row_scale,
                                      LinePrefetch* pf = nullptr) {
  if constexpr (C > 1) {
    if (cols < C) {
      return tile_any<R, C - 1>(cols, a, a_rs, a_ks, b, b_ks, k_count, c, ldc, row_scale, pf);
    }
  }
  tile_bf16<R, C>(a, a_rs, a_ks, b, b_ks, k_count, c, ldc, row_scale, pf);
}

// C[m, 16*n_vec] (+)= A * B; A and B are float (FMA) or uint32_t VNNI pairs (vdpbf16ps).
// Column panels of 24/R vectors outside (the B panel stays in L1), R-row tiles inside.
template <int R, typename T>
void gemm(int64_t m, int64_t n_vec, int64_t k_count, const T* a, int64_t a_rs, int64_t a_ks,
          const T* b, int64_t b_ks, float* c, int64_t ldc, const float* row_scale,
          LinePrefetch* pf = nullptr) {
  constexpr int kC = 24 / R;
  for (int64_t j0 = 0; j0 < n_vec; j0 += kC) {
    const int64_t cols = std::min<int64_t>(kC, n_vec - j0);
    for (int64_t r0 = 0; r0 < m; r0 += R) {
      tile_any<R, kC>(cols, a + r0 * a_rs, a_rs, a_ks, b + 16 * j0, b_ks, k_count,
                      c + r0 * ldc + 16 * j0, ldc, row_scale ? row_scale + r0 : nullptr, pf);
    }
  }
}

}  // namespace attn
}  // namespace duet

// The bf16 register-tile GEMM shared by `linear` (gemm.cpp) and the fused MoE (moe.cpp): weights
// prepacked once (layout below), activations addressed by row pointers (so MoE can gather tokens
// without copying), fp32 results into a small tile that each caller finishes with its own epilogue.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "common.h"
#include "cpu_features.h"

namespace duet {

// NOTE: packed weight layout (VNNI-2 in blocks of 32 output columns).
// A weight W [N, K] becomes ceil(N/32) blocks, each [ceil(K/2)][32][2] bf16 and contiguous:
// element (kp, j, t) of block nb is W[32*nb + j][2*kp + t], zero past the last row or column.
// One k-pair row of a block is 64 bf16 = two zmm; lane j of the first (second) zmm holds the pair
// (W[n][2kp], W[n][2kp+1]) of column n = 32*nb + j (+16), which is what vdpbf16ps multiplies with
// the broadcast activation pair (x[2kp], x[2kp+1]). A thread owning a range of blocks therefore
// streams one contiguous region (GEMV), and a K range of a block is a contiguous slice (GEMM).
// The Python side (native/_gemm_ops.py) builds this layout with a pad + permute.
constexpr int64_t kPackBlockN = 32;

inline int64_t pack_k_pairs(int64_t k) { return (k + 1) / 2; }
inline int64_t pack_num_blocks(int64_t n) { return (n + kPackBlockN - 1) / kPackBlockN; }
// bf16 elements of one packed block of a weight with K inputs.
inline int64_t pack_block_elems(int64_t k) { return pack_k_pairs(k) * 2 * kPackBlockN; }

// Register tile limits: rows x (2 zmm per block) accumulators stay within 24 of the 32 zmm.
constexpr int kTileMaxRows = 6;
constexpr int kTileMaxBlocks = 4;
inline int tile_max_blocks(int rows) { return std::min(kTileMaxBlocks, 12 / std::max(rows, 1)); }

// `rows` rows are cut into tile_count(rows) tiles of near-equal height: tile i is rows
// [tile_begin(i, rows), tile_begin(i + 1, rows)). 7 rows -> 3 + 4, not 6 + 1: a 1-row tile has
// too few accumulators to hide the vdpbf16ps latency.
inline int64_t tile_count(int64_t rows) { return (rows + kTileMaxRows - 1) / kTileMaxRows; }
inline int64_t tile_begin(int64_t i, int64_t rows) { return i * rows / tile_count(rows); }

// One register tile:
//   c[r][32*i + j] (+)= sum_{kp < k_pairs, t < 2} a_rows[r][2kp + t] * b_blocks[i][kp][j][t]
// for r < rows <= 6, i < num_blocks <= tile_max_blocks(rows), j < 32.
// a_rows[r] points at 2*k_pairs readable bf16, 4-byte aligned (a pair loads as one int32);
// b_blocks[i] at the first k-pair to use of a packed block; c is fp32 with row stride ldc;
// `accumulate` adds to c instead of overwriting it.
// `isa` picks the path: vdpbf16ps (avx512_bf16+), fp32 FMA on widened bf16 (avx512), scalar.
void tile_gemm(Isa isa, int rows, int num_blocks, const bf16_t* const* a_rows,
               const bf16_t* const* b_blocks, int64_t k_pairs, float* c, int64_t ldc,
               bool accumulate);

// Decode tiles (at most kStreamRows rows of activations) do too little work per weight byte to
// hide its fetch from DRAM: they prefetch each weight stream kStreamAhead bytes ahead. Measured
// on decode GEMVs over 1.3 GB rotations (2 threads, interleaved against no prefetch): bf16 6-20 %
// and int8 2-8 % more GB/s; 1 and 4 KiB did about as well as 2. Past the end of a block it
// touches the next one, or nothing: a prefetch does not fault.
constexpr int kStreamRows = 2;
constexpr int64_t kStreamAhead = 2048;

// The k loop of the vdpbf16ps register tile, shared by gemm.cpp's tile and the fp8 kernels' scaled
// tile (which differ only in how acc starts and is stored): per k-pair, the 2 * BLOCKS weight
// vectors are loaded once and each row's broadcast activation pair multiplies all of them:
//   acc[r][v] lane j += sum_{kp < k_pairs, t < 2} a_rows[r][2kp + t] * b_blocks[v / 2][kp][j'][t]
// with j' = 16 (v % 2) + j. Inlined into the caller (compile-time bounds): acc stays in registers.
// STREAM: the weights come from memory (not a block converted in cache), prefetched as above.
template <int ROWS, int BLOCKS, bool STREAM = false>
DUET_TARGET_AVX512_BF16 inline __attribute__((always_inline)) void tile_bf16_accumulate(
    __m512 (&acc)[ROWS][2 * BLOCKS], const bf16_t* const* a_rows, const bf16_t* const* b_blocks,
    int64_t k_pairs) {
  constexpr int kVecs = 2 * BLOCKS;
  const int32_t* a[ROWS];
  const bf16_t* b[BLOCKS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) a[r] = reinterpret_cast<const int32_t*>(a_rows[r]);
#pragma GCC unroll 4
  for (int i = 0; i < BLOCKS; ++i) b[i] = b_blocks[i];
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    __m512bh w[kVecs];
    if constexpr (STREAM) {
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) {
        const bf16_t* line = b[v / 2] + kp * 2 * kPackBlockN + 32 * (v % 2);
        _mm_prefetch(reinterpret_cast<const char*>(line) + kStreamAhead, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      w[v] = (__m512bh)_mm512_loadu_si512(b[v / 2] + kp * 2 * kPackBlockN + 32 * (v % 2));
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(a[r][kp]);
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], x);
    }
  }
}

// Epilogue helpers (vectorized per isa):
// dst[i] = bf16(src[i]) for i < n.
void store_row_bf16(Isa isa, const float* src, bf16_t* dst, int64_t n);
// dst[i] = bf16(silu(gate[i]) * up[i]) for i < n.
void silu_mul_row_bf16(Isa isa, const float* gate, const float* up, bf16_t* dst, int64_t n);
// dst[i] = silu(gate[i]) * up[i] in fp32 for i < n (the int8 MoE quantizes it next).
void silu_mul_row_f32(Isa isa, const float* gate, const float* up, float* dst, int64_t n);
// dst[i] += alpha * src[i] for i < n.
void axpy_row_f32(Isa isa, float alpha, const float* src, float* dst, int64_t n);

// Per-thread fp32 scratch of at least `floats` elements (grows, never shrinks; 64-byte aligned).
// Called inside OpenMP regions, where a failed allocation cannot unwind: it terminates.
float* thread_scratch_f32(int64_t floats);

}  // namespace duet

// FP8 e4m3 weight-only linear: the packed layout, the e4m3 -> bf16 conversions and the register
// tile of the decode GEMV (gemm_fp8_kernels.cpp), used by the drivers in gemm_fp8.cpp.
#pragma once

#include <cstdint>

#include "common.h"
#include "cpu_features.h"

namespace duet {

// NOTE: packed fp8 layout. The blocks of gemm_kernels.h's bf16 layout (32 output columns, k in
// pairs) at 1 byte per weight: a weight W [N, K] becomes ceil(N/32) blocks of ceil(K/2) rows of
// 64 bytes, zero past the last row or column. The 64 bytes of row kp hold the 64 weights
// W[32nb + j][2kp + t] of the bf16 layout's two zmm (word u = 2j + t; zmm z = u / 32, word
// w = u % 32) in the order that byte unpacks rebuild them: byte 16 * (w / 8) + 8 * z + w % 8.
// Unpacking the low (high) 8 bytes of each 128-bit lane of the converted low/high bf16 bytes
// then yields zmm 0 (1) of the bf16 layout, with no shuffle across lanes.
// The Python side (native/_fp8_ops.py) builds it with a pad + permute.
// Scales: fp32 [ceil(N/128)][ld_scale], DeepSeek's weight_scale_inv:
// w = e4m3(W) * scale[n / 128][k / 128].
// A 32-column block lies inside one 128-row scale block, and 64 k-pairs are one scale column.
constexpr int64_t kFp8RowBytes = 64;
constexpr int64_t kFp8ScalePairs = 64;  // k-pairs per 128-wide scale block
constexpr int64_t kFp8ScaleRows = 128;  // output rows per scale block

// Block scale rows by output-column block: scale row of packed block `block`.
inline int64_t fp8_scale_row(int64_t block) { return block * 32 / kFp8ScaleRows; }

// The in-register conversion needs vpermi2b (AVX512-VBMI) next to vdpbf16ps.
bool fp8_lut_tile_available(Isa isa);

// Converts `rows` packed fp8 rows (64 bytes each) into rows of the bf16 layout (64 bf16 each),
// exactly (every finite e4m3 value is a bf16). `isa` picks vpermi2b lookups (VBMI),
// e4m3 -> fp16 -> fp32 (AVX-512 BW) or a table.
void fp8_rows_to_bf16(Isa isa, const uint8_t* src, int64_t rows, bf16_t* dst);

// Widest tile of the in-register GEMV for `rows` rows: as gemm_kernels.h's tile_max_blocks
// (rows * blocks <= 12: the accumulators, four lookup tables and the converted pair of a block
// fit the 32 zmm).
inline int fp8_tile_max_blocks(int rows) { return std::min(4, 12 / std::max(rows, 1)); }

// One register tile of the GEMV, converting the weights in registers (fp8_lut_tile_available):
//   c[r][32*i + j] (+)= sum_kb scales[i][kb] * sum_{kp in k-block kb} sum_t
//                          a_rows[r][2kp + t] * fp8(b_blocks[i][kp][j][t])
// for r < rows <= 6, i < num_blocks <= fp8_tile_max_blocks(rows), kp < k_pairs, k-blocks of 64
// pairs from kp = 0. a_rows[r]: 2*k_pairs readable bf16, 4-byte aligned; b_blocks[i]: row 0 of a
// packed block; scales[i]: that block's scale row; c fp32 with row stride ldc.
void fp8_tile_lut(int rows, int num_blocks, const bf16_t* const* a_rows,
                  const uint8_t* const* b_blocks, const float* const* scales, int64_t k_pairs,
                  float* c, int64_t ldc);

// The GEMM's register tile over one converted k block (rows of the bf16 layout, as made by
// fp8_rows_to_bf16), with vdpbf16ps (isa >= kAvx512Bf16):
//   c[r][32*i + j] += scales[i] * sum_{kp<pairs,t<2} a_rows[r][2kp + t] * b_blocks[i][kp][j][t]
// for r < rows <= 6, i < num_blocks <= tile_max_blocks(rows) (gemm_kernels.h); the sum starts
// from zero, so the block scale multiplies exactly that k block's products.
void fp8_tile_scaled_bf16(int rows, int num_blocks, const bf16_t* const* a_rows,
                          const bf16_t* const* b_blocks, const float* scales, int64_t pairs,
                          float* c, int64_t ldc);

}  // namespace duet

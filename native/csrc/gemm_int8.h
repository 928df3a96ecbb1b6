// INT8 W8A8 linear (gemm_int8.cpp): int8 weights quantized per output channel and prepacked
// once (layout below), activations quantized per token at the kernel's entry, int32
// accumulation with vpdpbusd, fp32 dequantization in the epilogue. Declared here so the int8
// fused MoE can reuse the tile and the activation quantizer.
#pragma once

#include <cstdint>

#include "common.h"
#include "cpu_features.h"

namespace duet {

// NOTE: packed int8 weight layout (VNNI-4 in blocks of 16 output columns).
// A quantized weight Wq [N, K] (int8, symmetric: Wq = round(W / w_scale[n]), |Wq| <= 127)
// becomes ceil(N/16) blocks, each [ceil(K/4)][16][4] int8 and contiguous: element (g, j, t) of
// block nb is Wq[16*nb + j][4*g + t], zero past the last row or column. One k-group row of a
// block is 64 bytes = one zmm = one cache line; lane j holds the 4 weights of column
// n = 16*nb + j that vpdpbusd multiplies with the broadcast 4 activation bytes
// (x[4g], ..., x[4g+3]). As in gemm_kernels.h, a thread owning a range of blocks streams
// contiguous regions (GEMV), and a K range of a block is a contiguous slice (GEMM).
// Beside the bytes, per padded column: w_scale (fp32) and comp = 128 * sum_k Wq[n][k] (int32).
// The Python side (native/_quant_ops.py) builds all three with torch.
//
// Activation scheme: per row, a_scale = absmax / 127 and q = round_half_even(x * (127 / absmax))
// in [-127, 127] (a row with absmax < kInt8MinAbsmax, e.g. all zeros, gives q = 0 and
// a_scale = 0), stored as the byte u = q + 128 for
// vpdpbusd (u8 x s8). Then sum_k u[k] Wq[n][k] - comp[n] = sum_k q[k] Wq[n][k] exactly, and
// y = float(that) * a_scale * w_scale[n] (in that order), which reference.linear_int8 repeats
// bit for bit. K is limited to kInt8MaxK so the u8 sums fit in int32.
constexpr int64_t kInt8BlockN = 16;
constexpr int64_t kInt8MaxK = 65536;  // 255 * 127 * 65536 < 2^31
constexpr float kInt8MinAbsmax = 1e-30f;  // far above 127 / FLT_MAX, where 127 / absmax overflows

inline int64_t int8_k_groups(int64_t k) { return (k + 3) / 4; }
inline int64_t int8_num_blocks(int64_t n) { return (n + kInt8BlockN - 1) / kInt8BlockN; }
// Bytes of one packed block of a weight with k_groups groups of 4 inputs.
inline int64_t int8_block_bytes(int64_t k_groups) { return k_groups * 4 * kInt8BlockN; }

// Register tile limits: rows x blocks int32 accumulators, at most 24 of the 32 zmm.
constexpr int kInt8TileMaxRows = 6;
constexpr int kInt8TileMaxBlocks = 4;

// Quantizes rows [0, m) of x (fp32 or bf16 per `dtype`, row stride ldx, k values) as above:
// q[r * 4 * k_groups + i] = u8 byte of x[r][i] (128 past k), scale[r] = a_scale of row r.
void quantize_rows_int8(Isa isa, const void* x, DType dtype, int64_t ldx, int64_t m, int64_t k,
                        int64_t k_groups, uint8_t* q, float* scale);

// One register tile of int32 sums:
//   c[r][16*i + j] (+)= sum_{g < k_groups, t < 4} a_rows[r][4g + t] * b_blocks[i][g][j][t]
// for r < rows <= 6, i < num_blocks <= 4, j < 16; a_rows are u8 bytes, b_blocks s8, each pointing
// at the first k-group to use; c has row stride ldc; `accumulate` adds to c.
// `isa` picks the path: vpdpbusd (avx512_bf16+, which has VNNI), 16-bit multiply-adds on zmm
// (avx512) or ymm (avx2, one block at a time), scalar.
void tile_int8(Isa isa, int rows, int num_blocks, const uint8_t* const* a_rows,
               const int8_t* const* b_blocks, int64_t k_groups, int32_t* c, int64_t ldc,
               bool accumulate);

// out[j] = float(acc[j] - comp[j]) * a_scale * w_scale[j] for j < n (fp32; vectorized per isa).
void dequant_row_int8(Isa isa, const int32_t* acc, const int32_t* comp, const float* w_scale,
                      float a_scale, float* out, int64_t n);

}  // namespace duet

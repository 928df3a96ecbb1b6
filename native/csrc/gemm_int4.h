// INT4 W4A8 linear (gemm_int4.cpp) and its building blocks (gemm_int4_kernels.cpp): 4-bit
// weights with one fp32 scale per group of `group` inputs of an output column, activations
// quantized per token to int8 at the kernel's entry (the int8 linear's quantizer), int32 sums per
// group with vpdpbusd, fp32 accumulation of the scaled group sums. Declared here so the int4
// fused MoE (moe_int4.cpp) reuses the tile and the activation step.
#pragma once

#include <cstdint>

#include "common.h"
#include "cpu_features.h"

namespace duet {

// NOTE: packed int4 weight layout (blocks of 16 output columns, 8 inputs per 64-byte row).
// A weight W [N, K] is quantized per (column n, group g of `group` inputs): scale s[n][g] =
// -e / 8 where e is the group's value of largest magnitude (llama.cpp's Q4_0 rule: e itself maps
// to -8, so all 16 levels are used), Wq = clamp(round_half_even(W / s), -8, 7); s = 0 and Wq = 0
// for an all-zero group. K is zero-padded to Kp = group * ceil(K / group), N to a multiple of 16.
// Block nb is [Kp / 8][16][4] bytes, contiguous: byte (kk, j, t) holds
//   low nibble  Wq[16 nb + j][8 kk + t] + 8,   high nibble  Wq[16 nb + j][8 kk + 4 + t] + 8,
// so one 64-byte row is one zmm whose low nibbles (masked) and high nibbles (shifted) are two
// vpdpbusd weight operands of 16 columns x 4 inputs each, unsigned (0..15). Beside it, per block,
// the scales [Kp / group][16] fp32 (the 16 columns of each group side by side).
//
// Activations: the int8 linear's per-token quantizer (gemm_int8.h: q in [-127, 127], a_scale),
// stored as signed bytes, and per group qsum8[g] = 8 * sum_{k in g} q[k]. vpdpbusd takes the
// unsigned weight nibbles u = Wq + 8 against the signed activations, so
//   sum_k u[k] q[k] - qsum8[g] = sum_k Wq[k] q[k]  (exact, int32),
// and the output is y[n] = a_scale * sum_g s[n][g] * float(that) with the group terms added in
// group order by fused multiply-adds into an fp32 accumulator (every ISA path does exactly this,
// so the paths agree bit for bit; reference.linear_int4 is the float64 twin).
constexpr int64_t kInt4BlockN = 16;
constexpr int64_t kInt4MaxGroup = 256;  // |sum| <= 15 * 127 * 256 stays exact in fp32's 24 bits
constexpr int kInt4TileMaxRows = 6;
constexpr int kInt4TileMaxBlocks = 4;

inline int64_t int4_num_blocks(int64_t n) { return (n + kInt4BlockN - 1) / kInt4BlockN; }
inline int64_t int4_num_groups(int64_t k, int64_t group) { return (k + group - 1) / group; }
// Group sizes the kernels take: whole 64-byte rows (8 inputs), sums exact in fp32.
inline bool int4_group_ok(int64_t group) {
  return group >= 8 && group <= kInt4MaxGroup && group % 8 == 0;
}
// Bytes of one packed block whose K is padded to num_groups * group.
inline int64_t int4_block_bytes(int64_t num_groups, int64_t group) {
  return num_groups * group / 8 * 64;
}

// Rows [0, m) of x (fp32 or bf16 per `dtype`, row stride ldx, k values) quantized per row:
// q[r * padded + i] (signed, 0 past k; padded = num_groups * group), scale[r], and
// qsum8[r * num_groups + g] as above.
void quantize_rows_int4act(Isa isa, const void* x, DType dtype, int64_t ldx, int64_t m, int64_t k,
                           int64_t group, int64_t num_groups, int8_t* q, float* scale,
                           int32_t* qsum8);

// One register tile over groups [0, num_groups) (the pointers at the first one):
//   c[r][16 i + j] += sum_g float(sum_{k in g} u_i[k][j] a_r[k] - qsum8_r[g]) * s_i[g][j]
// for r < rows <= 6, i < num_blocks <= 4, as fused multiply-adds in group order; c (row stride
// ldc) is read and written (the caller zeroes it first). `isa` picks vpdpbusd (avx512_bf16+,
// which has VNNI), vpmaddubsw on zmm (avx512) or ymm (avx2), or the scalar path.
void tile_int4(Isa isa, int rows, int num_blocks, const int8_t* const* a_rows,
               const int32_t* const* a_sums, const uint8_t* const* b_blocks,
               const float* const* b_scales, int64_t num_groups, int64_t group, float* c,
               int64_t ldc);

// The prefill GEMM's path (AVX-512 CPUs, `int4_unpacked_tiles`): a task unpacks its panel's
// K chunk once (`unpack_int4_rows`: each 64-byte row of packed nibbles becomes a row of the low
// nibbles and a row of the high ones, as bytes), then runs every 6-row tile of its rows over the
// unpacked copy (`tile_int4_unpacked`, the pointers at that copy): the unpacking is paid once
// per 240 rows, not per tile. The same integers and FMAs as tile_int4, so the same bits.
bool int4_unpacked_tiles(Isa isa);
void unpack_int4_rows(const uint8_t* src, int64_t rows, uint8_t* dst);
void tile_int4_unpacked(Isa isa, int rows, int num_blocks, const int8_t* const* a_rows,
                        const int32_t* const* a_sums, const uint8_t* const* b_blocks,
                        const float* const* b_scales, int64_t num_groups, int64_t group, float* c,
                        int64_t ldc);

}  // namespace duet

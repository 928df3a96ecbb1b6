// Building blocks of the INT4 W4A8 linear (declared in gemm_int4.h): the activation step and the
// register tiles, each with a scalar path, an AVX2 path and AVX-512 paths. Every path computes the
// same int32 group sums and the same fused multiply-adds in the same order, so results do not
// depend on the ISA (tests/native/test_gemm_int4.py checks it).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "gemm_int4.h"
#include "gemm_int8.h"  // quantize_rows_int8

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // as in gemm.cpp: avx512 intrinsics

namespace duet {
namespace {

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ---- scalar ------------------------------------------------------------------------------------

void tile_portable(int rows, int num_blocks, const int8_t* const* a_rows,
                   const int32_t* const* a_sums, const uint8_t* const* b_blocks,
                   const float* const* b_scales, int64_t num_groups, int64_t group, float* c,
                   int64_t ldc) {
  const int64_t rows_per_group = group / 8;  // 64-byte rows of a block per group
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < num_blocks; ++i) {
      float* out = c + r * ldc + i * kInt4BlockN;
      for (int64_t g = 0; g < num_groups; ++g) {
        int32_t acc[kInt4BlockN] = {};
        for (int64_t kk = 0; kk < rows_per_group; ++kk) {
          const int8_t* a = a_rows[r] + g * group + 8 * kk;
          const uint8_t* b = b_blocks[i] + (g * rows_per_group + kk) * 64;
          for (int j = 0; j < kInt4BlockN; ++j) {
            for (int t = 0; t < 4; ++t) {
              const uint8_t byte = b[4 * j + t];
              acc[j] += (byte & 0x0f) * a[t] + (byte >> 4) * a[4 + t];
            }
          }
        }
        const float* s = b_scales[i] + g * kInt4BlockN;
        for (int j = 0; j < kInt4BlockN; ++j) {
          out[j] = std::fma(static_cast<float>(acc[j] - a_sums[r][g]), s[j], out[j]);
        }
      }
    }
  }
}

// ---- AVX-512 -----------------------------------------------------------------------------------

// u8 x s8 products of 4 bytes per lane summed into int32: vpdpbusd with VNNI, else vpmaddubsw
// (pair sums of at most 2 * 15 * 127, far from int16 saturation) then vpmaddwd by ones.
DUET_TARGET_AVX512_BF16 inline __m512i dot4_vnni(__m512i acc, __m512i u, __m512i s) {
  return _mm512_dpbusd_epi32(acc, u, s);
}
DUET_TARGET_AVX512 inline __m512i dot4_avx512(__m512i acc, __m512i u, __m512i s) {
  const __m512i pairs = _mm512_maddubs_epi16(u, s);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}

// ROWS x BLOCKS tile, one group at a time: the int32 sums stay in registers over the group, then
// each is turned into fp32 and added into c (in L1) with the group's scales. A small tile (the
// decode GEMV's 1 x 4) keeps the low and the high nibbles' sums apart: the two dot products of
// a 64-byte row then do not wait on each other, and the high nibbles are taken in place (16 x
// their value: the sum is 16 x theirs, exact in int32, shifted back once per group), one
// instruction less per row (with VNNI only: 16 x 15 x 127 x 2 would saturate vpmaddubsw's
// 16-bit pair sums). Weights are prefetched 16 rows (1 KB) ahead per block.
// UNPACKED: the blocks come as `unpack_int4_rows` wrote them (a 64-byte row of low nibbles,
// then one of high nibbles, as bytes), read as they are.
#define DUET_INT4_TILE_BODY(DOT, HIGH_IN_PLACE)                                                \
  constexpr bool kSplit = ROWS * BLOCKS <= 8 && !UNPACKED;                                     \
  constexpr bool kInPlace = kSplit && HIGH_IN_PLACE;                                           \
  constexpr int kHi = kSplit ? 1 : 0;                                                          \
  const int64_t rows_per_group = group / 8;                                                    \
  const __m512i nibble = _mm512_set1_epi8(0x0f);                                               \
  for (int64_t g = 0; g < num_groups; ++g) {                                                   \
    __m512i acc[1 + kHi][ROWS][BLOCKS];                                                        \
    _Pragma("GCC unroll 2") for (int h = 0; h <= kHi; ++h) {                                   \
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {                                 \
        _Pragma("GCC unroll 4") for (int i = 0; i < BLOCKS; ++i) acc[h][r][i] =                \
            _mm512_setzero_si512();                                                            \
      }                                                                                        \
    }                                                                                          \
    for (int64_t kk = 0; kk < rows_per_group; ++kk) {                                          \
      const int64_t row = g * rows_per_group + kk;                                             \
      _Pragma("GCC unroll 4") for (int i = 0; i < BLOCKS; ++i) {                               \
        __m512i lo, hi;                                                                        \
        if (UNPACKED) {                                                                        \
          lo = _mm512_loadu_si512(b_blocks[i] + row * 128);                                    \
          hi = _mm512_loadu_si512(b_blocks[i] + row * 128 + 64);                               \
        } else {                                                                               \
          const uint8_t* b = b_blocks[i] + row * 64;                                           \
          _mm_prefetch(reinterpret_cast<const char*>(b + 16 * 64), _MM_HINT_T0);               \
          const __m512i w = _mm512_loadu_si512(b);                                             \
          lo = _mm512_and_si512(w, nibble);                                                    \
          hi = kInPlace ? _mm512_andnot_si512(nibble, w)                                       \
                        : _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);                   \
        }                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {                               \
          const int8_t* a = a_rows[r] + 8 * row;                                               \
          acc[0][r][i] = DOT(acc[0][r][i], lo, _mm512_set1_epi32(load_i32(a)));                \
          acc[kHi][r][i] = DOT(acc[kHi][r][i], hi, _mm512_set1_epi32(load_i32(a + 4)));        \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
    _Pragma("GCC unroll 4") for (int i = 0; i < BLOCKS; ++i) {                                 \
      const __m512 s = _mm512_loadu_ps(b_scales[i] + g * kInt4BlockN);                         \
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {                                 \
        float* out = c + r * ldc + i * kInt4BlockN;                                            \
        __m512i sums = _mm512_sub_epi32(acc[0][r][i], _mm512_set1_epi32(a_sums[r][g]));        \
        if (kSplit) {                                                                          \
          const __m512i high = acc[kHi][r][i];                                                 \
          sums = _mm512_add_epi32(sums, kInPlace ? _mm512_srai_epi32(high, 4) : high);         \
        }                                                                                      \
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), s, _mm512_loadu_ps(out))); \
      }                                                                                        \
    }                                                                                          \
  }

template <int ROWS, int BLOCKS, bool UNPACKED>
DUET_TARGET_AVX512_BF16 void tile_vnni(const int8_t* const* a_rows, const int32_t* const* a_sums,
                                       const uint8_t* const* b_blocks,
                                       const float* const* b_scales, int64_t num_groups,
                                       int64_t group, float* c, int64_t ldc) {
  DUET_INT4_TILE_BODY(dot4_vnni, true)
}

template <int ROWS, int BLOCKS, bool UNPACKED>
DUET_TARGET_AVX512 void tile_avx512(const int8_t* const* a_rows, const int32_t* const* a_sums,
                                    const uint8_t* const* b_blocks, const float* const* b_scales,
                                    int64_t num_groups, int64_t group, float* c, int64_t ldc) {
  DUET_INT4_TILE_BODY(dot4_avx512, false)
}

#undef DUET_INT4_TILE_BODY

// ---- AVX2 --------------------------------------------------------------------------------------

// One block (two ymm halves of 8 columns) over all its rows: 16 registers hold <= 6 x 2 sums.
template <int ROWS>
DUET_TARGET_AVX2 void block_avx2(const int8_t* const* a_rows, const int32_t* const* a_sums,
                                 const uint8_t* b, const float* scales, int64_t num_groups,
                                 int64_t group, float* c, int64_t ldc) {
  const int64_t rows_per_group = group / 8;
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256i acc[ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t kk = 0; kk < rows_per_group; ++kk) {
      const int64_t row = g * rows_per_group + kk;
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i w =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + row * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(w, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* a = a_rows[r] + 8 * row;
          const __m256i pairs =
              _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(a))),
                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(a + 4))));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(scales + g * kInt4BlockN + 8 * h);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        float* out = c + r * ldc + 8 * h;
        const __m256i sums = _mm256_sub_epi32(acc[r][h], _mm256_set1_epi32(a_sums[r][g]));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, _mm256_loadu_ps(out)));
      }
    }
  }
}

using TileFn = void (*)(const int8_t* const*, const int32_t* const*, const uint8_t* const*,
                        const float* const*, int64_t, int64_t, float*, int64_t);
using BlockFn = void (*)(const int8_t* const*, const int32_t* const*, const uint8_t*,
                         const float*, int64_t, int64_t, float*, int64_t);

#define DUET_INT4_TILE_ROW(KERNEL, R, U)    \
  case R * 8 + 1: return KERNEL<R, 1, U>; \
  case R * 8 + 2: return KERNEL<R, 2, U>; \
  case R * 8 + 3: return KERNEL<R, 3, U>; \
  case R * 8 + 4: return KERNEL<R, 4, U>;
#define DUET_INT4_TILE_SWITCH(KERNEL, ROWS, BLOCKS, U) \
  switch ((ROWS) * 8 + (BLOCKS)) {                     \
    DUET_INT4_TILE_ROW(KERNEL, 1, U)                   \
    DUET_INT4_TILE_ROW(KERNEL, 2, U)                   \
    DUET_INT4_TILE_ROW(KERNEL, 3, U)                   \
    DUET_INT4_TILE_ROW(KERNEL, 4, U)                   \
    DUET_INT4_TILE_ROW(KERNEL, 5, U)                   \
    DUET_INT4_TILE_ROW(KERNEL, 6, U)                   \
    default: return nullptr;                           \
  }

template <bool UNPACKED>
TileFn tile_fn(Isa isa, int rows, int blocks) {
  if (isa >= Isa::kAvx512Bf16) {
    DUET_INT4_TILE_SWITCH(tile_vnni, rows, blocks, UNPACKED)
  }
  if (isa >= Isa::kAvx512) {
    DUET_INT4_TILE_SWITCH(tile_avx512, rows, blocks, UNPACKED)
  }
  return nullptr;
}

DUET_TARGET_AVX512 void unpack_rows_avx512(const uint8_t* src, int64_t rows, uint8_t* dst) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  for (int64_t row = 0; row < rows; ++row) {
    const __m512i w = _mm512_loadu_si512(src + row * 64);
    _mm512_storeu_si512(dst + row * 128, _mm512_and_si512(w, nibble));
    _mm512_storeu_si512(dst + row * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble));
  }
}

BlockFn block_avx2_fn(int rows) {
  switch (rows) {
    case 1: return block_avx2<1>;
    case 2: return block_avx2<2>;
    case 3: return block_avx2<3>;
    case 4: return block_avx2<4>;
    case 5: return block_avx2<5>;
    case 6: return block_avx2<6>;
    default: return nullptr;
  }
}

}  // namespace

void quantize_rows_int4act(Isa isa, const void* x, DType dtype, int64_t ldx, int64_t m, int64_t k,
                           int64_t group, int64_t num_groups, int8_t* q, float* scale,
                           int32_t* qsum8) {
  const int64_t padded = num_groups * group;
  // The int8 quantizer writes u = q + 128 (128 past k); flipping the top bit gives q as a signed
  // byte. Its k_groups of 4 cover `padded` exactly (group is a multiple of 8).
  auto* bytes = reinterpret_cast<uint8_t*>(q);
  quantize_rows_int8(isa, x, dtype, ldx, m, k, padded / 4, bytes, scale);
  for (int64_t r = 0; r < m; ++r) {
    uint8_t* row = bytes + r * padded;
    for (int64_t g = 0; g < num_groups; ++g) {
      int32_t sum = 0;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        row[i] ^= 0x80;
        sum += static_cast<int8_t>(row[i]);
      }
      qsum8[r * num_groups + g] = 8 * sum;
    }
  }
}

// The AVX-512 tiles of more than two rows run two blocks at a time: 3-6 rows x 2 blocks of sums,
// the rows' broadcast activations and the weight rows fit the 32 registers, where 6 x 4 spilled
// every sum to the stack on each 64-byte row (prefill int4 GEMM at 0.55x of int8's rate, then
// 0.6-0.7x). The weights are read once per pair either way; only the broadcasts repeat.
template <bool UNPACKED>
bool in_pairs(Isa isa, int rows, int num_blocks, const int8_t* const* a_rows,
              const int32_t* const* a_sums, const uint8_t* const* b_blocks,
              const float* const* b_scales, int64_t num_groups, int64_t group, float* c,
              int64_t ldc) {
  if (rows <= 2 || num_blocks <= 2 || isa < Isa::kAvx512) return false;
  for (int i = 0; i < num_blocks; i += 2) {
    const int pair = std::min(2, num_blocks - i);
    tile_fn<UNPACKED>(isa, rows, pair)(a_rows, a_sums, b_blocks + i, b_scales + i, num_groups,
                                       group, c + i * kInt4BlockN, ldc);
  }
  return true;
}


void tile_int4(Isa isa, int rows, int num_blocks, const int8_t* const* a_rows,
               const int32_t* const* a_sums, const uint8_t* const* b_blocks,
               const float* const* b_scales, int64_t num_groups, int64_t group, float* c,
               int64_t ldc) {
  if (in_pairs<false>(isa, rows, num_blocks, a_rows, a_sums, b_blocks, b_scales, num_groups,
                      group, c, ldc)) {
    return;
  }
  const TileFn fn = tile_fn<false>(isa, rows, num_blocks);
  const BlockFn block_fn = isa >= Isa::kAvx2 ? block_avx2_fn(rows) : nullptr;
  if (fn != nullptr) {
    fn(a_rows, a_sums, b_blocks, b_scales, num_groups, group, c, ldc);
  } else if (block_fn != nullptr) {
    for (int i = 0; i < num_blocks; ++i) {
      block_fn(a_rows, a_sums, b_blocks[i], b_scales[i], num_groups, group,
               c + i * kInt4BlockN, ldc);
    }
  } else {
    tile_portable(rows, num_blocks, a_rows, a_sums, b_blocks, b_scales, num_groups, group, c,
                  ldc);
  }
}

bool int4_unpacked_tiles(Isa isa) { return isa >= Isa::kAvx512; }

void unpack_int4_rows(const uint8_t* src, int64_t rows, uint8_t* dst) {
  unpack_rows_avx512(src, rows, dst);
}

void tile_int4_unpacked(Isa isa, int rows, int num_blocks, const int8_t* const* a_rows,
                        const int32_t* const* a_sums, const uint8_t* const* b_blocks,
                        const float* const* b_scales, int64_t num_groups, int64_t group, float* c,
                        int64_t ldc) {
  if (!in_pairs<true>(isa, rows, num_blocks, a_rows, a_sums, b_blocks, b_scales, num_groups,
                      group, c, ldc)) {
    tile_fn<true>(isa, rows, num_blocks)(a_rows, a_sums, b_blocks, b_scales, num_groups, group,
                                         c, ldc);
  }
}

}  // namespace duet

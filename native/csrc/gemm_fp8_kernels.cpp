// e4m3 -> bf16 conversions of packed fp8 rows and the in-register fp8 GEMV tile (layout and
// contracts: gemm_fp8_kernels.h).
//
// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinity, 0x7f / 0xff NaN. Every
// finite value is exact in bf16 (and in fp16 scaled by 2^-8), so the conversions are exact:
// - VBMI: two 128-entry byte lookups (vpermi2b) give the high and low byte of each weight's bf16
//   (the sign is or-ed into the high byte), and byte unpacks interleave them into the bf16
//   layout's words: 5 instructions per 64 weights, subnormals and NaN included.
// - AVX-512 BW: the magnitude bits shifted into an fp16 (exact, value * 2^-8, subnormals become
//   fp16 subnormals), vcvtph2ps, * 256, the top half of each fp32 is the bf16.
// - portable: a 256-entry table.
#include "gemm_fp8_kernels.h"

#include <immintrin.h>

#include <cstdlib>

#include "gemm_kernels.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // as in gemm.cpp: avx512 intrinsics

#define DUET_TARGET_AVX512_BF16_VBMI                                                          \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx512vbmi," \
                        "fma,f16c")))

namespace duet {
namespace {

// bf16 bits of the non-negative e4m3 value with magnitude bits `mag` (0..127).
constexpr uint16_t e4m3_magnitude_to_bf16(int mag) {
  if (mag == 0x7f) return 0x7fc0;  // NaN
  const int exponent = mag >> 3, mantissa = mag & 7;
  if (exponent > 0) return static_cast<uint16_t>(((exponent + 120) << 7) | (mantissa << 4));
  if (mantissa == 0) return 0;
  // Subnormal: mantissa * 2^-9 = 2^p * (1 + f) with p = floor(log2(mantissa)).
  const int p = mantissa >= 4 ? 2 : mantissa >= 2 ? 1 : 0;
  return static_cast<uint16_t>(((118 + p) << 7) | ((mantissa - (1 << p)) << (7 - p)));
}

struct Tables {
  alignas(64) uint8_t hi[128];  // high byte of the bf16 of magnitude m
  alignas(64) uint8_t lo[128];  // low byte
  uint16_t bf16[256];           // full bf16 of byte b (sign included)
};

constexpr Tables make_tables() {
  Tables t{};
  for (int m = 0; m < 128; ++m) {
    const uint16_t v = e4m3_magnitude_to_bf16(m);
    t.hi[m] = static_cast<uint8_t>(v >> 8);
    t.lo[m] = static_cast<uint8_t>(v & 0xff);
    t.bf16[m] = v;
    t.bf16[m + 128] = static_cast<uint16_t>(v | 0x8000);
  }
  return t;
}

constexpr Tables kTables = make_tables();

// Position in a packed row of word u (0..63) of the bf16 layout row.
inline int packed_position(int u) { return 16 * ((u % 32) / 8) + 8 * (u / 32) + u % 8; }

// ---- portable --------------------------------------------------------------------------------

void rows_to_bf16_portable(const uint8_t* src, int64_t rows, bf16_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + r * kFp8RowBytes;
    bf16_t* d = dst + r * kFp8RowBytes;
    for (int u = 0; u < kFp8RowBytes; ++u) d[u] = kTables.bf16[s[packed_position(u)]];
  }
}

// ---- AVX-512 BW: through fp16 ----------------------------------------------------------------

// 32 fp8 bytes placed in the high byte of each word -> their 32 bf16, same word order.
DUET_TARGET_AVX512 inline __m512i high_bytes_to_bf16(__m512i words) {
  // (s mmmmmmm 00000000) >>arith 1 = (s s mmmmmmm 0000000); clearing bit 14 leaves the fp16
  // (s 0 eeee mmm 0000000) = e4m3 * 2^-8.
  const __m512i half = _mm512_and_si512(_mm512_srai_epi16(words, 1), _mm512_set1_epi16(-0x4001));
  const __m512 scale = _mm512_set1_ps(256.f);
  const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(half)), scale);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)), scale);
  // Word j of the result is the top half of fp32 j of (lo | hi): index 2j + 1.
  alignas(64) static const uint16_t kOddWords[32] = {
      1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
      33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  return _mm512_permutex2var_epi16(_mm512_castps_si512(lo), _mm512_load_si512(kOddWords),
                                   _mm512_castps_si512(hi));
}

DUET_TARGET_AVX512 void rows_to_bf16_avx512(const uint8_t* src, int64_t rows, bf16_t* dst) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i raw = _mm512_loadu_si512(src + r * kFp8RowBytes);
    bf16_t* d = dst + r * kFp8RowBytes;
    _mm512_storeu_si512(d, high_bytes_to_bf16(_mm512_unpacklo_epi8(zero, raw)));
    _mm512_storeu_si512(d + 32, high_bytes_to_bf16(_mm512_unpackhi_epi8(zero, raw)));
  }
}

// ---- AVX-512 VBMI: byte lookups --------------------------------------------------------------

struct Lut {
  __m512i hi0, hi1, lo0, lo1;
};

DUET_TARGET_AVX512_BF16_VBMI inline Lut load_lut() {
  return Lut{_mm512_load_si512(kTables.hi), _mm512_load_si512(kTables.hi + 64),
             _mm512_load_si512(kTables.lo), _mm512_load_si512(kTables.lo + 64)};
}

// One packed row (64 fp8) -> the two zmm of its bf16 row.
DUET_TARGET_AVX512_BF16_VBMI inline void convert_row(const Lut& lut, const uint8_t* src,
                                                     __m512i* w0, __m512i* w1) {
  const __m512i raw = _mm512_loadu_si512(src);
  // vpermi2b indexes with the low 7 bits: the magnitude; bit 7 (the sign) is or-ed in.
  __m512i hi = _mm512_permutex2var_epi8(lut.hi0, raw, lut.hi1);
  const __m512i lo = _mm512_permutex2var_epi8(lut.lo0, raw, lut.lo1);
  hi = _mm512_ternarylogic_epi32(hi, raw, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);
  *w0 = _mm512_unpacklo_epi8(lo, hi);
  *w1 = _mm512_unpackhi_epi8(lo, hi);
}

DUET_TARGET_AVX512_BF16_VBMI void rows_to_bf16_vbmi(const uint8_t* src, int64_t rows,
                                                    bf16_t* dst) {
  const Lut lut = load_lut();
  for (int64_t r = 0; r < rows; ++r) {
    __m512i w0, w1;
    convert_row(lut, src + r * kFp8RowBytes, &w0, &w1);
    _mm512_storeu_si512(dst + r * kFp8RowBytes, w0);
    _mm512_storeu_si512(dst + r * kFp8RowBytes + 32, w1);
  }
}

// ROWS x BLOCKS tile converting in registers: per k-pair, each block's row is converted once and
// multiplies every row's broadcast activation pair. Products accumulate per 128-wide k block
// from zero, then c += block scale * that sum.
template <int ROWS, int BLOCKS>
DUET_TARGET_AVX512_BF16_VBMI void tile_lut(const bf16_t* const* a_rows,
                                           const uint8_t* const* b_blocks,
                                           const float* const* scales, int64_t k_pairs, float* c,
                                           int64_t ldc) {
  constexpr int kVecs = 2 * BLOCKS;
  const Lut lut = load_lut();
  const int32_t* a[ROWS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) a[r] = reinterpret_cast<const int32_t*>(a_rows[r]);
  for (int64_t kp0 = 0, kb = 0; kp0 < k_pairs; kp0 += kFp8ScalePairs, ++kb) {
    const int64_t kp1 = std::min(k_pairs, kp0 + kFp8ScalePairs);
    __m512 acc[ROWS][kVecs];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t kp = kp0; kp < kp1; ++kp) {
#pragma GCC unroll 4
      for (int i = 0; i < BLOCKS; ++i) {
        __m512i w0, w1;
        convert_row(lut, b_blocks[i] + kp * kFp8RowBytes, &w0, &w1);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
          const __m512bh x = (__m512bh)_mm512_set1_epi32(a[r][kp]);
          acc[r][2 * i] = _mm512_dpbf16_ps(acc[r][2 * i], (__m512bh)w0, x);
          acc[r][2 * i + 1] = _mm512_dpbf16_ps(acc[r][2 * i + 1], (__m512bh)w1, x);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) {
        const __m512 s = _mm512_set1_ps(scales[v / 2][kb]);
        float* dst = c + r * ldc + 16 * v;
        _mm512_storeu_ps(dst, kb == 0 ? _mm512_mul_ps(s, acc[r][v])
                                      : _mm512_fmadd_ps(s, acc[r][v], _mm512_loadu_ps(dst)));
      }
    }
  }
}

using TileLutFn = void (*)(const bf16_t* const*, const uint8_t* const*, const float* const*,
                           int64_t, float*, int64_t);

// (rows, blocks) -> instantiation; only shapes with blocks <= fp8_tile_max_blocks(rows).
TileLutFn tile_lut_fn(int rows, int blocks) {
  switch (rows * 8 + blocks) {
    case 1 * 8 + 1: return tile_lut<1, 1>;
    case 1 * 8 + 2: return tile_lut<1, 2>;
    case 1 * 8 + 3: return tile_lut<1, 3>;
    case 1 * 8 + 4: return tile_lut<1, 4>;
    case 2 * 8 + 1: return tile_lut<2, 1>;
    case 2 * 8 + 2: return tile_lut<2, 2>;
    case 2 * 8 + 3: return tile_lut<2, 3>;
    case 2 * 8 + 4: return tile_lut<2, 4>;
    case 3 * 8 + 1: return tile_lut<3, 1>;
    case 3 * 8 + 2: return tile_lut<3, 2>;
    case 3 * 8 + 3: return tile_lut<3, 3>;
    case 3 * 8 + 4: return tile_lut<3, 4>;
    case 4 * 8 + 1: return tile_lut<4, 1>;
    case 4 * 8 + 2: return tile_lut<4, 2>;
    case 4 * 8 + 3: return tile_lut<4, 3>;
    case 5 * 8 + 1: return tile_lut<5, 1>;
    case 5 * 8 + 2: return tile_lut<5, 2>;
    case 6 * 8 + 1: return tile_lut<6, 1>;
    case 6 * 8 + 2: return tile_lut<6, 2>;
    default: return nullptr;
  }
}

// ROWS x BLOCKS bf16 tile over one k block from zero, then c += scale * sum (gemm.cpp's
// tile_avx512_bf16 with the block scale folded into the store).
template <int ROWS, int BLOCKS>
DUET_TARGET_AVX512_BF16 void tile_scaled(const bf16_t* const* a_rows,
                                         const bf16_t* const* b_blocks, const float* scales,
                                         int64_t pairs, float* c, int64_t ldc) {
  constexpr int kVecs = 2 * BLOCKS;
  __m512 acc[ROWS][kVecs];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  tile_bf16_accumulate<ROWS, BLOCKS>(acc, a_rows, b_blocks, pairs);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      float* dst = c + r * ldc + 16 * v;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_set1_ps(scales[v / 2]), acc[r][v],
                                            _mm512_loadu_ps(dst)));
    }
  }
}

using TileScaledFn = void (*)(const bf16_t* const*, const bf16_t* const*, const float*, int64_t,
                              float*, int64_t);

// (rows, blocks) -> instantiation; shapes with rows * blocks <= 12 as in gemm.cpp.
TileScaledFn tile_scaled_fn(int rows, int blocks) {
  switch (rows * 8 + blocks) {
    case 1 * 8 + 1: return tile_scaled<1, 1>;
    case 1 * 8 + 2: return tile_scaled<1, 2>;
    case 1 * 8 + 3: return tile_scaled<1, 3>;
    case 1 * 8 + 4: return tile_scaled<1, 4>;
    case 2 * 8 + 1: return tile_scaled<2, 1>;
    case 2 * 8 + 2: return tile_scaled<2, 2>;
    case 2 * 8 + 3: return tile_scaled<2, 3>;
    case 2 * 8 + 4: return tile_scaled<2, 4>;
    case 3 * 8 + 1: return tile_scaled<3, 1>;
    case 3 * 8 + 2: return tile_scaled<3, 2>;
    case 3 * 8 + 3: return tile_scaled<3, 3>;
    case 3 * 8 + 4: return tile_scaled<3, 4>;
    case 4 * 8 + 1: return tile_scaled<4, 1>;
    case 4 * 8 + 2: return tile_scaled<4, 2>;
    case 4 * 8 + 3: return tile_scaled<4, 3>;
    case 5 * 8 + 1: return tile_scaled<5, 1>;
    case 5 * 8 + 2: return tile_scaled<5, 2>;
    case 6 * 8 + 1: return tile_scaled<6, 1>;
    case 6 * 8 + 2: return tile_scaled<6, 2>;
    default: return nullptr;
  }
}

}  // namespace

void fp8_tile_scaled_bf16(int rows, int num_blocks, const bf16_t* const* a_rows,
                          const bf16_t* const* b_blocks, const float* scales, int64_t pairs,
                          float* c, int64_t ldc) {
  const TileScaledFn fn = tile_scaled_fn(rows, num_blocks);
  if (fn == nullptr) std::abort();  // a driver bug: the drivers pick shapes from the limits
  fn(a_rows, b_blocks, scales, pairs, c, ldc);
}

bool fp8_lut_tile_available(Isa isa) {
  return isa >= Isa::kAvx512Bf16 && cpu_features().avx512_vbmi;
}

void fp8_rows_to_bf16(Isa isa, const uint8_t* src, int64_t rows, bf16_t* dst) {
  if (fp8_lut_tile_available(isa)) return rows_to_bf16_vbmi(src, rows, dst);
  if (isa >= Isa::kAvx512) return rows_to_bf16_avx512(src, rows, dst);
  rows_to_bf16_portable(src, rows, dst);
}

void fp8_tile_lut(int rows, int num_blocks, const bf16_t* const* a_rows,
                  const uint8_t* const* b_blocks, const float* const* scales, int64_t k_pairs,
                  float* c, int64_t ldc) {
  const TileLutFn fn = tile_lut_fn(rows, num_blocks);
  if (fn == nullptr) std::abort();  // a driver bug: the drivers pick shapes from the limits
  fn(a_rows, b_blocks, scales, k_pairs, c, ldc);
}

}  // namespace duet

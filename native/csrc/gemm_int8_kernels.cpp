// Building blocks of the INT8 W8A8 linear (declared in gemm_int8.h): the per-token activation
// quantizer, the int32 register tiles and the dequantizing epilogue, each with a portable path,
// an AVX2 path and AVX-512 paths. Every path computes the same integers and the same fp32
// operations in the same order, so results do not depend on the ISA
// (tests/native/test_gemm_int8.py checks it).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "gemm_int8.h"
#include "gemm_kernels.h"  // kStreamRows, kStreamAhead
#include "vec.h"

namespace duet {
namespace {

inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ---- activation quantization -----------------------------------------------------------------

// 127 / absmax and absmax / 127 as fp32 divisions (the twin divides the same way). A row whose
// absmax is below kInt8MinAbsmax (all zeros, or so small that 127 / absmax would overflow)
// quantizes to zeros with scale 0.
inline void row_scales(float absmax, float* inv, float* scale) {
  const bool tiny = !(absmax >= kInt8MinAbsmax);
  *inv = tiny ? 0.f : 127.f / absmax;
  *scale = tiny ? 0.f : absmax / 127.f;
}

inline uint8_t quantize_one(float v, float inv) {
  const float r = std::nearbyint(v * inv);  // default rounding mode: half to even, like torch
  return static_cast<uint8_t>(static_cast<int>(std::min(127.f, std::max(-127.f, r))) + 128);
}

using vec::to_f32;

template <typename T>
void quantize_row_portable(const T* x, int64_t k, int64_t padded, uint8_t* q, float* scale) {
  float absmax = 0.f;
  for (int64_t i = 0; i < k; ++i) absmax = std::max(absmax, std::fabs(to_f32(x[i])));
  float inv;
  row_scales(absmax, &inv, scale);
  for (int64_t i = 0; i < k; ++i) q[i] = quantize_one(to_f32(x[i]), inv);
  for (int64_t i = k; i < padded; ++i) q[i] = 128;
}

template <typename T>
DUET_TARGET_AVX512 void quantize_row_avx512(const T* x, int64_t k, int64_t padded, uint8_t* q,
                                            float* scale) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(vec::load16(x + i, vec::mask16(k - i))));
  }
  float inv;
  row_scales(_mm512_reduce_max_ps(vmax), &inv, scale);
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i zero_point = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = vec::mask16(k - i);
    // cvtps_epi32 rounds by MXCSR: half to even by default, as nearbyint and torch.round.
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(vec::load16(x + i, m), vinv));
    v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi), zero_point);
    _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(v));
  }
  for (int64_t i = k; i < padded; ++i) q[i] = 128;
}

DUET_TARGET_AVX2 inline __m256 load8_avx2(const float* x) { return _mm256_loadu_ps(x); }
DUET_TARGET_AVX2 inline __m256 load8_avx2(const bf16_t* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// AVX2 has no lane masks: 8 values at a time, the tail through the portable steps.
template <typename T>
DUET_TARGET_AVX2 void quantize_row_avx2(const T* x, int64_t k, int64_t padded, uint8_t* q,
                                        float* scale) {
  const int64_t k8 = k / 8 * 8;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < k8; i += 8) {
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8_avx2(x + i)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float absmax = 0.f;
  for (float v : lanes) absmax = std::max(absmax, v);
  for (int64_t i = k8; i < k; ++i) absmax = std::max(absmax, std::fabs(to_f32(x[i])));
  float inv;
  row_scales(absmax, &inv, scale);
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i zero_point = _mm256_set1_epi32(128);
  const __m256i gather_bytes = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
  for (int64_t i = 0; i < k8; i += 8) {
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8_avx2(x + i), vinv));  // half to even
    v = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(v, lo), hi), zero_point);
    // 8 int32 in [1, 255] -> 8 bytes: pack to 16 then 8 bits per 128-bit lane, join the lanes.
    const __m256i packed = _mm256_packus_epi16(_mm256_packus_epi32(v, v), _mm256_setzero_si256());
    const __m256i joined = _mm256_permutevar8x32_epi32(packed, gather_bytes);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm256_castsi256_si128(joined));
  }
  for (int64_t i = k8; i < k; ++i) q[i] = quantize_one(to_f32(x[i]), inv);
  for (int64_t i = k; i < padded; ++i) q[i] = 128;
}

// ---- register tiles --------------------------------------------------------------------------

void tile_portable(int rows, int num_blocks, const uint8_t* const* a_rows,
                   const int8_t* const* b_blocks, int64_t k_groups, int32_t* c, int64_t ldc,
                   bool accumulate) {
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < num_blocks; ++i) {
      int32_t acc[kInt8BlockN];
      int32_t* out = c + r * ldc + i * kInt8BlockN;
      for (int j = 0; j < kInt8BlockN; ++j) acc[j] = accumulate ? out[j] : 0;
      for (int64_t g = 0; g < k_groups; ++g) {
        const uint8_t* a = a_rows[r] + 4 * g;
        const int8_t* b = b_blocks[i] + g * 4 * kInt8BlockN;
        for (int j = 0; j < kInt8BlockN; ++j) {
          acc[j] += a[0] * b[4 * j] + a[1] * b[4 * j + 1] + a[2] * b[4 * j + 2] +
                    a[3] * b[4 * j + 3];
        }
      }
      for (int j = 0; j < kInt8BlockN; ++j) out[j] = acc[j];
    }
  }
}

// ROWS x BLOCKS tile: per k-group, BLOCKS weight vectors are loaded once and each row's
// broadcast 4 activation bytes multiply all of them. Compile-time loop bounds keep the
// accumulators in registers.
template <int ROWS, int BLOCKS>
DUET_TARGET_AVX512_BF16 void tile_vnni(const uint8_t* const* a_rows, const int8_t* const* b_blocks,
                                       int64_t k_groups, int32_t* c, int64_t ldc,
                                       bool accumulate) {
  __m512i acc[ROWS][BLOCKS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < BLOCKS; ++i) {
      acc[r][i] = accumulate ? _mm512_loadu_si512(c + r * ldc + 16 * i) : _mm512_setzero_si512();
    }
  }
  for (int64_t g = 0; g < k_groups; ++g) {
    __m512i w[BLOCKS];
    if constexpr (ROWS <= kStreamRows) {
#pragma GCC unroll 4
      for (int i = 0; i < BLOCKS; ++i) {
        _mm_prefetch(b_blocks[i] + g * 64 + kStreamAhead, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < BLOCKS; ++i) w[i] = _mm512_loadu_si512(b_blocks[i] + g * 64);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512i x = _mm512_set1_epi32(load_i32(a_rows[r] + 4 * g));
#pragma GCC unroll 4
      for (int i = 0; i < BLOCKS; ++i) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], x, w[i]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < BLOCKS; ++i) _mm512_storeu_si512(c + r * ldc + 16 * i, acc[r][i]);
  }
}

// Without VNNI: split each 4-byte lane into its even and odd bytes as 16-bit values (activations
// zero-extended, weights sign-extended) and let vpmaddwd sum the products in pairs. Products and
// pair sums fit in int32 exactly (no int16 saturation as with vpmaddubsw).
template <int ROWS, int BLOCKS>
DUET_TARGET_AVX512 void tile_avx512(const uint8_t* const* a_rows, const int8_t* const* b_blocks,
                                    int64_t k_groups, int32_t* c, int64_t ldc, bool accumulate) {
  __m512i acc[ROWS][BLOCKS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < BLOCKS; ++i) {
      acc[r][i] = accumulate ? _mm512_loadu_si512(c + r * ldc + 16 * i) : _mm512_setzero_si512();
    }
  }
  const __m512i low_bytes = _mm512_set1_epi16(0x00ff);
  for (int64_t g = 0; g < k_groups; ++g) {
    __m512i w_even[BLOCKS], w_odd[BLOCKS];
#pragma GCC unroll 4
    for (int i = 0; i < BLOCKS; ++i) {
      const __m512i w = _mm512_loadu_si512(b_blocks[i] + g * 64);
      w_even[i] = _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8);
      w_odd[i] = _mm512_srai_epi16(w, 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512i x = _mm512_set1_epi32(load_i32(a_rows[r] + 4 * g));
      const __m512i x_even = _mm512_and_si512(x, low_bytes);
      const __m512i x_odd = _mm512_srli_epi16(x, 8);
#pragma GCC unroll 4
      for (int i = 0; i < BLOCKS; ++i) {
        const __m512i pairs = _mm512_add_epi32(_mm512_madd_epi16(x_even, w_even[i]),
                                               _mm512_madd_epi16(x_odd, w_odd[i]));
        acc[r][i] = _mm512_add_epi32(acc[r][i], pairs);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < BLOCKS; ++i) _mm512_storeu_si512(c + r * ldc + 16 * i, acc[r][i]);
  }
}

// AVX2: the same 16-bit multiply-adds on ymm (a 16-column block is two vectors). With 16
// registers the tile runs one block at a time over all its rows (<= 6 x 2 accumulators).
template <int ROWS>
DUET_TARGET_AVX2 void block_avx2(const uint8_t* const* a_rows, const int8_t* b, int64_t k_groups,
                                 int32_t* c, int64_t ldc, bool accumulate) {
  __m256i acc[ROWS][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const auto* src = reinterpret_cast<const __m256i*>(c + r * ldc + 8 * h);
      acc[r][h] = accumulate ? _mm256_loadu_si256(src) : _mm256_setzero_si256();
    }
  }
  const __m256i low_bytes = _mm256_set1_epi16(0x00ff);
  for (int64_t g = 0; g < k_groups; ++g) {
    __m256i w_even[2], w_odd[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + g * 64 + 32 * h));
      w_even[h] = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8);
      w_odd[h] = _mm256_srai_epi16(w, 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256i x = _mm256_set1_epi32(load_i32(a_rows[r] + 4 * g));
      const __m256i x_even = _mm256_and_si256(x, low_bytes);
      const __m256i x_odd = _mm256_srli_epi16(x, 8);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i pairs = _mm256_add_epi32(_mm256_madd_epi16(x_even, w_even[h]),
                                               _mm256_madd_epi16(x_odd, w_odd[h]));
        acc[r][h] = _mm256_add_epi32(acc[r][h], pairs);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + 8 * h), acc[r][h]);
    }
  }
}

using BlockFn = void (*)(const uint8_t* const*, const int8_t*, int64_t, int32_t*, int64_t, bool);

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

using TileFn = void (*)(const uint8_t* const*, const int8_t* const*, int64_t, int32_t*, int64_t,
                        bool);

// (rows, blocks) -> instantiation, rows <= 6, blocks <= 4.
#define DUET_INT8_TILE_ROW(KERNEL, R) \
  case R * 8 + 1: return KERNEL<R, 1>; \
  case R * 8 + 2: return KERNEL<R, 2>; \
  case R * 8 + 3: return KERNEL<R, 3>; \
  case R * 8 + 4: return KERNEL<R, 4>;
#define DUET_INT8_TILE_SWITCH(KERNEL, ROWS, BLOCKS) \
  switch ((ROWS) * 8 + (BLOCKS)) {                  \
    DUET_INT8_TILE_ROW(KERNEL, 1)                   \
    DUET_INT8_TILE_ROW(KERNEL, 2)                   \
    DUET_INT8_TILE_ROW(KERNEL, 3)                   \
    DUET_INT8_TILE_ROW(KERNEL, 4)                   \
    DUET_INT8_TILE_ROW(KERNEL, 5)                   \
    DUET_INT8_TILE_ROW(KERNEL, 6)                   \
    default: return nullptr;                        \
  }

TileFn tile_fn(Isa isa, int rows, int blocks) {
  if (isa >= Isa::kAvx512Bf16) {
    DUET_INT8_TILE_SWITCH(tile_vnni, rows, blocks)
  }
  if (isa >= Isa::kAvx512) {
    DUET_INT8_TILE_SWITCH(tile_avx512, rows, blocks)
  }
  return nullptr;
}

// ---- epilogue --------------------------------------------------------------------------------

DUET_TARGET_AVX512 void dequant_row_avx512(const int32_t* acc, const int32_t* comp,
                                           const float* w_scale, float a_scale, float* out,
                                           int64_t n) {
  const __m512 va = _mm512_set1_ps(a_scale);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = vec::mask16(n - j);
    const __m512i sums = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(m, acc + j),
                                          _mm512_maskz_loadu_epi32(m, comp + j));
    const __m512 y =
        _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), va), vec::load16(w_scale + j, m));
    vec::store16(out + j, y, m);
  }
}

DUET_TARGET_AVX2 void dequant_row_avx2(const int32_t* acc, const int32_t* comp,
                                        const float* w_scale, float a_scale, float* out,
                                        int64_t n) {
  const __m256 va = _mm256_set1_ps(a_scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i sums =
        _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + j)),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp + j)));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), va),
                                   _mm256_loadu_ps(w_scale + j));
    _mm256_storeu_ps(out + j, y);
  }
  for (; j < n; ++j) out[j] = static_cast<float>(acc[j] - comp[j]) * a_scale * w_scale[j];
}

}  // namespace

void quantize_rows_int8(Isa isa, const void* x, DType dtype, int64_t ldx, int64_t m, int64_t k,
                        int64_t k_groups, uint8_t* q, float* scale) {
  const int64_t padded = 4 * k_groups;
  for (int64_t r = 0; r < m; ++r) {
    uint8_t* q_row = q + r * padded;
    if (dtype == DType::kBFloat16) {
      const bf16_t* row = static_cast<const bf16_t*>(x) + r * ldx;
      if (isa >= Isa::kAvx512) {
        quantize_row_avx512(row, k, padded, q_row, scale + r);
      } else if (isa >= Isa::kAvx2) {
        quantize_row_avx2(row, k, padded, q_row, scale + r);
      } else {
        quantize_row_portable(row, k, padded, q_row, scale + r);
      }
    } else {
      const float* row = static_cast<const float*>(x) + r * ldx;
      if (isa >= Isa::kAvx512) {
        quantize_row_avx512(row, k, padded, q_row, scale + r);
      } else if (isa >= Isa::kAvx2) {
        quantize_row_avx2(row, k, padded, q_row, scale + r);
      } else {
        quantize_row_portable(row, k, padded, q_row, scale + r);
      }
    }
  }
}

void tile_int8(Isa isa, int rows, int num_blocks, const uint8_t* const* a_rows,
               const int8_t* const* b_blocks, int64_t k_groups, int32_t* c, int64_t ldc,
               bool accumulate) {
  const TileFn fn = tile_fn(isa, rows, num_blocks);
  const BlockFn block_fn = isa >= Isa::kAvx2 ? block_avx2_fn(rows) : nullptr;
  if (fn != nullptr) {
    fn(a_rows, b_blocks, k_groups, c, ldc, accumulate);
  } else if (block_fn != nullptr) {
    for (int i = 0; i < num_blocks; ++i) {
      block_fn(a_rows, b_blocks[i], k_groups, c + i * kInt8BlockN, ldc, accumulate);
    }
  } else {
    tile_portable(rows, num_blocks, a_rows, b_blocks, k_groups, c, ldc, accumulate);
  }
}

void dequant_row_int8(Isa isa, const int32_t* acc, const int32_t* comp, const float* w_scale,
                      float a_scale, float* out, int64_t n) {
  if (isa >= Isa::kAvx512) return dequant_row_avx512(acc, comp, w_scale, a_scale, out, n);
  if (isa >= Isa::kAvx2) return dequant_row_avx2(acc, comp, w_scale, a_scale, out, n);
  for (int64_t j = 0; j < n; ++j) {
    out[j] = static_cast<float>(acc[j] - comp[j]) * a_scale * w_scale[j];
  }
}

}  // namespace duet

// bf16 linear with prepacked weights: y [M, N] = x [M, K] @ W[N, K]^T, fp32 accumulation.
// Holds the register-tile kernels of gemm_kernels.h (also used by moe.cpp) and the two drivers:
// - M <= 6 (decode GEMV): one tile row covers all of M, so every weight is read once; tasks are
//   panels of 1-4 packed blocks (= output columns), each a contiguous stream of weights.
// - M > 6 (prefill GEMM): tasks = (M chunk, 64-column panel); inside a task, K is cut in chunks
//   so the panel's K slice stays in L2 while every 6-row tile of the chunk runs over it,
//   accumulating in an fp32 buffer.
#include <immintrin.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "common.h"
#include "cpu_features.h"
#include "gemm_kernels.h"
#include "vec.h"

namespace py = pybind11;

namespace duet {
namespace {

using TileFn = void (*)(const bf16_t* const*, const bf16_t* const*, int64_t, float*, int64_t, bool);

// ---- portable --------------------------------------------------------------------------------

void tile_portable(int rows, int num_blocks, const bf16_t* const* a_rows,
                   const bf16_t* const* b_blocks, int64_t k_pairs, float* c, int64_t ldc,
                   bool accumulate) {
  const int cols = static_cast<int>(kPackBlockN) * num_blocks;
  for (int r = 0; r < rows; ++r) {
    float acc[kTileMaxBlocks * kPackBlockN];
    for (int j = 0; j < cols; ++j) acc[j] = accumulate ? c[r * ldc + j] : 0.f;
    for (int i = 0; i < num_blocks; ++i) {
      float* acc_blk = acc + i * kPackBlockN;
      for (int64_t kp = 0; kp < k_pairs; ++kp) {
        const float a0 = vec::bf16_to_f32(a_rows[r][2 * kp]);
        const float a1 = vec::bf16_to_f32(a_rows[r][2 * kp + 1]);
        const bf16_t* b = b_blocks[i] + kp * 2 * kPackBlockN;
        for (int j = 0; j < kPackBlockN; ++j) {
          acc_blk[j] += a0 * vec::bf16_to_f32(b[2 * j]) + a1 * vec::bf16_to_f32(b[2 * j + 1]);
        }
      }
    }
    for (int j = 0; j < cols; ++j) c[r * ldc + j] = acc[j];
  }
}

// ---- AVX-512 ---------------------------------------------------------------------------------
// ROWS x BLOCKS tile, "1-(2*BLOCKS)-(ROWS*2*BLOCKS)": per k-pair, 2*BLOCKS weight vectors are
// loaded once and each row's broadcast activation pair multiplies all of them. Loops have
// compile-time bounds so the accumulators live in registers.

template <int ROWS, int BLOCKS>
DUET_TARGET_AVX512_BF16 void tile_avx512_bf16(const bf16_t* const* a_rows,
                                              const bf16_t* const* b_blocks, int64_t k_pairs,
                                              float* c, int64_t ldc, bool accumulate) {
  constexpr int kVecs = 2 * BLOCKS;
  __m512 acc[ROWS][kVecs];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
    }
  }
  tile_bf16_accumulate<ROWS, BLOCKS, ROWS <= kStreamRows>(acc, a_rows, b_blocks, k_pairs);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
  }
}

// Without vdpbf16ps: widen each bf16 of the pair to fp32 (a bf16 is the top half of an fp32)
// and use two FMAs, even k then odd k.
template <int ROWS, int BLOCKS>
DUET_TARGET_AVX512 void tile_avx512(const bf16_t* const* a_rows, const bf16_t* const* b_blocks,
                                    int64_t k_pairs, float* c, int64_t ldc, bool accumulate) {
  constexpr int kVecs = 2 * BLOCKS;
  __m512 acc[ROWS][kVecs];
  const int32_t* a[ROWS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) a[r] = reinterpret_cast<const int32_t*>(a_rows[r]);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
    }
  }
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      const __m512i w = _mm512_loadu_si512(b_blocks[v / 2] + kp * 2 * kPackBlockN + 32 * (v % 2));
      const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask));
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const uint32_t pair = static_cast<uint32_t>(a[r][kp]);
        const __m512 x_even =
            _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(pair << 16)));
        const __m512 x_odd =
            _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(pair & 0xffff0000u)));
        acc[r][v] = _mm512_fmadd_ps(x_odd, w_odd, _mm512_fmadd_ps(x_even, w_even, acc[r][v]));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
  }
}

// (rows, blocks) -> instantiation; only shapes with rows * blocks <= 12 exist.
#define DUET_TILE_SWITCH(KERNEL, ROWS, BLOCKS)                             \
  switch ((ROWS) * 8 + (BLOCKS)) {                                       \
    case 1 * 8 + 1: return KERNEL<1, 1>;                                 \
    case 1 * 8 + 2: return KERNEL<1, 2>;                                 \
    case 1 * 8 + 3: return KERNEL<1, 3>;                                 \
    case 1 * 8 + 4: return KERNEL<1, 4>;                                 \
    case 2 * 8 + 1: return KERNEL<2, 1>;                                 \
    case 2 * 8 + 2: return KERNEL<2, 2>;                                 \
    case 2 * 8 + 3: return KERNEL<2, 3>;                                 \
    case 2 * 8 + 4: return KERNEL<2, 4>;                                 \
    case 3 * 8 + 1: return KERNEL<3, 1>;                                 \
    case 3 * 8 + 2: return KERNEL<3, 2>;                                 \
    case 3 * 8 + 3: return KERNEL<3, 3>;                                 \
    case 3 * 8 + 4: return KERNEL<3, 4>;                                 \
    case 4 * 8 + 1: return KERNEL<4, 1>;                                 \
    case 4 * 8 + 2: return KERNEL<4, 2>;                                 \
    case 4 * 8 + 3: return KERNEL<4, 3>;                                 \
    case 5 * 8 + 1: return KERNEL<5, 1>;                                 \
    case 5 * 8 + 2: return KERNEL<5, 2>;                                 \
    case 6 * 8 + 1: return KERNEL<6, 1>;                                 \
    case 6 * 8 + 2: return KERNEL<6, 2>;                                 \
    default: return nullptr;                                             \
  }

TileFn tile_fn(Isa isa, int rows, int blocks) {
  if (isa >= Isa::kAvx512Bf16) {
    DUET_TILE_SWITCH(tile_avx512_bf16, rows, blocks)
  }
  DUET_TILE_SWITCH(tile_avx512, rows, blocks)
}

// ---- epilogues -------------------------------------------------------------------------------

DUET_TARGET_AVX512 void store_row_avx512(const float* src, bf16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vec::mask16(n - i);
    vec::store16(dst + i, vec::load16(src + i, m), m);
  }
}

template <typename T>
DUET_TARGET_AVX512 void silu_mul_avx512(const float* gate, const float* up, T* dst, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vec::mask16(n - i);
    const __m512 g = vec::load16(gate + i, m);
    const __m512 e = vec::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 h = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), vec::load16(up + i, m));
    vec::store16(dst + i, h, m);
  }
}

DUET_TARGET_AVX512 void axpy_avx512(float alpha, const float* src, float* dst, int64_t n) {
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vec::mask16(n - i);
    vec::store16(dst + i, _mm512_fmadd_ps(va, vec::load16(src + i, m), vec::load16(dst + i, m)), m);
  }
}

}  // namespace

// ---- shared entry points (gemm_kernels.h) ----------------------------------------------------

void tile_gemm(Isa isa, int rows, int num_blocks, const bf16_t* const* a_rows,
               const bf16_t* const* b_blocks, int64_t k_pairs, float* c, int64_t ldc,
               bool accumulate) {
  const TileFn fn = isa >= Isa::kAvx512 ? tile_fn(isa, rows, num_blocks) : nullptr;
  if (fn != nullptr) {
    fn(a_rows, b_blocks, k_pairs, c, ldc, accumulate);
  } else {
    tile_portable(rows, num_blocks, a_rows, b_blocks, k_pairs, c, ldc, accumulate);
  }
}

void store_row_bf16(Isa isa, const float* src, bf16_t* dst, int64_t n) {
  if (isa >= Isa::kAvx512) return store_row_avx512(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = vec::f32_to_bf16(src[i]);
}

void silu_mul_row_bf16(Isa isa, const float* gate, const float* up, bf16_t* dst, int64_t n) {
  if (isa >= Isa::kAvx512) return silu_mul_avx512(gate, up, dst, n);
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = vec::f32_to_bf16(gate[i] / (1.f + std::exp(-gate[i])) * up[i]);
  }
}

void silu_mul_row_f32(Isa isa, const float* gate, const float* up, float* dst, int64_t n) {
  if (isa >= Isa::kAvx512) return silu_mul_avx512(gate, up, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

void axpy_row_f32(Isa isa, float alpha, const float* src, float* dst, int64_t n) {
  if (isa >= Isa::kAvx512) return axpy_avx512(alpha, src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] += alpha * src[i];
}

float* thread_scratch_f32(int64_t floats) {
  struct Buffer {
    std::unique_ptr<float, decltype(&std::free)> data{nullptr, &std::free};
    int64_t size = 0;
  };
  static thread_local Buffer buffer;
  if (buffer.size < floats) {
    const int64_t bytes = (floats * static_cast<int64_t>(sizeof(float)) + 63) / 64 * 64;
    buffer.data.reset(static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(bytes))));
    if (!buffer.data) throw std::bad_alloc();
    buffer.size = floats;
  }
  return buffer.data.get();
}

// ---- linear ----------------------------------------------------------------------------------

namespace {

// GEMM blocking (M > 6): M chunks of <= 240 rows x 64-column panels, K in chunks of 512 pairs:
// the panel's K slice (128 KB) and the chunk's A slice (<= 240 KB) stay in L2 across the tiles.
constexpr int64_t kGemmChunkRows = 240;
constexpr int64_t kGemmChunkPairs = 512;
constexpr int kGemmPanelBlocks = 2;
// Below this much work a fork/join costs more than it saves: run on the calling thread.
constexpr int64_t kGemvMinParallelBytes = 256 << 10;
constexpr int64_t kGemmMinParallelMacs = 1 << 21;

struct LinearArgs {
  const bf16_t* x;  // [M, 2 * k_pairs], row stride ldx
  int64_t m, ldx, k_pairs;
  const bf16_t* w;  // packed [ceil(N/32)][k_pairs][32][2]
  int64_t n;
  bf16_t* y;  // [M, N], row stride ldy
  int64_t ldy;
};

// Columns [32*block, 32*(block+num_blocks)) of all M <= 6 rows, full K, straight to y.
void gemv_panel(Isa isa, const LinearArgs& p, int64_t block, int num_blocks) {
  alignas(64) float tile[kTileMaxRows * kTileMaxBlocks * kPackBlockN];
  constexpr int64_t ldt = kTileMaxBlocks * kPackBlockN;
  const int rows = static_cast<int>(p.m);
  const bf16_t* a_rows[kTileMaxRows];
  const bf16_t* b_blocks[kTileMaxBlocks];
  for (int r = 0; r < rows; ++r) a_rows[r] = p.x + r * p.ldx;
  const int64_t block_elems = p.k_pairs * 2 * kPackBlockN;
  for (int i = 0; i < num_blocks; ++i) b_blocks[i] = p.w + (block + i) * block_elems;
  tile_gemm(isa, rows, num_blocks, a_rows, b_blocks, p.k_pairs, tile, ldt, false);
  const int64_t col0 = block * kPackBlockN;
  const int64_t cols = std::min<int64_t>(num_blocks * kPackBlockN, p.n - col0);
  for (int r = 0; r < rows; ++r) store_row_bf16(isa, tile + r * ldt, p.y + r * p.ldy + col0, cols);
}

// M <= 6: every weight is read once; tasks are panels of the widest tile. Reading 4 blocks at once
// keeps 4 weight streams in flight per thread, which measured faster than narrower panels even
// when that leaves the threads unevenly loaded (the one that finishes first frees bandwidth).
void linear_small_m(Isa isa, const LinearArgs& p) {
  const int64_t num_blocks = pack_num_blocks(p.n);
  int panel = tile_max_blocks(static_cast<int>(p.m));
  while (panel > 1 && num_blocks < 2 * num_threads() * panel) --panel;
  const int64_t num_panels = (num_blocks + panel - 1) / panel;
  const bool parallel = num_blocks * p.k_pairs * 4 * kPackBlockN >= kGemvMinParallelBytes;
  parallel_tasks(num_panels, parallel, [&](int64_t i) {
    const int64_t block = i * panel;
    gemv_panel(isa, p, block, static_cast<int>(std::min<int64_t>(panel, num_blocks - block)));
  });
}

// One (M chunk, panel) task: every 6-row tile of the chunk over each K chunk in turn.
void gemm_task(Isa isa, const LinearArgs& p, int64_t row0, int64_t rows, int64_t block,
               int num_blocks, float* acc) {
  const int64_t ldt = num_blocks * kPackBlockN;
  const int64_t block_elems = p.k_pairs * 2 * kPackBlockN;
  for (int64_t kp0 = 0; kp0 < p.k_pairs; kp0 += kGemmChunkPairs) {
    const int64_t pairs = std::min(kGemmChunkPairs, p.k_pairs - kp0);
    const bf16_t* b_blocks[kTileMaxBlocks];
    for (int i = 0; i < num_blocks; ++i) {
      b_blocks[i] = p.w + (block + i) * block_elems + kp0 * 2 * kPackBlockN;
    }
    for (int64_t t = 0; t < tile_count(rows); ++t) {
      const int64_t r0 = tile_begin(t, rows);
      const int tile_rows = static_cast<int>(tile_begin(t + 1, rows) - r0);
      const bf16_t* a_rows[kTileMaxRows];
      for (int r = 0; r < tile_rows; ++r) a_rows[r] = p.x + (row0 + r0 + r) * p.ldx + 2 * kp0;
      tile_gemm(isa, tile_rows, num_blocks, a_rows, b_blocks, pairs, acc + r0 * ldt, ldt, kp0 > 0);
    }
  }
  const int64_t col0 = block * kPackBlockN;
  const int64_t cols = std::min<int64_t>(ldt, p.n - col0);
  for (int64_t r = 0; r < rows; ++r) {
    store_row_bf16(isa, acc + r * ldt, p.y + (row0 + r) * p.ldy + col0, cols);
  }
}

void linear_large_m(Isa isa, const LinearArgs& p) {
  const int64_t num_blocks = pack_num_blocks(p.n);
  const int64_t num_panels = (num_blocks + kGemmPanelBlocks - 1) / kGemmPanelBlocks;
  // Equal chunks (multiples of the 6-row tile) rather than 240 + a ragged remainder.
  const int64_t num_chunks = (p.m + kGemmChunkRows - 1) / kGemmChunkRows;
  const int64_t chunk_rows = ((p.m + num_chunks - 1) / num_chunks + kTileMaxRows - 1) /
                             kTileMaxRows * kTileMaxRows;
  const bool parallel = p.m * p.n * p.k_pairs * 2 >= kGemmMinParallelMacs;
  // Tasks ordered [chunk][panel]: tasks running together share the chunk's A rows.
  parallel_tasks(num_chunks * num_panels, parallel, [&](int64_t t) {
    const int64_t row0 = t / num_panels * chunk_rows;
    const int64_t block = t % num_panels * kGemmPanelBlocks;
    if (row0 >= p.m) return;
    float* acc = thread_scratch_f32(chunk_rows * kGemmPanelBlocks * kPackBlockN);
    gemm_task(isa, p, row0, std::min(chunk_rows, p.m - row0), block,
              static_cast<int>(std::min<int64_t>(kGemmPanelBlocks, num_blocks - block)), acc);
  });
}

void linear_bf16(const LinearArgs& p) {
  if (p.m == 0 || p.n == 0) return;
  if (p.k_pairs == 0) {  // empty sum
    for (int64_t r = 0; r < p.m; ++r) std::fill(p.y + r * p.ldy, p.y + r * p.ldy + p.n, bf16_t{0});
    return;
  }
  const Isa isa = active_isa();
  if (p.m <= kTileMaxRows) {
    linear_small_m(isa, p);
  } else {
    linear_large_m(isa, p);
  }
}

}  // namespace

void register_gemm(py::module_& m) {
  m.def(
      "linear_bf16",
      [](uintptr_t x, int64_t m, int64_t ldx, int64_t k_pairs, uintptr_t w, int64_t n, uintptr_t y,
         int64_t ldy, const std::vector<int>& dtypes) {
        check_dtypes("linear_bf16", dtypes,
                     {{"x", DType::kBFloat16}, {"w", DType::kBFloat16}, {"y", DType::kBFloat16}});
        if (m < 0 || n < 0 || k_pairs < 0 || ldx < 2 * k_pairs || ldy < n) {
          throw std::invalid_argument("linear_bf16: bad sizes or strides");
        }
        linear_bf16(LinearArgs{reinterpret_cast<const bf16_t*>(x), m, ldx, k_pairs,
                               reinterpret_cast<const bf16_t*>(w), n, reinterpret_cast<bf16_t*>(y),
                               ldy});
      },
      py::call_guard<py::gil_scoped_release>(),
      "y[M, N] (row stride ldy) = x[M, 2*k_pairs] (row stride ldx) @ W^T, W packed bf16 "
      "(gemm_kernels.h layout); all bf16, fp32 accumulation.");
}

}  // namespace duet

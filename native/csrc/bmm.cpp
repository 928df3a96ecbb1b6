// Batched bf16 matmul out[n] = a[n] @ b[n] (a: [N, M, K], b: [N, K, P]), fp32 accumulation; the
// MLA weight absorption (q_nope @ W_UK, o_latent @ W_UV per head) runs through it.
// For a plain b, each task packs a K slice of one 64-column panel of b into the VNNI-2 layout of
// gemm_kernels.h in an L1-sized buffer, then runs the shared register tiles over every row of a
// against it: the repack is paid once per panel, not per row. A b prepacked once
// (`bmm_packed_bf16`, the model's constant weights) skips the repack.
#include <immintrin.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "common.h"
#include "cpu_features.h"
#include "decode_parts.h"
#include "gemm_kernels.h"
#include "vec.h"

namespace py = pybind11;

namespace duet {
namespace {

constexpr int kPanelBlocks = 2;
constexpr int64_t kChunkPairs = 128;  // 2 blocks x 128 pairs x 128 B = 32 KB of packed b

struct BmmArgs {
  const bf16_t* a;  // [N, M, 2 * k_pairs] with strides (sa0, sa1, 1)
  int64_t batch, m, k_pairs, sa0, sa1;
  const bf16_t* b;  // [N, K, P] with strides (sb0, sb1, 1)
  int64_t k, p, sb0, sb1;
  bf16_t* out;  // [N, M, P] contiguous
};

// dst [32][2] = interleave of (row0[j], row1[j]) for j < cols (<= 32), zero past cols.
void pack_pair_portable(const bf16_t* row0, const bf16_t* row1, int64_t cols, bf16_t* dst) {
  for (int64_t j = 0; j < kPackBlockN; ++j) {
    dst[2 * j] = j < cols ? row0[j] : 0;
    dst[2 * j + 1] = (j < cols && row1 != nullptr) ? row1[j] : 0;
  }
}

DUET_TARGET_AVX512 void pack_pair_avx512(const bf16_t* row0, const bf16_t* row1, int64_t cols,
                                         bf16_t* dst) {
  const __mmask32 m = vec::mask32(cols);
  const __m512i v0 = _mm512_maskz_loadu_epi16(m, row0);
  const __m512i v1 = row1 != nullptr ? _mm512_maskz_loadu_epi16(m, row1) : _mm512_setzero_si512();
  __m512i lo, hi;
  vec::interleave_pairs(v0, v1, &lo, &hi);
  _mm512_storeu_si512(dst, lo);
  _mm512_storeu_si512(dst + 32, hi);
}

// One (batch, panel) task: pack K chunks of the panel, run all 6-row tiles, store bf16.
void bmm_task(Isa isa, const BmmArgs& p, int64_t n, int64_t block0, float* acc) {
  alignas(64) bf16_t packed[kPanelBlocks][kChunkPairs * 2 * kPackBlockN];
  const int num_blocks =
      static_cast<int>(std::min<int64_t>(kPanelBlocks, pack_num_blocks(p.p) - block0));
  const int64_t ldt = num_blocks * kPackBlockN;
  const bf16_t* b = p.b + n * p.sb0;
  const bf16_t* a = p.a + n * p.sa0;
  const bf16_t* b_blocks[kPanelBlocks] = {packed[0], packed[1]};
  for (int64_t kp0 = 0; kp0 < p.k_pairs; kp0 += kChunkPairs) {
    const int64_t pairs = std::min(kChunkPairs, p.k_pairs - kp0);
    for (int i = 0; i < num_blocks; ++i) {
      const int64_t col0 = (block0 + i) * kPackBlockN;
      for (int64_t kp = 0; kp < pairs; ++kp) {
        const int64_t k0 = 2 * (kp0 + kp);
        const bf16_t* row0 = b + k0 * p.sb1 + col0;
        const bf16_t* row1 = k0 + 1 < p.k ? row0 + p.sb1 : nullptr;
        bf16_t* dst = packed[i] + kp * 2 * kPackBlockN;
        if (isa >= Isa::kAvx512) {
          pack_pair_avx512(row0, row1, p.p - col0, dst);
        } else {
          pack_pair_portable(row0, row1, p.p - col0, dst);
        }
      }
    }
    for (int64_t t = 0; t < tile_count(p.m); ++t) {
      const int64_t r0 = tile_begin(t, p.m);
      const int rows = static_cast<int>(tile_begin(t + 1, p.m) - r0);
      const bf16_t* a_rows[kTileMaxRows];
      for (int r = 0; r < rows; ++r) a_rows[r] = a + (r0 + r) * p.sa1 + 2 * kp0;
      tile_gemm(isa, rows, num_blocks, a_rows, b_blocks, pairs, acc + r0 * ldt, ldt, kp0 > 0);
    }
  }
  const int64_t col0 = block0 * kPackBlockN;
  const int64_t cols = std::min<int64_t>(ldt, p.p - col0);
  for (int64_t r = 0; r < p.m; ++r) {
    const float* src = acc + r * ldt;
    bf16_t* dst = p.out + (n * p.m + r) * p.p + col0;
    if (p.k_pairs == 0) {
      std::fill(dst, dst + cols, bf16_t{0});
    } else {
      store_row_bf16(isa, src, dst, cols);
    }
  }
}

// b prepacked once (PackedBmmArgs, decode_parts.h). A decode step's bmm is a GEMV per head:
// repacking b on every call would read and write b once more than the product reads it.
void bmm_packed_task(Isa isa, const PackedBmmArgs& p, int64_t n, int64_t block0, float* acc) {
  const int64_t p_blocks = pack_num_blocks(p.p);
  const int num_blocks = static_cast<int>(std::min<int64_t>(kPanelBlocks, p_blocks - block0));
  const int64_t ldt = num_blocks * kPackBlockN;
  const int64_t block_elems = p.k_pairs * 2 * kPackBlockN;
  const bf16_t* b_blocks[kPanelBlocks];
  for (int i = 0; i < num_blocks; ++i) b_blocks[i] = p.b + (n * p_blocks + block0 + i) * block_elems;
  const bf16_t* a = p.a + n * p.sa0;
  for (int64_t t = 0; t < tile_count(p.m); ++t) {
    const int64_t r0 = tile_begin(t, p.m);
    const int rows = static_cast<int>(tile_begin(t + 1, p.m) - r0);
    const bf16_t* a_rows[kTileMaxRows];
    for (int r = 0; r < rows; ++r) a_rows[r] = a + (r0 + r) * p.sa1;
    tile_gemm(isa, rows, num_blocks, a_rows, b_blocks, p.k_pairs, acc + r0 * ldt, ldt, false);
  }
  const int64_t col0 = block0 * kPackBlockN;
  const int64_t cols = std::min<int64_t>(ldt, p.p - col0);
  for (int64_t r = 0; r < p.m; ++r) {
    store_row_bf16(isa, acc + r * ldt, p.out + n * p.so0 + r * p.so1 + col0, cols);
  }
}

void bmm_bf16(const BmmArgs& p) {
  if (p.batch == 0 || p.m == 0 || p.p == 0) return;
  const Isa isa = active_isa();
  const int64_t num_panels = (pack_num_blocks(p.p) + kPanelBlocks - 1) / kPanelBlocks;
  const int64_t num_tasks = p.batch * num_panels;
  const bool parallel = p.batch * p.m * p.p * p.k >= (int64_t{1} << 20);
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t t = 0; t < num_tasks; ++t) {
    float* acc = thread_scratch_f32(p.m * kPanelBlocks * kPackBlockN);
    bmm_task(isa, p, t / num_panels, t % num_panels * kPanelBlocks, acc);
  }
}

}  // namespace

void bmm_packed_bf16(const PackedBmmArgs& p) {
  if (p.batch == 0 || p.m == 0 || p.p == 0) return;
  const Isa isa = active_isa();
  if (p.k_pairs == 0) {
    for (int64_t n = 0; n < p.batch; ++n) {
      for (int64_t r = 0; r < p.m; ++r) {
        std::fill_n(p.out + n * p.so0 + r * p.so1, p.p, bf16_t{0});
      }
    }
    return;
  }
  const int64_t num_panels = (pack_num_blocks(p.p) + kPanelBlocks - 1) / kPanelBlocks;
  const int64_t num_tasks = p.batch * num_panels;
  const bool parallel = p.batch * p.m * p.p * 2 * p.k_pairs >= (int64_t{1} << 20);
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t t = 0; t < num_tasks; ++t) {
    float* acc = thread_scratch_f32(p.m * kPanelBlocks * kPackBlockN);
    bmm_packed_task(isa, p, t / num_panels, t % num_panels * kPanelBlocks, acc);
  }
}

void register_bmm(py::module_& m) {
  m.def(
      "bmm_bf16",
      [](uintptr_t a, int64_t batch, int64_t m, int64_t k_pairs, int64_t sa0, int64_t sa1,
         uintptr_t b, int64_t k, int64_t p, int64_t sb0, int64_t sb1, uintptr_t out,
         const std::vector<int>& dtypes) {
        check_dtypes("bmm_bf16", dtypes,
                     {{"a", DType::kBFloat16}, {"b", DType::kBFloat16}, {"out", DType::kBFloat16}});
        if (batch < 0 || m < 0 || p < 0 || k < 0 || k_pairs != (k + 1) / 2) {
          throw std::invalid_argument("bmm_bf16: bad sizes");
        }
        bmm_bf16(BmmArgs{reinterpret_cast<const bf16_t*>(a), batch, m, k_pairs, sa0, sa1,
                         reinterpret_cast<const bf16_t*>(b), k, p, sb0, sb1,
                         reinterpret_cast<bf16_t*>(out)});
      },
      py::call_guard<py::gil_scoped_release>(),
      "out[N, M, P] (contiguous) = a[N, M, 2*k_pairs] @ b[N, K, P]; bf16, fp32 accumulation; "
      "a and b rows have unit stride, a's row starts 4-byte aligned.");
  m.def(
      "bmm_packed_bf16",
      [](uintptr_t a, int64_t batch, int64_t m, int64_t k_pairs, int64_t sa0, int64_t sa1,
         uintptr_t b, int64_t p, uintptr_t out, const std::vector<int>& dtypes) {
        check_dtypes("bmm_packed_bf16", dtypes,
                     {{"a", DType::kBFloat16}, {"b", DType::kBFloat16}, {"out", DType::kBFloat16}});
        if (batch < 0 || m < 0 || p < 0 || k_pairs < 0 || sa1 < 2 * k_pairs) {
          throw std::invalid_argument("bmm_packed_bf16: bad sizes or strides");
        }
        bmm_packed_bf16(PackedBmmArgs{reinterpret_cast<const bf16_t*>(a), batch, m, k_pairs, sa0,
                                      sa1, reinterpret_cast<const bf16_t*>(b), p,
                                      reinterpret_cast<bf16_t*>(out), m * p, p});
      },
      py::call_guard<py::gil_scoped_release>(),
      "out[N, M, P] (contiguous) = a[N, M, 2*k_pairs] @ b, b prepacked per batch entry as a "
      "PackedLinear of b^T [N, P, K] (native/_gemm_ops.py prepack_bmm); bf16, fp32 accumulation.");
}

}  // namespace duet

// FP8 e4m3 weight-only linear: y [M, N] bf16 = x [M, K] bf16 @ W^T, W held as 1-byte e4m3 in
// the packed layout of gemm_fp8_kernels.h with DeepSeek's 128 x 128 block scales.
//
// Math (the twin: native/reference.py linear_fp8): the kernel multiplies x by the exact e4m3
// values (converted to bf16, which holds every one of them exactly), sums the fp32 products of
// each 128-wide k block from zero and adds block scale * that sum to the fp32 accumulator; the
// output is rounded to bf16 once. Folding the scale into the accumulation keeps the weights in
// bf16 without a second rounding and costs one FMA per accumulator per 128 k.
//
// Drivers:
// - M <= 6 (decode GEMV) with vdpbf16ps + VBMI: the register tile of gemm_fp8_kernels.cpp
//   converts each weight in registers as it streams, so the weights are read once, 1 byte each.
// - otherwise (GEMM, or a CPU without those): per task (rows, panel of blocks) and 128-wide k
//   block, the panel's k block is converted once into an L1-resident bf16 buffer and bf16
//   register tiles run over it: with vdpbf16ps the tile of gemm_fp8_kernels.cpp folds the scale
//   in registers; otherwise gemm_kernels.h's tile_gemm (fp32 FMA or scalar) and an axpy.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>

#include "common.h"
#include "cpu_features.h"
#include "gemm_fp8_kernels.h"
#include "gemm_kernels.h"

namespace py = pybind11;

namespace duet {
namespace {

constexpr int64_t kGemmChunkRows = 240;
constexpr int kGemmPanelBlocks = 2;
// bf16 elements of one converted k block of one packed block.
constexpr int64_t kConvertedBlockElems = kFp8ScalePairs * 2 * kPackBlockN;
// Below this much work a fork/join costs more than it saves (as in gemm.cpp).
constexpr int64_t kGemvMinParallelBytes = 256 << 10;
constexpr int64_t kGemmMinParallelMacs = 1 << 21;

struct Fp8Args {
  const bf16_t* x;  // [M, 2 * k_pairs], row stride ldx
  int64_t m, ldx, k_pairs;
  const uint8_t* w;  // packed [ceil(N/32)][k_pairs][64]
  int64_t n;
  const float* scale;  // [ceil(N/128)][ld_scale]
  int64_t ld_scale;
  bf16_t* y;  // [M, N], row stride ldy
  int64_t ldy;

  const uint8_t* block(int64_t b) const { return w + b * k_pairs * kFp8RowBytes; }
  const float* scale_row(int64_t b) const { return scale + fp8_scale_row(b) * ld_scale; }
};

// fp32 floats of per-thread scratch a panel_via_bf16 call of `rows` rows and `blocks` needs.
int64_t panel_scratch_floats(int64_t rows, int blocks) {
  const int64_t ldt = blocks * kPackBlockN;
  return (rows + kTileMaxRows) * ldt + blocks * kConvertedBlockElems / 2;
}

// Rows [row0, row0 + rows) x columns of blocks [block, block + blocks), through a bf16 buffer
// per 128-wide k block; written to y as bf16. `scratch`: panel_scratch_floats(rows, blocks).
void panel_via_bf16(Isa isa, const Fp8Args& p, int64_t row0, int64_t rows, int64_t block,
                    int blocks, float* scratch) {
  const int64_t ldt = blocks * kPackBlockN;
  float* acc = scratch;                    // [rows][ldt], the scaled sums
  float* tmp = acc + rows * ldt;           // [6][ldt], one tile's sum over one k block
  auto* wbuf = reinterpret_cast<bf16_t*>(tmp + kTileMaxRows * ldt);  // [blocks][64][64]
  std::fill(acc, acc + rows * ldt, 0.f);
  const bf16_t* b_blocks[kTileMaxBlocks];
  for (int64_t kp0 = 0, kb = 0; kp0 < p.k_pairs; kp0 += kFp8ScalePairs, ++kb) {
    const int64_t pairs = std::min(kFp8ScalePairs, p.k_pairs - kp0);
    float scales[kTileMaxBlocks];
    for (int i = 0; i < blocks; ++i) {
      scales[i] = p.scale_row(block + i)[kb];
      b_blocks[i] = wbuf + i * kConvertedBlockElems;
      fp8_rows_to_bf16(isa, p.block(block + i) + kp0 * kFp8RowBytes, pairs,
                       wbuf + i * kConvertedBlockElems);
    }
    for (int64_t t = 0; t < tile_count(rows); ++t) {
      const int64_t r0 = tile_begin(t, rows);
      const int tile_rows = static_cast<int>(tile_begin(t + 1, rows) - r0);
      const bf16_t* a_rows[kTileMaxRows];
      for (int r = 0; r < tile_rows; ++r) a_rows[r] = p.x + (row0 + r0 + r) * p.ldx + 2 * kp0;
      if (isa >= Isa::kAvx512Bf16) {  // the scale folded in registers
        fp8_tile_scaled_bf16(tile_rows, blocks, a_rows, b_blocks, scales, pairs, acc + r0 * ldt,
                             ldt);
        continue;
      }
      tile_gemm(isa, tile_rows, blocks, a_rows, b_blocks, pairs, tmp, ldt, false);
      for (int r = 0; r < tile_rows; ++r) {
        for (int i = 0; i < blocks; ++i) {
          axpy_row_f32(isa, scales[i], tmp + r * ldt + i * kPackBlockN,
                       acc + (r0 + r) * ldt + i * kPackBlockN, kPackBlockN);
        }
      }
    }
  }
  const int64_t col0 = block * kPackBlockN;
  const int64_t cols = std::min(ldt, p.n - col0);
  for (int64_t r = 0; r < rows; ++r) {
    store_row_bf16(isa, acc + r * ldt, p.y + (row0 + r) * p.ldy + col0, cols);
  }
}

// All M <= 6 rows x blocks [block, block + blocks) with the in-register tile.
void gemv_panel_lut(Isa isa, const Fp8Args& p, int64_t block, int blocks) {
  alignas(64) float tile[kTileMaxRows * 4 * kPackBlockN];
  constexpr int64_t ldt = 4 * kPackBlockN;
  const int rows = static_cast<int>(p.m);
  const bf16_t* a_rows[kTileMaxRows];
  const uint8_t* b_blocks[4];
  const float* scales[4];
  for (int r = 0; r < rows; ++r) a_rows[r] = p.x + r * p.ldx;
  for (int i = 0; i < blocks; ++i) {
    b_blocks[i] = p.block(block + i);
    scales[i] = p.scale_row(block + i);
  }
  fp8_tile_lut(rows, blocks, a_rows, b_blocks, scales, p.k_pairs, tile, ldt);
  const int64_t col0 = block * kPackBlockN;
  const int64_t cols = std::min<int64_t>(blocks * kPackBlockN, p.n - col0);
  for (int r = 0; r < rows; ++r) store_row_bf16(isa, tile + r * ldt, p.y + r * p.ldy + col0, cols);
}

// M <= 6: every weight read once; tasks are panels of whole blocks (as gemm.cpp's GEMV).
void linear_small_m(Isa isa, const Fp8Args& p) {
  const int rows = static_cast<int>(p.m);
  const bool lut = fp8_lut_tile_available(isa);
  const int64_t num_blocks = pack_num_blocks(p.n);
  int panel = lut ? fp8_tile_max_blocks(rows) : tile_max_blocks(rows);
  while (panel > 1 && num_blocks < 2 * num_threads() * panel) --panel;
  const int64_t num_panels = (num_blocks + panel - 1) / panel;
  const bool parallel = num_blocks * p.k_pairs * kFp8RowBytes >= kGemvMinParallelBytes;
  parallel_tasks(num_panels, parallel, [&](int64_t i) {
    const int64_t block = i * panel;
    const int blocks = static_cast<int>(std::min<int64_t>(panel, num_blocks - block));
    if (lut) {
      gemv_panel_lut(isa, p, block, blocks);
    } else {
      panel_via_bf16(isa, p, 0, p.m, block, blocks,
                     thread_scratch_f32(panel_scratch_floats(p.m, blocks)));
    }
  });
}

// M > 6: tasks (M chunk of <= 240 rows, panel of 2 blocks), ordered [chunk][panel] so tasks
// running together share the chunk's rows of x.
void linear_large_m(Isa isa, const Fp8Args& p) {
  const int64_t num_blocks = pack_num_blocks(p.n);
  const int64_t num_panels = (num_blocks + kGemmPanelBlocks - 1) / kGemmPanelBlocks;
  const int64_t num_chunks = (p.m + kGemmChunkRows - 1) / kGemmChunkRows;
  const int64_t chunk_rows = ((p.m + num_chunks - 1) / num_chunks + kTileMaxRows - 1) /
                             kTileMaxRows * kTileMaxRows;
  const bool parallel = p.m * p.n * p.k_pairs * 2 >= kGemmMinParallelMacs;
  parallel_tasks(num_chunks * num_panels, parallel, [&](int64_t t) {
    const int64_t row0 = t / num_panels * chunk_rows;
    const int64_t block = t % num_panels * kGemmPanelBlocks;
    if (row0 >= p.m) return;
    const int blocks = static_cast<int>(std::min<int64_t>(kGemmPanelBlocks, num_blocks - block));
    float* scratch = thread_scratch_f32(panel_scratch_floats(chunk_rows, kGemmPanelBlocks));
    panel_via_bf16(isa, p, row0, std::min(chunk_rows, p.m - row0), block, blocks, scratch);
  });
}

void linear_fp8(const Fp8Args& p) {
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

// The binding's tensor checks (common.h), with this op's name in their errors.
template <typename T>
T* checked(const TensorArg& t, DType want, int64_t needed, const char* name) {
  return checked_tensor<T>("linear_fp8", t, want, needed, name);
}

}  // namespace

void register_gemm_fp8(py::module_& m) {
  m.def(
      "linear_fp8",
      [](const TensorArg& x, int64_t m, int64_t ldx, int64_t k_pairs, const TensorArg& w,
         int64_t n, const TensorArg& scale, int64_t ld_scale, const TensorArg& y, int64_t ldy) {
        const int64_t k_blocks = (k_pairs + kFp8ScalePairs - 1) / kFp8ScalePairs;
        const int64_t n_blocks = (n + kFp8ScaleRows - 1) / kFp8ScaleRows;
        if (m < 0 || n < 0 || k_pairs < 0 || ldx < 2 * k_pairs || ldy < n ||
            ld_scale < k_blocks) {
          throw std::invalid_argument("linear_fp8: bad sizes or strides");
        }
        const auto rows_extent = [](int64_t rows, int64_t ld, int64_t width) {
          return rows == 0 || width == 0 ? 0 : (rows - 1) * ld + width;
        };
        const auto* px = checked<const bf16_t>(x, DType::kBFloat16,
                                               rows_extent(m, ldx, 2 * k_pairs), "x");
        if (reinterpret_cast<uintptr_t>(px) % 4 != 0 || (m > 1 && ldx % 2 != 0)) {
          throw std::invalid_argument("linear_fp8: x rows must start 4-byte aligned");
        }
        const auto* pw = checked<const uint8_t>(
            w, DType::kFloat8E4M3, pack_num_blocks(n) * k_pairs * kFp8RowBytes, "packed weight");
        const auto* ps = checked<const float>(scale, DType::kFloat32,
                                              rows_extent(n_blocks, ld_scale, k_blocks), "scale");
        auto* py_ = checked<bf16_t>(y, DType::kBFloat16, rows_extent(m, ldy, n), "y");
        py::gil_scoped_release release;
        linear_fp8(Fp8Args{px, m, ldx, k_pairs, pw, n, ps, ld_scale, py_, ldy});
      },
      "y[M, N] bf16 (row stride ldy) = x[M, 2*k_pairs] bf16 (row stride ldx) @ W^T, W packed "
      "e4m3 (gemm_fp8_kernels.h layout) with fp32 block scales [ceil(N/128)][ld_scale]; each "
      "tensor is (data_ptr, duet::DType tag, numel).");
}

}  // namespace duet

// INT8 W8A8 linear: y [M, N] = dequant(quant(x) [M, K] @ Wq [N, K]^T), Wq prepacked as in
// gemm_int8.h, x bf16 or fp32, y of x's dtype. The drivers mirror the bf16 ones of gemm.cpp:
// - entry: every row of x is quantized once (per-token absmax, u8 bytes + fp32 scale) into a
//   buffer of the calling thread, in parallel over rows when M is large;
// - M <= 6 (decode GEMV): one tile row covers all of M, so every weight byte is read once; tasks
//   are panels of 1-4 blocks (16-64 output columns), each a few contiguous weight streams;
// - M > 6 (prefill GEMM): tasks = (M chunk, 64-column panel); inside a task K is cut in chunks
//   so the panel's K slice stays in L2 while every 6-row tile of the chunk runs over it,
//   accumulating int32 in a per-thread buffer; the epilogue dequantizes once per output.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "gemm_int8.h"
#include "gemm_kernels.h"  // store_row_bf16

namespace py = pybind11;

namespace duet {
namespace {

// GEMM blocking (M > 6): chunks of <= 240 rows x 64-column panels, K in chunks of 512 groups
// (2048 inputs): the panel's K slice (128 KB) and the chunk's A slice (<= 480 KB) stay in L2.
constexpr int64_t kChunkRows = 240;
constexpr int64_t kChunkGroups = 512;
constexpr int kPanelBlocks = kInt8TileMaxBlocks;
// Below this much work a fork/join costs more than it saves: run on the calling thread.
constexpr int64_t kGemvMinParallelBytes = 128 << 10;
constexpr int64_t kGemmMinParallelMacs = 1 << 22;
constexpr int64_t kQuantizeMinParallelValues = 1 << 16;

struct Args {
  const void* x;  // [M, K] of x_dtype, row stride ldx
  DType x_dtype;
  int64_t m, ldx, k;
  const int8_t* w;  // packed [ceil(N/16)][k_groups][16][4]
  const float* w_scale;  // [>= N]
  const int32_t* comp;   // [>= N], 128 * column sums of Wq
  int64_t n, k_groups;
  void* y;  // [M, N] of x_dtype, row stride ldy
  int64_t ldy;
};

// The quantized activations: row r is q + r * ld (u8 bytes), its scale scale[r].
struct QuantizedRows {
  const uint8_t* q;
  const float* scale;
  int64_t ld;
};

QuantizedRows quantize_input(Isa isa, const Args& p) {
  static thread_local std::vector<uint8_t> q_buffer;
  static thread_local std::vector<float> scale_buffer;
  const int64_t ld = 4 * p.k_groups;
  uint8_t* q = thread_buffer(q_buffer, p.m * ld);
  float* scale = thread_buffer(scale_buffer, p.m);
  const int64_t elem = p.x_dtype == DType::kBFloat16 ? 2 : 4;
  const auto* x = static_cast<const char*>(p.x);
  parallel_for(
      p.m,
      [&](int64_t begin, int64_t end) {
        quantize_rows_int8(isa, x + begin * p.ldx * elem, p.x_dtype, p.ldx, end - begin, p.k,
                           p.k_groups, q + begin * ld, scale + begin);
      },
      std::max<int64_t>(1, kQuantizeMinParallelValues / std::max<int64_t>(p.k, 1)));
  return QuantizedRows{q, scale, ld};
}

// Dequantizes `rows` rows of an int32 tile (row stride ldt) into y rows row0.. at columns col0..
void store_tile(Isa isa, const Args& p, const QuantizedRows& a, const int32_t* tile, int64_t ldt,
                int64_t row0, int64_t rows, int64_t col0, int64_t cols) {
  alignas(64) float values[kInt8TileMaxBlocks * kInt8BlockN];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r;
    const float a_scale = a.scale[row];
    if (p.x_dtype == DType::kBFloat16) {
      dequant_row_int8(isa, tile + r * ldt, p.comp + col0, p.w_scale + col0, a_scale, values,
                       cols);
      store_row_bf16(isa, values, static_cast<bf16_t*>(p.y) + row * p.ldy + col0, cols);
    } else {
      dequant_row_int8(isa, tile + r * ldt, p.comp + col0, p.w_scale + col0, a_scale,
                       static_cast<float*>(p.y) + row * p.ldy + col0, cols);
    }
  }
}

// Columns [16*block, 16*(block+num_blocks)) of all M <= 6 rows, full K, straight to y.
void gemv_panel(Isa isa, const Args& p, const QuantizedRows& a, int64_t block, int num_blocks) {
  alignas(64) int32_t tile[kInt8TileMaxRows * kInt8TileMaxBlocks * kInt8BlockN];
  constexpr int64_t ldt = kInt8TileMaxBlocks * kInt8BlockN;
  const int rows = static_cast<int>(p.m);
  const uint8_t* a_rows[kInt8TileMaxRows];
  const int8_t* b_blocks[kInt8TileMaxBlocks];
  for (int r = 0; r < rows; ++r) a_rows[r] = a.q + r * a.ld;
  for (int i = 0; i < num_blocks; ++i) {
    b_blocks[i] = p.w + (block + i) * int8_block_bytes(p.k_groups);
  }
  tile_int8(isa, rows, num_blocks, a_rows, b_blocks, p.k_groups, tile, ldt, false);
  const int64_t col0 = block * kInt8BlockN;
  store_tile(isa, p, a, tile, ldt, 0, rows, col0,
             std::min<int64_t>(num_blocks * kInt8BlockN, p.n - col0));
}

// M <= 6: every weight byte is read once. Panels of 4 blocks keep 4 weight streams in flight per
// thread; narrower panels only when there are too few to share among the threads.
void linear_small_m(Isa isa, const Args& p, const QuantizedRows& a) {
  const int64_t num_blocks = int8_num_blocks(p.n);
  int panel = kPanelBlocks;
  while (panel > 1 && num_blocks < 2 * num_threads() * panel) --panel;
  const int64_t num_panels = (num_blocks + panel - 1) / panel;
  const bool parallel = num_blocks * int8_block_bytes(p.k_groups) >= kGemvMinParallelBytes;
  parallel_tasks(num_panels, parallel, [&](int64_t i) {
    const int64_t block = i * panel;
    gemv_panel(isa, p, a, block, static_cast<int>(std::min<int64_t>(panel, num_blocks - block)));
  });
}

// One (M chunk, panel) task: every tile of the chunk over each K chunk in turn.
void gemm_task(Isa isa, const Args& p, const QuantizedRows& a, int64_t row0, int64_t rows,
               int64_t block, int num_blocks) {
  static thread_local std::vector<int32_t> acc_buffer;
  int32_t* acc = thread_buffer(acc_buffer, rows * kPanelBlocks * kInt8BlockN);
  const int64_t ldt = num_blocks * kInt8BlockN;
  const int64_t tiles = (rows + kInt8TileMaxRows - 1) / kInt8TileMaxRows;
  for (int64_t g0 = 0; g0 < p.k_groups; g0 += kChunkGroups) {
    const int64_t groups = std::min(kChunkGroups, p.k_groups - g0);
    const int8_t* b_blocks[kInt8TileMaxBlocks];
    for (int i = 0; i < num_blocks; ++i) {
      b_blocks[i] = p.w + (block + i) * int8_block_bytes(p.k_groups) + g0 * 4 * kInt8BlockN;
    }
    for (int64_t t = 0; t < tiles; ++t) {
      // Near-equal tile heights: 7 rows -> 3 + 4, not 6 + 1 (too few accumulators).
      const int64_t r0 = t * rows / tiles;
      const int tile_rows = static_cast<int>((t + 1) * rows / tiles - r0);
      const uint8_t* a_rows[kInt8TileMaxRows];
      for (int r = 0; r < tile_rows; ++r) a_rows[r] = a.q + (row0 + r0 + r) * a.ld + 4 * g0;
      tile_int8(isa, tile_rows, num_blocks, a_rows, b_blocks, groups, acc + r0 * ldt, ldt, g0 > 0);
    }
  }
  const int64_t col0 = block * kInt8BlockN;
  store_tile(isa, p, a, acc, ldt, row0, rows, col0, std::min<int64_t>(ldt, p.n - col0));
}

void linear_large_m(Isa isa, const Args& p, const QuantizedRows& a) {
  const int64_t num_blocks = int8_num_blocks(p.n);
  const int64_t num_panels = (num_blocks + kPanelBlocks - 1) / kPanelBlocks;
  // Equal chunks (multiples of the 6-row tile) rather than 240 + a ragged remainder.
  const int64_t chunk_rows = equal_chunk_rows(p.m, kChunkRows, kInt8TileMaxRows);
  const int64_t num_chunks = (p.m + chunk_rows - 1) / chunk_rows;
  const bool parallel = p.m * p.n * p.k_groups * 4 >= kGemmMinParallelMacs;
  // Tasks ordered [chunk][panel]: tasks running together share the chunk's A rows.
  parallel_tasks(num_chunks * num_panels, parallel, [&](int64_t t) {
    const int64_t row0 = t / num_panels * chunk_rows;
    const int64_t block = t % num_panels * kPanelBlocks;
    if (row0 >= p.m) return;
    gemm_task(isa, p, a, row0, std::min(chunk_rows, p.m - row0), block,
              static_cast<int>(std::min<int64_t>(kPanelBlocks, num_blocks - block)));
  });
}

void linear_int8(const Args& p) {
  if (p.m == 0 || p.n == 0) return;
  const Isa isa = active_isa();
  const QuantizedRows a = quantize_input(isa, p);
  if (p.m <= kInt8TileMaxRows) {
    linear_small_m(isa, p, a);
  } else {
    linear_large_m(isa, p, a);
  }
}

}  // namespace

void register_gemm_int8(py::module_& m) {
  m.def(
      "linear_int8",
      [](uintptr_t x, int x_dtype, int64_t m, int64_t k, int64_t ldx, uintptr_t w, int w_dtype,
         uintptr_t w_scale, int w_scale_dtype, uintptr_t comp, int comp_dtype, int64_t n,
         int64_t k_groups, uintptr_t y, int y_dtype, int64_t ldy) {
        if (x_dtype != static_cast<int>(DType::kBFloat16) &&
            x_dtype != static_cast<int>(DType::kFloat32)) {
          throw std::invalid_argument("linear_int8: x must be bfloat16 or float32");
        }
        check_dtype("linear_int8", y_dtype, static_cast<DType>(x_dtype), "y (x's dtype)");
        check_dtype("linear_int8", w_dtype, DType::kInt8, "packed weight");
        check_dtype("linear_int8", w_scale_dtype, DType::kFloat32, "w_scale");
        check_dtype("linear_int8", comp_dtype, DType::kInt32, "comp");
        if (m < 0 || n < 0 || k < 0 || k_groups != int8_k_groups(k) || 4 * k_groups > kInt8MaxK ||
            (m > 0 && ldx < k) || ldy < n) {
          throw std::invalid_argument("linear_int8: bad sizes or strides");
        }
        linear_int8(Args{reinterpret_cast<const void*>(x), static_cast<DType>(x_dtype), m, ldx, k,
                         reinterpret_cast<const int8_t*>(w),
                         reinterpret_cast<const float*>(w_scale),
                         reinterpret_cast<const int32_t*>(comp), n, k_groups,
                         reinterpret_cast<void*>(y), ldy});
      },
      py::call_guard<py::gil_scoped_release>(),
      "y[M, N] (row stride ldy, x's dtype) = dequant(quant_per_token(x[M, K]) @ Wq^T); x bf16 or "
      "fp32 with row stride ldx, Wq packed int8 (gemm_int8.h layout) with per-column w_scale "
      "(fp32) and comp = 128 * column sums (int32); int32 accumulation.");
}

}  // namespace duet

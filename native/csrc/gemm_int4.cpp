// INT4 W4A8 linear: y [M, N] = a_scale * sum_g s[g] * (quant(x) Wq_g^T), Wq packed as in
// gemm_int4.h, x bf16 or fp32, y of x's dtype. The drivers mirror the int8 ones (gemm_int8.cpp):
// - entry: every row of x is quantized once (signed bytes, fp32 scale, per-group sums);
// - M <= 6 (decode GEMV): one tile covers all of M, so every weight byte is read once; tasks are
//   panels of 1-4 blocks (16-64 output columns), each a few contiguous weight streams;
// - M > 6 (prefill GEMM): tasks = (M chunk, 64-column panel); inside a task K is cut in chunks of
//   whole groups so the panel's K slice stays in L2 while every 6-row tile of the chunk runs over
//   it, accumulating fp32 in a per-thread buffer; the epilogue scales by a_scale once per output.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "gemm_int4.h"
#include "gemm_kernels.h"  // store_row_bf16

namespace py = pybind11;

namespace duet {
namespace {

constexpr int64_t kChunkRows = 240;
constexpr int64_t kChunkInputs = 4096;  // the panel's K slice: 4096 / 2 * 64 = 128 KB
constexpr int kPanelBlocks = kInt4TileMaxBlocks;
constexpr int64_t kGemvMinParallelBytes = 128 << 10;
constexpr int64_t kGemmMinParallelMacs = 1 << 22;
constexpr int64_t kQuantizeMinParallelValues = 1 << 16;

struct Args {
  const void* x;  // [M, K] of x_dtype, row stride ldx
  DType x_dtype;
  int64_t m, ldx, k;
  const uint8_t* w;      // packed [ceil(N/16)][Kp/8][16][4]
  const float* scales;   // [ceil(N/16)][num_groups][16]
  int64_t n, group, num_groups;
  void* y;  // [M, N] of x_dtype, row stride ldy
  int64_t ldy;
};

// The quantized activations: row r is q + r * ld (signed bytes), its scale scale[r], its group
// sums sums + r * num_groups.
struct ActRows {
  const int8_t* q;
  const float* scale;
  const int32_t* sums;
  int64_t ld, num_groups;
};

ActRows quantize_input(Isa isa, const Args& p) {
  static thread_local std::vector<int8_t> q_buffer;
  static thread_local std::vector<float> scale_buffer;
  static thread_local std::vector<int32_t> sum_buffer;
  const int64_t ld = p.num_groups * p.group;
  int8_t* q = thread_buffer(q_buffer, p.m * ld);
  float* scale = thread_buffer(scale_buffer, p.m);
  int32_t* sums = thread_buffer(sum_buffer, p.m * p.num_groups);
  const int64_t elem = p.x_dtype == DType::kBFloat16 ? 2 : 4;
  const auto* x = static_cast<const char*>(p.x);
  parallel_for(
      p.m,
      [&](int64_t begin, int64_t end) {
        quantize_rows_int4act(isa, x + begin * p.ldx * elem, p.x_dtype, p.ldx, end - begin, p.k,
                              p.group, p.num_groups, q + begin * ld, scale + begin,
                              sums + begin * p.num_groups);
      },
      std::max<int64_t>(1, kQuantizeMinParallelValues / std::max<int64_t>(p.k, 1)));
  return ActRows{q, scale, sums, ld, p.num_groups};
}

// y rows row0.. at columns col0.. = a_scale * the fp32 tile (row stride ldt).
void store_tile(Isa isa, const Args& p, const ActRows& a, float* tile, int64_t ldt, int64_t row0,
                int64_t rows, int64_t col0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r;
    float* values = tile + r * ldt;
    const float a_scale = a.scale[row];
    for (int64_t j = 0; j < cols; ++j) values[j] *= a_scale;
    if (p.x_dtype == DType::kBFloat16) {
      store_row_bf16(isa, values, static_cast<bf16_t*>(p.y) + row * p.ldy + col0, cols);
    } else {
      std::copy(values, values + cols, static_cast<float*>(p.y) + row * p.ldy + col0);
    }
  }
}

// One tile of `rows` rows from row0 over groups [g0, g0 + groups) of blocks block.. into c.
void run_tile(Isa isa, const Args& p, const ActRows& a, int64_t row0, int rows, int64_t block,
              int num_blocks, int64_t g0, int64_t groups, float* c, int64_t ldc) {
  const int8_t* a_rows[kInt4TileMaxRows];
  const int32_t* a_sums[kInt4TileMaxRows];
  const uint8_t* b_blocks[kInt4TileMaxBlocks];
  const float* b_scales[kInt4TileMaxBlocks];
  for (int r = 0; r < rows; ++r) {
    a_rows[r] = a.q + (row0 + r) * a.ld + g0 * p.group;
    a_sums[r] = a.sums + (row0 + r) * a.num_groups + g0;
  }
  const int64_t block_bytes = int4_block_bytes(p.num_groups, p.group);
  for (int i = 0; i < num_blocks; ++i) {
    b_blocks[i] = p.w + (block + i) * block_bytes + g0 * p.group / 8 * 64;
    b_scales[i] = p.scales + ((block + i) * p.num_groups + g0) * kInt4BlockN;
  }
  tile_int4(isa, rows, num_blocks, a_rows, a_sums, b_blocks, b_scales, groups, p.group, c, ldc);
}

// M <= 6: every weight byte is read once.
void linear_small_m(Isa isa, const Args& p, const ActRows& a) {
  const int64_t num_blocks = int4_num_blocks(p.n);
  int panel = kPanelBlocks;
  while (panel > 1 && num_blocks < 2 * num_threads() * panel) --panel;
  const int64_t num_panels = (num_blocks + panel - 1) / panel;
  const bool parallel =
      num_blocks * int4_block_bytes(p.num_groups, p.group) >= kGemvMinParallelBytes;
  parallel_tasks(num_panels, parallel, [&](int64_t t) {
    alignas(64) float tile[kInt4TileMaxRows * kInt4TileMaxBlocks * kInt4BlockN];
    constexpr int64_t ldt = kInt4TileMaxBlocks * kInt4BlockN;
    const int64_t block = t * panel;
    const int num = static_cast<int>(std::min<int64_t>(panel, num_blocks - block));
    std::fill(tile, tile + p.m * ldt, 0.f);
    run_tile(isa, p, a, 0, static_cast<int>(p.m), block, num, 0, p.num_groups, tile, ldt);
    const int64_t col0 = block * kInt4BlockN;
    store_tile(isa, p, a, tile, ldt, 0, p.m, col0,
               std::min<int64_t>(num * kInt4BlockN, p.n - col0));
  });
}

// One (M chunk, panel) task: every tile of the chunk over each K chunk in turn. On AVX-512 the
// panel's K chunk is unpacked once into a per-thread copy the tiles read (gemm_int4.h).
void gemm_task(Isa isa, const Args& p, const ActRows& a, int64_t row0, int64_t rows,
               int64_t block, int num_blocks) {
  static thread_local std::vector<float> acc_buffer;
  static thread_local std::vector<uint8_t> unpacked_buffer;
  const int64_t ldt = num_blocks * kInt4BlockN;
  float* acc = thread_buffer(acc_buffer, rows * ldt);
  std::fill(acc, acc + rows * ldt, 0.f);
  const int64_t chunk_groups = std::max<int64_t>(1, kChunkInputs / p.group);
  const int64_t tiles = (rows + kInt4TileMaxRows - 1) / kInt4TileMaxRows;
  const bool unpack = int4_unpacked_tiles(isa);
  const int64_t block_bytes = int4_block_bytes(p.num_groups, p.group);
  for (int64_t g0 = 0; g0 < p.num_groups; g0 += chunk_groups) {
    const int64_t groups = std::min(chunk_groups, p.num_groups - g0);
    const uint8_t* unpacked[kInt4TileMaxBlocks];
    if (unpack) {
      const int64_t chunk_rows = groups * p.group / 8;  // 64-byte rows of a block in the chunk
      uint8_t* copy = thread_buffer(unpacked_buffer, num_blocks * chunk_rows * 128);
      for (int i = 0; i < num_blocks; ++i) {
        const uint8_t* src = p.w + (block + i) * block_bytes + g0 * p.group / 8 * 64;
        unpack_int4_rows(src, chunk_rows, copy + i * chunk_rows * 128);
        unpacked[i] = copy + i * chunk_rows * 128;
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * rows / tiles;  // near-equal tile heights
      const int tile_rows = static_cast<int>((t + 1) * rows / tiles - r0);
      if (!unpack) {
        run_tile(isa, p, a, row0 + r0, tile_rows, block, num_blocks, g0, groups, acc + r0 * ldt,
                 ldt);
        continue;
      }
      const int8_t* a_rows[kInt4TileMaxRows];
      const int32_t* a_sums[kInt4TileMaxRows];
      const float* b_scales[kInt4TileMaxBlocks];
      for (int r = 0; r < tile_rows; ++r) {
        a_rows[r] = a.q + (row0 + r0 + r) * a.ld + g0 * p.group;
        a_sums[r] = a.sums + (row0 + r0 + r) * a.num_groups + g0;
      }
      for (int i = 0; i < num_blocks; ++i) {
        b_scales[i] = p.scales + ((block + i) * p.num_groups + g0) * kInt4BlockN;
      }
      tile_int4_unpacked(isa, tile_rows, num_blocks, a_rows, a_sums, unpacked, b_scales, groups,
                         p.group, acc + r0 * ldt, ldt);
    }
  }
  const int64_t col0 = block * kInt4BlockN;
  store_tile(isa, p, a, acc, ldt, row0, rows, col0, std::min<int64_t>(ldt, p.n - col0));
}

void linear_large_m(Isa isa, const Args& p, const ActRows& a) {
  const int64_t num_blocks = int4_num_blocks(p.n);
  const int64_t num_panels = (num_blocks + kPanelBlocks - 1) / kPanelBlocks;
  const int64_t chunk_rows = equal_chunk_rows(p.m, kChunkRows, kInt4TileMaxRows);
  const int64_t num_chunks = (p.m + chunk_rows - 1) / chunk_rows;
  const bool parallel = p.m * p.n * p.num_groups * p.group >= kGemmMinParallelMacs;
  parallel_tasks(num_chunks * num_panels, parallel, [&](int64_t t) {
    const int64_t row0 = t / num_panels * chunk_rows;
    const int64_t block = t % num_panels * kPanelBlocks;
    if (row0 >= p.m) return;
    gemm_task(isa, p, a, row0, std::min(chunk_rows, p.m - row0), block,
              static_cast<int>(std::min<int64_t>(kPanelBlocks, num_blocks - block)));
  });
}

void linear_int4(const Args& p) {
  if (p.m == 0 || p.n == 0) return;
  const Isa isa = active_isa();
  const ActRows a = quantize_input(isa, p);
  if (p.m <= kInt4TileMaxRows) {
    linear_small_m(isa, p, a);
  } else {
    linear_large_m(isa, p, a);
  }
}

}  // namespace

void register_gemm_int4(py::module_& m) {
  m.def(
      "linear_int4",
      [](uintptr_t x, int x_dtype, int64_t m, int64_t k, int64_t ldx, uintptr_t w, int w_dtype,
         uintptr_t scales, int scales_dtype, int64_t n, int64_t group, uintptr_t y, int y_dtype,
         int64_t ldy) {
        if (x_dtype != static_cast<int>(DType::kBFloat16) &&
            x_dtype != static_cast<int>(DType::kFloat32)) {
          throw std::invalid_argument("linear_int4: x must be bfloat16 or float32");
        }
        check_dtype("linear_int4", y_dtype, static_cast<DType>(x_dtype), "y (x's dtype)");
        check_dtype("linear_int4", w_dtype, DType::kUInt8, "packed weight");
        check_dtype("linear_int4", scales_dtype, DType::kFloat32, "scales");
        if (m < 0 || n < 0 || k < 0 || !int4_group_ok(group) || (m > 0 && ldx < k) || ldy < n) {
          throw std::invalid_argument("linear_int4: bad sizes, group or strides");
        }
        linear_int4(Args{reinterpret_cast<const void*>(x), static_cast<DType>(x_dtype), m, ldx, k,
                         reinterpret_cast<const uint8_t*>(w),
                         reinterpret_cast<const float*>(scales), n, group,
                         int4_num_groups(k, group), reinterpret_cast<void*>(y), ldy});
      },
      py::call_guard<py::gil_scoped_release>(),
      "y[M, N] (row stride ldy, x's dtype) = W4A8 x[M, K] @ W^T; x bf16 or fp32 with row stride "
      "ldx, W packed int4 (gemm_int4.h layout, uint8) with fp32 group scales; int32 sums per "
      "group, fp32 accumulation.");
}

}  // namespace duet

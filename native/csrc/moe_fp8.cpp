// Fused routed-expert MoE with FP8 e4m3 weights (weight-only, DeepSeek's 128 x 128 block scales):
// out[t] = sum_k w[t,k] * W2_e (silu(G_e x_t) * (U_e x_t)), e = id[t,k] - expert_offset, as the
// bf16 fused MoE (moe.cpp), with each weight matrix in the packed fp8 layout of
// gemm_fp8_kernels.h.
//
// NOTE: math and structure.
// The stages of moe.cpp: a counting sort of the (token, k) pairs by local expert; gate/up tasks
// (expert, 64 columns of I) writing silu(gate) * up as bf16 into h; down tasks (128 columns of D,
// one scale row) walking every expert's rows into an fp32 [T, 128] buffer in a fixed order.
// Each product is the linear_fp8 math (gemm_fp8.cpp): x times the exact e4m3 values (every one is
// a bf16), fp32 sums per 128-wide k block started from zero, block scale * sum added to the fp32
// accumulator. Paths per tile of <= 6 rows:
// - vdpbf16ps + VBMI and an expert with <= 6 rows (decode): gemm_fp8_kernels.cpp's in-register
//   tile converts the weights as they stream, read once at 1 byte each;
// - otherwise: per task and k block, the task's weight blocks are converted once into an
//   L1-resident bf16 buffer, reused by every row tile of the expert; vdpbf16ps folds the scale in
//   registers, other ISAs use tile_gemm (fp32 FMA or scalar) and an axpy.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "gemm_fp8_kernels.h"
#include "gemm_kernels.h"
#include "moe_routing.h"

namespace py = pybind11;

namespace duet {
namespace {

constexpr int kGateUpBlocks = 2;  // blocks of I per gate/up task (each with its gate and up half)
constexpr int kDownBlocks = 4;    // blocks of D per down task: 128 columns, one scale row
constexpr int64_t kMinParallelBytes = 256 << 10;
constexpr int64_t kConvertedBlockElems = kFp8ScalePairs * 2 * kPackBlockN;

struct MoeFp8Args {
  const bf16_t* x;  // [T, 2 * d_pairs], row stride ldx
  int64_t num_tokens, ldx, d_pairs;
  const uint8_t* w13;     // packed [E][2 (gate, up)][ceil(I/32)][d_pairs][64]
  const float* scale13;   // [E][2][ceil(I/128)][ceil(D/128)]
  const uint8_t* w2;      // packed [E][ceil(D/32)][i_pairs][64]
  const float* scale2;    // [E][ceil(D/128)][ceil(I/128)]
  int64_t num_experts, inter, hidden;
  const float* topk_weights;  // [T, K]
  const int32_t* topk_ids;    // [T, K] global ids
  int64_t top_k, expert_offset;
  bf16_t* out;  // [T, hidden], row stride ldo
  int64_t ldo;

  int64_t i_pairs() const { return pack_k_pairs(inter); }
  int64_t d_scale_cols() const { return (hidden + 127) / 128; }
  int64_t i_scale_cols() const { return (inter + 127) / 128; }
};

// fp32 floats of scratch fp8_panel needs for `rows` rows (besides c).
constexpr int64_t kPanelScratchFloats =
    kTileMaxRows * kTileMaxBlocks * kPackBlockN + kTileMaxBlocks * kConvertedBlockElems / 2;

// c [rows, 32 * num_blocks] (row stride ldc, overwritten) = a_rows (rows of 2 * k_pairs bf16)
// times num_blocks <= 4 packed fp8 blocks (b_blocks[i] its row 0, scales[i] its scale row), the
// scale of each 128-wide k block applied to that block's fp32 sum. `scratch`: kPanelScratchFloats.
void fp8_panel(Isa isa, int64_t rows, const bf16_t* const* a_rows, int num_blocks,
               const uint8_t* const* b_blocks, const float* const* scales, int64_t k_pairs,
               float* c, int64_t ldc, float* scratch) {
  if (rows <= kTileMaxRows && k_pairs > 0 && fp8_lut_tile_available(isa)) {
    const int r = static_cast<int>(rows);
    const int step = fp8_tile_max_blocks(r);
    for (int i = 0; i < num_blocks; i += step) {
      fp8_tile_lut(r, std::min(step, num_blocks - i), a_rows, b_blocks + i, scales + i, k_pairs,
                   c + i * kPackBlockN, ldc);
    }
    return;
  }
  const int64_t cols = num_blocks * kPackBlockN;
  for (int64_t r = 0; r < rows; ++r) std::fill(c + r * ldc, c + r * ldc + cols, 0.f);
  float* tmp = scratch;  // [6][4 * 32]: one tile's sum over one k block (non-bf16 paths)
  constexpr int64_t ldt = kTileMaxBlocks * kPackBlockN;
  auto* wbuf = reinterpret_cast<bf16_t*>(tmp + kTileMaxRows * ldt);  // [blocks][64][64]
  const bf16_t* converted[kTileMaxBlocks];
  for (int64_t kp0 = 0, kb = 0; kp0 < k_pairs; kp0 += kFp8ScalePairs, ++kb) {
    const int64_t pairs = std::min(kFp8ScalePairs, k_pairs - kp0);
    float block_scales[kTileMaxBlocks];
    for (int i = 0; i < num_blocks; ++i) {
      block_scales[i] = scales[i][kb];
      converted[i] = wbuf + i * kConvertedBlockElems;
      fp8_rows_to_bf16(isa, b_blocks[i] + kp0 * kFp8RowBytes, pairs,
                       wbuf + i * kConvertedBlockElems);
    }
    for (int64_t t = 0; t < tile_count(rows); ++t) {
      const int64_t r0 = tile_begin(t, rows);
      const int tile_rows = static_cast<int>(tile_begin(t + 1, rows) - r0);
      const bf16_t* a[kTileMaxRows];
      for (int r = 0; r < tile_rows; ++r) a[r] = a_rows[r0 + r] + 2 * kp0;
      const int step = tile_max_blocks(tile_rows);
      for (int i = 0; i < num_blocks; i += step) {
        const int nb = std::min(step, num_blocks - i);
        float* dst = c + r0 * ldc + i * kPackBlockN;
        if (isa >= Isa::kAvx512Bf16) {  // the scale folded in registers
          fp8_tile_scaled_bf16(tile_rows, nb, a, converted + i, block_scales + i, pairs, dst, ldc);
          continue;
        }
        tile_gemm(isa, tile_rows, nb, a, converted + i, pairs, tmp, ldt, false);
        for (int r = 0; r < tile_rows; ++r) {
          for (int j = 0; j < nb; ++j) {
            axpy_row_f32(isa, block_scales[i + j], tmp + r * ldt + j * kPackBlockN,
                         dst + r * ldc + j * kPackBlockN, kPackBlockN);
          }
        }
      }
    }
  }
}

// Stage 2: h[row, 32*nb + j] = silu(gate) * up for every row of expert e and blocks
// [nb0, nb0 + num_blocks) of I (num_blocks <= 2).
void gate_up_task(Isa isa, const MoeFp8Args& p, const Routing& route, int64_t e, int64_t nb0,
                  int num_blocks, bf16_t* h, int64_t ldh) {
  const int64_t first = route.offsets[e], count = route.offsets[e + 1] - first;
  const int64_t ldc = 2 * num_blocks * kPackBlockN;
  float* c = thread_scratch_f32(count * ldc + kPanelScratchFloats);
  const int64_t inter_blocks = pack_num_blocks(p.inter);
  const int64_t block_bytes = p.d_pairs * kFp8RowBytes;
  const int64_t scale_rows = (p.inter + kFp8ScaleRows - 1) / kFp8ScaleRows;
  const uint8_t* b_blocks[2 * kGateUpBlocks];  // gate blocks, then the same blocks of up
  const float* scales[2 * kGateUpBlocks];
  for (int half = 0; half < 2; ++half) {
    const int64_t matrix = e * 2 + half;
    for (int i = 0; i < num_blocks; ++i) {
      b_blocks[half * num_blocks + i] = p.w13 + (matrix * inter_blocks + nb0 + i) * block_bytes;
      scales[half * num_blocks + i] =
          p.scale13 + (matrix * scale_rows + fp8_scale_row(nb0 + i)) * p.d_scale_cols();
    }
  }
  std::vector<const bf16_t*> a_rows(count);
  for (int64_t r = 0; r < count; ++r) a_rows[r] = p.x + route.tokens[first + r] * p.ldx;
  fp8_panel(isa, count, a_rows.data(), 2 * num_blocks, b_blocks, scales, p.d_pairs, c, ldc,
            c + count * ldc);
  const int64_t cols = num_blocks * kPackBlockN;
  for (int64_t r = 0; r < count; ++r) {
    bf16_t* dst = h + (first + r) * ldh + nb0 * kPackBlockN;
    silu_mul_row_bf16(isa, c + r * ldc, c + r * ldc + cols, dst, cols);
  }
}

// Stage 3: columns [128*panel, 128*panel + 128) of out for every token; `max_rows`: the most rows
// of one expert.
void down_task(Isa isa, const MoeFp8Args& p, const Routing& route, int64_t panel,
               int64_t max_rows, const bf16_t* h, int64_t ldh) {
  constexpr int64_t ldc = kDownBlocks * kPackBlockN;
  float* acc = thread_scratch_f32(p.num_tokens * ldc + max_rows * ldc + kPanelScratchFloats);
  float* c = acc + p.num_tokens * ldc;
  const int64_t hidden_blocks = pack_num_blocks(p.hidden);
  const int64_t block = panel * kDownBlocks;
  const int num_blocks = static_cast<int>(std::min<int64_t>(kDownBlocks, hidden_blocks - block));
  const int64_t col0 = block * kPackBlockN;
  const int64_t cols = std::min<int64_t>(num_blocks * kPackBlockN, p.hidden - col0);
  const int64_t block_bytes = p.i_pairs() * kFp8RowBytes;
  const int64_t scale_rows = p.d_scale_cols();  // rows of scale2 per expert: ceil(D/128)
  std::fill(acc, acc + p.num_tokens * ldc, 0.f);
  std::vector<const bf16_t*> a_rows(max_rows);
  for (int64_t e = 0; e < p.num_experts; ++e) {
    const int64_t first = route.offsets[e], count = route.offsets[e + 1] - first;
    if (count == 0) continue;
    const uint8_t* b_blocks[kDownBlocks];
    const float* scales[kDownBlocks];
    for (int i = 0; i < num_blocks; ++i) {
      b_blocks[i] = p.w2 + (e * hidden_blocks + block + i) * block_bytes;
      scales[i] = p.scale2 + (e * scale_rows + fp8_scale_row(block + i)) * p.i_scale_cols();
    }
    for (int64_t r = 0; r < count; ++r) a_rows[r] = h + (first + r) * ldh;
    fp8_panel(isa, count, a_rows.data(), num_blocks, b_blocks, scales, p.i_pairs(), c, ldc,
              c + max_rows * ldc);
    for (int64_t r = 0; r < count; ++r) {
      axpy_row_f32(isa, route.weights[first + r], c + r * ldc, acc + route.tokens[first + r] * ldc,
                   cols);
    }
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    store_row_bf16(isa, acc + t * ldc, p.out + t * p.ldo + col0, cols);
  }
}

void fused_moe_fp8(const MoeFp8Args& p) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  const Isa isa = active_isa();
  const Routing route = sort_by_expert(p.topk_ids, p.topk_weights, p.num_tokens, p.top_k,
                                       p.num_experts, p.expert_offset);
  const int64_t num_rows = route.offsets.back();
  const int64_t inter_blocks = pack_num_blocks(p.inter);
  // Rows of h span whole blocks of I (silu(0) * 0 = 0 past I), so the down tiles read pairs.
  const int64_t ldh = inter_blocks * kPackBlockN;
  std::unique_ptr<bf16_t[]> h(new bf16_t[std::max<int64_t>(num_rows * ldh, 1)]);

  const ExpertTasks work = expert_block_tasks(route, inter_blocks, kGateUpBlocks);
  const std::vector<int64_t>& tasks = work.tasks;
  const int64_t num_hit = work.num_hit, max_rows = work.max_rows;
  const int64_t num_panels = (pack_num_blocks(p.hidden) + kDownBlocks - 1) / kDownBlocks;
  const bool parallel = num_hit * 3 * p.inter * p.hidden >= kMinParallelBytes;  // 1 byte each
  parallel_tasks(static_cast<int64_t>(tasks.size()), parallel, [&](int64_t i) {
    const int64_t e = tasks[i] / inter_blocks, nb0 = tasks[i] % inter_blocks;
    const int num_blocks = static_cast<int>(std::min<int64_t>(kGateUpBlocks, inter_blocks - nb0));
    gate_up_task(isa, p, route, e, nb0, num_blocks, h.get(), ldh);
  });
  parallel_tasks(num_panels, parallel, [&](int64_t panel) {
    down_task(isa, p, route, panel, max_rows, h.get(), ldh);
  });
}

// The binding's tensor checks (common.h), with this op's name in their errors.
template <typename T>
T* checked(const TensorArg& t, DType want, int64_t needed, const char* name) {
  return checked_tensor<T>("fused_moe_fp8", t, want, needed, name);
}

}  // namespace

void register_moe_fp8(py::module_& m) {
  m.def(
      "fused_moe_fp8",
      [](const TensorArg& x, int64_t num_tokens, int64_t ldx, int64_t d_pairs, const TensorArg& w13,
         const TensorArg& scale13, const TensorArg& w2, const TensorArg& scale2,
         int64_t num_experts, int64_t inter, int64_t hidden, const TensorArg& topk_weights,
         const TensorArg& topk_ids, int64_t top_k, int64_t expert_offset, const TensorArg& out) {
        if (num_tokens < 0 || num_experts < 0 || inter <= 0 || hidden <= 0 || top_k < 0 ||
            d_pairs != pack_k_pairs(hidden) || ldx < 2 * d_pairs || (num_tokens > 1 && ldx % 2)) {
          throw std::invalid_argument("fused_moe_fp8: bad sizes or strides");
        }
        const int64_t i_blocks = pack_num_blocks(inter), d_blocks = pack_num_blocks(hidden);
        const int64_t i_pairs = pack_k_pairs(inter);
        const int64_t i_scales = (inter + 127) / 128, d_scales = (hidden + 127) / 128;
        const int64_t x_extent = num_tokens == 0 ? 0 : (num_tokens - 1) * ldx + 2 * d_pairs;
        const auto* px = checked<const bf16_t>(x, DType::kBFloat16, x_extent, "x");
        if (reinterpret_cast<uintptr_t>(px) % 4 != 0) {
          throw std::invalid_argument("fused_moe_fp8: x rows must start 4-byte aligned");
        }
        MoeFp8Args p{
            px, num_tokens, ldx, d_pairs,
            checked<const uint8_t>(w13, DType::kFloat8E4M3,
                                   num_experts * 2 * i_blocks * d_pairs * kFp8RowBytes, "w13"),
            checked<const float>(scale13, DType::kFloat32, num_experts * 2 * i_scales * d_scales,
                                 "scale13"),
            checked<const uint8_t>(w2, DType::kFloat8E4M3,
                                   num_experts * d_blocks * i_pairs * kFp8RowBytes, "w2"),
            checked<const float>(scale2, DType::kFloat32, num_experts * d_scales * i_scales,
                                 "scale2"),
            num_experts, inter, hidden,
            checked<const float>(topk_weights, DType::kFloat32, num_tokens * top_k,
                                 "topk_weights"),
            checked<const int32_t>(topk_ids, DType::kInt32, num_tokens * top_k, "topk_ids"),
            top_k, expert_offset,
            checked<bf16_t>(out, DType::kBFloat16, num_tokens * hidden, "out"), hidden};
        py::gil_scoped_release release;
        fused_moe_fp8(p);
      },
      "Routed experts with packed e4m3 weights (gemm_fp8_kernels.h layout): bf16 x [T, 2*d_pairs] "
      "(row stride ldx) -> out [T, hidden] bf16; w13 [E][2][I blocks], w2 [E][D blocks] with "
      "fp32 block scales; each tensor is (data_ptr, duet::DType tag, numel).");
}

}  // namespace duet

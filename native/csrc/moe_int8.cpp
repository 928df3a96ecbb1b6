// Fused routed-expert MoE in W8A8 int8: the bf16 MoE of moe.cpp with the int8 linear's scheme
// (gemm_int8.h) in both projections. out[t] = sum_k w[t,k] * down_e(silu(gate_e) * up_e), e =
// id[t,k] - expert_offset, over the experts held here (others contribute nothing).
//
// NOTE: the stages (reference.fused_moe_int8 repeats each one in torch).
// 1. Sort: the counting sort of moe_routing.h, shared with moe.cpp.
// 2. x is quantized per token once (u8 bytes + fp32 scale), shared by every expert it visits.
// 3. Gate/up: tasks (expert, 32 columns of I) compute one int32 tile of 2 gate + 2 up blocks per
//    6 rows, dequantize both (float(sum - comp) * x_scale * w_scale) and write silu(gate) * up
//    in fp32 into h [rows, I], rows in sorted order.
// 4. Every row of h is quantized per row again (dynamic: one scale per (token, expert) row).
// 5. Down: tasks are 64-column panels of the output; a task walks every expert's rows, adds
//    w[t,k] * dequant(q_h W2q^T) into an fp32 [T, 64] buffer in sorted order (the sum over k in
//    a fixed order, no atomics), then writes its columns of out as bf16.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "gemm_int8.h"
#include "gemm_kernels.h"  // silu_mul_row_f32, store_row_bf16, tile_count, thread_scratch_f32
#include "moe_routing.h"

namespace py = pybind11;

namespace duet {
namespace {

constexpr int kGateUpBlocks = kInt8TileMaxBlocks / 2;  // 2 gate + 2 up blocks of 16 columns
constexpr int kDownBlocks = kInt8TileMaxBlocks;        // 64 output columns per task
constexpr int64_t kMinParallelBytes = 128 << 10;

struct Int8Experts {
  const int8_t* packed;  // per expert, the blocks of gemm_int8.h (gate then up for w13)
  const float* scale;    // per expert, per padded output column
  const int32_t* comp;   // per expert, per padded output column
};

struct MoeInt8Args {
  const bf16_t* x;  // [T, hidden], row stride ldx
  int64_t num_tokens, ldx;
  Int8Experts w13;  // [E][2][ceil(I/16) blocks of K = hidden]; scale/comp [E][2][16 ceil(I/16)]
  Int8Experts w2;   // [E][ceil(D/16) blocks of K = I]; scale/comp [E][16 ceil(D/16)]
  int64_t num_experts, inter, hidden;
  const float* topk_weights;  // [T, K]
  const int32_t* topk_ids;    // [T, K] global ids
  int64_t top_k, expert_offset;
  bf16_t* out;  // [T, hidden], row stride ldo
  int64_t ldo;
};

// The quantized rows of one activation matrix (x per token, or h per sorted row). Left
// uninitialized (every byte is written before it is read): zeroing a prefill's h costs as much
// as a stage.
struct QuantRows {
  QuantRows(int64_t rows, int64_t k)
      : q(new uint8_t[std::max<int64_t>(rows * 4 * int8_k_groups(k), 1)]),
        scale(new float[std::max<int64_t>(rows, 1)]),
        ld(4 * int8_k_groups(k)) {}
  std::unique_ptr<uint8_t[]> q;  // row r at q.get() + r * ld
  std::unique_ptr<float[]> scale;
  int64_t ld;
};

// Stage 3: h[row, 16*nb0 + j] = silu(gate) * up (fp32) for every row of expert e.
void gate_up_task(Isa isa, const MoeInt8Args& p, const Routing& route, const QuantRows& qx,
                  int64_t e, int64_t nb0, int num_blocks, float* h, int64_t ldh) {
  alignas(64) int32_t tile[kInt8TileMaxRows * kInt8TileMaxBlocks * kInt8BlockN];
  alignas(64) float gate[kGateUpBlocks * kInt8BlockN], up[kGateUpBlocks * kInt8BlockN];
  const int64_t ldt = 2 * num_blocks * kInt8BlockN;
  const int64_t k_groups = int8_k_groups(p.hidden);
  const int64_t inter_blocks = int8_num_blocks(p.inter), pad_i = inter_blocks * kInt8BlockN;
  const int8_t* base = p.w13.packed + (e * 2 * inter_blocks + nb0) * int8_block_bytes(k_groups);
  const int8_t* b_blocks[kInt8TileMaxBlocks];  // gate blocks, then the same blocks of up
  for (int i = 0; i < num_blocks; ++i) {
    b_blocks[i] = base + i * int8_block_bytes(k_groups);
    b_blocks[num_blocks + i] = base + (inter_blocks + i) * int8_block_bytes(k_groups);
  }
  const int64_t col0 = nb0 * kInt8BlockN;
  const int64_t cols = std::min<int64_t>(num_blocks * kInt8BlockN, p.inter - col0);
  const int64_t gate_col = e * 2 * pad_i + col0, up_col = gate_col + pad_i;
  const int64_t first = route.offsets[e], count = route.offsets[e + 1] - first;
  for (int64_t t = 0; t < tile_count(count); ++t) {
    const int64_t r0 = first + tile_begin(t, count);
    const int rows = static_cast<int>(tile_begin(t + 1, count) - tile_begin(t, count));
    const uint8_t* a_rows[kInt8TileMaxRows];
    for (int r = 0; r < rows; ++r) a_rows[r] = qx.q.get() + route.tokens[r0 + r] * qx.ld;
    tile_int8(isa, rows, 2 * num_blocks, a_rows, b_blocks, k_groups, tile, ldt, false);
    for (int r = 0; r < rows; ++r) {
      const float x_scale = qx.scale[route.tokens[r0 + r]];
      dequant_row_int8(isa, tile + r * ldt, p.w13.comp + gate_col, p.w13.scale + gate_col,
                       x_scale, gate, cols);
      dequant_row_int8(isa, tile + r * ldt + num_blocks * kInt8BlockN, p.w13.comp + up_col,
                       p.w13.scale + up_col, x_scale, up, cols);
      // g / (1 + exp(-g)) * u, vectorized (vec::exp16, ~1 ulp; the twin's torch.exp may differ
      // in the last bit: see tests/native/test_moe_int8.py). A scalar std::exp per element was
      // a quarter of an int8 prefill's MoE time.
      silu_mul_row_f32(isa, gate, up, h + (r0 + r) * ldh + col0, cols);
    }
  }
}

// Stage 5: columns [64*panel, 64*panel + 64) of out for every token.
void down_task(Isa isa, const MoeInt8Args& p, const Routing& route, const QuantRows& qh,
               int64_t panel, float* acc) {
  alignas(64) int32_t tile[kInt8TileMaxRows * kDownBlocks * kInt8BlockN];
  alignas(64) float values[kDownBlocks * kInt8BlockN];
  constexpr int64_t ldt = kDownBlocks * kInt8BlockN;
  const int64_t k_groups = int8_k_groups(p.inter);
  const int64_t hidden_blocks = int8_num_blocks(p.hidden), pad_d = hidden_blocks * kInt8BlockN;
  const int64_t block = panel * kDownBlocks;
  const int num_blocks = static_cast<int>(std::min<int64_t>(kDownBlocks, hidden_blocks - block));
  const int64_t col0 = block * kInt8BlockN;
  const int64_t cols = std::min<int64_t>(num_blocks * kInt8BlockN, p.hidden - col0);
  std::fill(acc, acc + p.num_tokens * ldt, 0.f);
  for (int64_t e = 0; e < p.num_experts; ++e) {
    const int64_t first = route.offsets[e], count = route.offsets[e + 1] - first;
    if (count == 0) continue;
    const int8_t* b_blocks[kDownBlocks];
    for (int i = 0; i < num_blocks; ++i) {
      b_blocks[i] = p.w2.packed + (e * hidden_blocks + block + i) * int8_block_bytes(k_groups);
    }
    const int64_t col = e * pad_d + col0;
    for (int64_t t = 0; t < tile_count(count); ++t) {
      const int64_t r0 = first + tile_begin(t, count);
      const int rows = static_cast<int>(tile_begin(t + 1, count) - tile_begin(t, count));
      const uint8_t* a_rows[kInt8TileMaxRows];
      for (int r = 0; r < rows; ++r) a_rows[r] = qh.q.get() + (r0 + r) * qh.ld;
      tile_int8(isa, rows, num_blocks, a_rows, b_blocks, k_groups, tile, ldt, false);
      for (int r = 0; r < rows; ++r) {
        dequant_row_int8(isa, tile + r * ldt, p.w2.comp + col, p.w2.scale + col,
                         qh.scale[r0 + r], values, cols);
        const float w = route.weights[r0 + r];
        float* dst = acc + route.tokens[r0 + r] * ldt;
        // A product then a sum, as the twin's y * w then index_add_ (this file is built for the
        // baseline ISA, so the compiler cannot contract the two into an FMA).
        for (int64_t j = 0; j < cols; ++j) dst[j] += values[j] * w;
      }
    }
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    store_row_bf16(isa, acc + t * ldt, p.out + t * p.ldo + col0, cols);
  }
}

void fused_moe_int8(const MoeInt8Args& p) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  const Isa isa = active_isa();
  const Routing route = sort_by_expert(p.topk_ids, p.topk_weights, p.num_tokens, p.top_k,
                                       p.num_experts, p.expert_offset);
  const int64_t num_rows = route.offsets.back();
  const int64_t inter_blocks = int8_num_blocks(p.inter);
  const int64_t ldh = inter_blocks * kInt8BlockN;
  QuantRows qx(p.num_tokens, p.hidden), qh(num_rows, p.inter);
  std::unique_ptr<float[]> h(new float[std::max<int64_t>(num_rows * ldh, 1)]);

  const ExpertTasks work = expert_block_tasks(route, inter_blocks, kGateUpBlocks);
  const std::vector<int64_t>& tasks = work.tasks;
  const int64_t num_hit = work.num_hit;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t num_panels = (int8_num_blocks(p.hidden) + kDownBlocks - 1) / kDownBlocks;
  const int64_t weight_bytes = num_hit * 3 * p.inter * p.hidden;
  // Dynamic scheduling: experts hold different numbers of rows, and the cores are shared.
#pragma omp parallel if (weight_bytes >= kMinParallelBytes)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      quantize_rows_int8(isa, p.x + t * p.ldx, DType::kBFloat16, p.ldx, 1, p.hidden,
                         int8_k_groups(p.hidden), qx.q.get() + t * qx.ld, qx.scale.get() + t);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) {
      const int64_t e = tasks[i] / inter_blocks, nb0 = tasks[i] % inter_blocks;
      const int num_blocks = static_cast<int>(std::min<int64_t>(kGateUpBlocks, inter_blocks - nb0));
      gate_up_task(isa, p, route, qx, e, nb0, num_blocks, h.get(), ldh);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; ++r) {
      quantize_rows_int8(isa, h.get() + r * ldh, DType::kFloat32, ldh, 1, p.inter,
                         int8_k_groups(p.inter), qh.q.get() + r * qh.ld, qh.scale.get() + r);
    }
    float* acc = thread_scratch_f32(p.num_tokens * kDownBlocks * kInt8BlockN);
#pragma omp for schedule(dynamic, 1)
    for (int64_t panel = 0; panel < num_panels; ++panel) {
      down_task(isa, p, route, qh, panel, acc);
    }
  }
}

}  // namespace

void register_moe_int8(py::module_& m) {
  m.def(
      "fused_moe_int8",
      [](uintptr_t x, int64_t num_tokens, int64_t ldx, uintptr_t w13, uintptr_t w13_scale,
         uintptr_t w13_comp, uintptr_t w2, uintptr_t w2_scale, uintptr_t w2_comp,
         int64_t num_experts, int64_t inter, int64_t hidden, uintptr_t topk_weights,
         uintptr_t topk_ids, int64_t top_k, int64_t expert_offset, uintptr_t out, int64_t ldo,
         const std::vector<int>& dtypes) {
        check_dtypes("fused_moe_int8", dtypes,
                     {{"x", DType::kBFloat16}, {"w13", DType::kInt8},
                      {"w13 scale", DType::kFloat32}, {"w13 comp", DType::kInt32},
                      {"w2", DType::kInt8}, {"w2 scale", DType::kFloat32},
                      {"w2 comp", DType::kInt32}, {"topk_weights", DType::kFloat32},
                      {"topk_ids", DType::kInt32}, {"out", DType::kBFloat16}});
        if (num_tokens < 0 || num_experts < 0 || inter < 0 || hidden < 0 || top_k < 0 ||
            hidden > kInt8MaxK || inter > kInt8MaxK || (num_tokens > 0 && ldx < hidden) ||
            ldo < hidden) {
          throw std::invalid_argument("fused_moe_int8: bad sizes or strides");
        }
        const auto experts = [](uintptr_t packed, uintptr_t scale, uintptr_t comp) {
          return Int8Experts{reinterpret_cast<const int8_t*>(packed),
                             reinterpret_cast<const float*>(scale),
                             reinterpret_cast<const int32_t*>(comp)};
        };
        fused_moe_int8(MoeInt8Args{reinterpret_cast<const bf16_t*>(x), num_tokens, ldx,
                                   experts(w13, w13_scale, w13_comp),
                                   experts(w2, w2_scale, w2_comp), num_experts, inter, hidden,
                                   reinterpret_cast<const float*>(topk_weights),
                                   reinterpret_cast<const int32_t*>(topk_ids), top_k,
                                   expert_offset, reinterpret_cast<bf16_t*>(out), ldo});
      },
      py::call_guard<py::gil_scoped_release>(),
      "Routed experts in W8A8 int8: bf16 x [T, hidden] and out [T, hidden], packed int8 w13/w2 "
      "with per-column fp32 scale and int32 comp (native/_moe_int8_ops.py), fp32 topk_weights "
      "[T, K], int32 topk_ids [T, K].");
}

}  // namespace duet

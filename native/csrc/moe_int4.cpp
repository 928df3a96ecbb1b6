// Fused routed-expert MoE in W4A8: the int8 MoE of moe_int8.cpp with the int4 linear's scheme
// (gemm_int4.h) in both projections. out[t] = sum_k w[t,k] * down_e(silu(gate_e) * up_e), e =
// id[t,k] - expert_offset, over the experts held here (others contribute nothing).
//
// NOTE: the stages (reference.fused_moe_int4 repeats each one in torch).
// 1. Sort: the counting sort of moe_routing.h.
// 2. x is quantized per token once (signed bytes, fp32 scale, per-group sums), shared by every
//    expert it visits.
// 3. Gate/up: tasks (expert, 32 columns of I) run one fp32 tile of 2 gate + 2 up blocks per 6
//    rows, scale both by the token's a_scale and write silu(gate) * up in fp32 into h [rows, I],
//    rows in sorted order.
// 4. Every row of h is quantized per row again (one scale per (token, expert) row).
// 5. Down: tasks are 64-column panels of the output; a task walks every expert's rows, adds
//    w[t,k] * (h_scale * tile) into an fp32 [T, 64] buffer in sorted order (the sum over k in a
//    fixed order, no atomics), then writes its columns of out as bf16.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "gemm_int4.h"
#include "gemm_kernels.h"  // silu_mul_row_f32, store_row_bf16, tile_count, thread_scratch_f32
#include "moe_routing.h"

namespace py = pybind11;

namespace duet {
namespace {

constexpr int kGateUpBlocks = kInt4TileMaxBlocks / 2;  // 2 gate + 2 up blocks of 16 columns
constexpr int kDownBlocks = kInt4TileMaxBlocks;        // 64 output columns per task
constexpr int64_t kMinParallelBytes = 128 << 10;

struct Int4Experts {
  const uint8_t* packed;  // per expert, the blocks of gemm_int4.h (gate then up for w13)
  const float* scales;    // per expert, per block, [num_groups][16]
};

struct MoeInt4Args {
  const bf16_t* x;  // [T, hidden], row stride ldx
  int64_t num_tokens, ldx;
  Int4Experts w13;  // [E][2][ceil(I/16) blocks of K = hidden]
  Int4Experts w2;   // [E][ceil(D/16) blocks of K = I]
  int64_t num_experts, inter, hidden, group;
  const float* topk_weights;  // [T, K]
  const int32_t* topk_ids;    // [T, K] global ids
  int64_t top_k, expert_offset;
  bf16_t* out;  // [T, hidden], row stride ldo
  int64_t ldo;
};

// The quantized rows of one activation matrix (x per token, or h per sorted row), left
// uninitialized (every byte is written before it is read).
struct QuantRows {
  QuantRows(int64_t rows, int64_t k, int64_t group)
      : num_groups(int4_num_groups(k, group)),
        ld(num_groups * group),
        q(new int8_t[std::max<int64_t>(rows * ld, 1)]),
        scale(new float[std::max<int64_t>(rows, 1)]),
        sums(new int32_t[std::max<int64_t>(rows * num_groups, 1)]) {}
  int64_t num_groups, ld;
  std::unique_ptr<int8_t[]> q;  // row r at q.get() + r * ld
  std::unique_ptr<float[]> scale;
  std::unique_ptr<int32_t[]> sums;  // row r at sums.get() + r * num_groups
};

// Stage 3: h[row, 16*nb0 + j] = silu(gate) * up (fp32) for every row of expert e.
void gate_up_task(Isa isa, const MoeInt4Args& p, const Routing& route, const QuantRows& qx,
                  int64_t e, int64_t nb0, int num_blocks, float* h, int64_t ldh) {
  alignas(64) float tile[kInt4TileMaxRows * kInt4TileMaxBlocks * kInt4BlockN];
  const int64_t ldt = 2 * num_blocks * kInt4BlockN;
  const int64_t groups = qx.num_groups;
  const int64_t block_bytes = int4_block_bytes(groups, p.group);
  const int64_t inter_blocks = int4_num_blocks(p.inter);
  const uint8_t* b_blocks[kInt4TileMaxBlocks];  // gate blocks, then the same blocks of up
  const float* b_scales[kInt4TileMaxBlocks];
  for (int i = 0; i < num_blocks; ++i) {
    const int64_t gate = e * 2 * inter_blocks + nb0 + i, up = gate + inter_blocks;
    b_blocks[i] = p.w13.packed + gate * block_bytes;
    b_blocks[num_blocks + i] = p.w13.packed + up * block_bytes;
    b_scales[i] = p.w13.scales + gate * groups * kInt4BlockN;
    b_scales[num_blocks + i] = p.w13.scales + up * groups * kInt4BlockN;
  }
  const int64_t col0 = nb0 * kInt4BlockN;
  const int64_t cols = std::min<int64_t>(num_blocks * kInt4BlockN, p.inter - col0);
  const int64_t first = route.offsets[e], count = route.offsets[e + 1] - first;
  for (int64_t t = 0; t < tile_count(count); ++t) {
    const int64_t r0 = first + tile_begin(t, count);
    const int rows = static_cast<int>(tile_begin(t + 1, count) - tile_begin(t, count));
    const int8_t* a_rows[kInt4TileMaxRows];
    const int32_t* a_sums[kInt4TileMaxRows];
    for (int r = 0; r < rows; ++r) {
      a_rows[r] = qx.q.get() + route.tokens[r0 + r] * qx.ld;
      a_sums[r] = qx.sums.get() + route.tokens[r0 + r] * groups;
    }
    std::fill(tile, tile + rows * ldt, 0.f);
    tile_int4(isa, rows, 2 * num_blocks, a_rows, a_sums, b_blocks, b_scales, groups, p.group,
              tile, ldt);
    for (int r = 0; r < rows; ++r) {
      const float x_scale = qx.scale[route.tokens[r0 + r]];
      float* gate = tile + r * ldt;
      float* up = gate + num_blocks * kInt4BlockN;
      for (int64_t j = 0; j < cols; ++j) {
        gate[j] *= x_scale;
        up[j] *= x_scale;
      }
      silu_mul_row_f32(isa, gate, up, h + (r0 + r) * ldh + col0, cols);
    }
  }
}

// Stage 5: columns [64*panel, 64*panel + 64) of out for every token.
void down_task(Isa isa, const MoeInt4Args& p, const Routing& route, const QuantRows& qh,
               int64_t panel, float* acc) {
  alignas(64) float tile[kInt4TileMaxRows * kDownBlocks * kInt4BlockN];
  constexpr int64_t ldt = kDownBlocks * kInt4BlockN;
  const int64_t groups = qh.num_groups;
  const int64_t block_bytes = int4_block_bytes(groups, p.group);
  const int64_t hidden_blocks = int4_num_blocks(p.hidden);
  const int64_t block = panel * kDownBlocks;
  const int num_blocks = static_cast<int>(std::min<int64_t>(kDownBlocks, hidden_blocks - block));
  const int64_t col0 = block * kInt4BlockN;
  const int64_t cols = std::min<int64_t>(num_blocks * kInt4BlockN, p.hidden - col0);
  std::fill(acc, acc + p.num_tokens * ldt, 0.f);
  for (int64_t e = 0; e < p.num_experts; ++e) {
    const int64_t first = route.offsets[e], count = route.offsets[e + 1] - first;
    if (count == 0) continue;
    const uint8_t* b_blocks[kDownBlocks];
    const float* b_scales[kDownBlocks];
    for (int i = 0; i < num_blocks; ++i) {
      const int64_t b = e * hidden_blocks + block + i;
      b_blocks[i] = p.w2.packed + b * block_bytes;
      b_scales[i] = p.w2.scales + b * groups * kInt4BlockN;
    }
    for (int64_t t = 0; t < tile_count(count); ++t) {
      const int64_t r0 = first + tile_begin(t, count);
      const int rows = static_cast<int>(tile_begin(t + 1, count) - tile_begin(t, count));
      const int8_t* a_rows[kInt4TileMaxRows];
      const int32_t* a_sums[kInt4TileMaxRows];
      for (int r = 0; r < rows; ++r) {
        a_rows[r] = qh.q.get() + (r0 + r) * qh.ld;
        a_sums[r] = qh.sums.get() + (r0 + r) * groups;
      }
      std::fill(tile, tile + rows * ldt, 0.f);
      tile_int4(isa, rows, num_blocks, a_rows, a_sums, b_blocks, b_scales, groups, p.group, tile,
                ldt);
      for (int r = 0; r < rows; ++r) {
        const float h_scale = qh.scale[r0 + r], w = route.weights[r0 + r];
        const float* values = tile + r * ldt;
        float* dst = acc + route.tokens[r0 + r] * ldt;
        // (h_scale * sum) * w, a product then a sum, as the twin (this file is built for the
        // baseline ISA, so the compiler cannot contract them into an FMA).
        for (int64_t j = 0; j < cols; ++j) dst[j] += values[j] * h_scale * w;
      }
    }
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    store_row_bf16(isa, acc + t * ldt, p.out + t * p.ldo + col0, cols);
  }
}

void fused_moe_int4(const MoeInt4Args& p) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  const Isa isa = active_isa();
  const Routing route = sort_by_expert(p.topk_ids, p.topk_weights, p.num_tokens, p.top_k,
                                       p.num_experts, p.expert_offset);
  const int64_t num_rows = route.offsets.back();
  const int64_t inter_blocks = int4_num_blocks(p.inter);
  const int64_t ldh = inter_blocks * kInt4BlockN;
  QuantRows qx(p.num_tokens, p.hidden, p.group), qh(num_rows, p.inter, p.group);
  std::unique_ptr<float[]> h(new float[std::max<int64_t>(num_rows * ldh, 1)]);

  const ExpertTasks work = expert_block_tasks(route, inter_blocks, kGateUpBlocks);
  const std::vector<int64_t>& tasks = work.tasks;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t num_panels = (int4_num_blocks(p.hidden) + kDownBlocks - 1) / kDownBlocks;
  const int64_t weight_bytes = work.num_hit * 3 * p.inter * p.hidden / 2;
  // Dynamic scheduling: experts hold different numbers of rows, and the cores are shared.
#pragma omp parallel if (weight_bytes >= kMinParallelBytes)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      quantize_rows_int4act(isa, p.x + t * p.ldx, DType::kBFloat16, p.ldx, 1, p.hidden, p.group,
                            qx.num_groups, qx.q.get() + t * qx.ld, qx.scale.get() + t,
                            qx.sums.get() + t * qx.num_groups);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) {
      const int64_t e = tasks[i] / inter_blocks, nb0 = tasks[i] % inter_blocks;
      const int num_blocks = static_cast<int>(std::min<int64_t>(kGateUpBlocks, inter_blocks - nb0));
      gate_up_task(isa, p, route, qx, e, nb0, num_blocks, h.get(), ldh);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; ++r) {
      quantize_rows_int4act(isa, h.get() + r * ldh, DType::kFloat32, ldh, 1, p.inter, p.group,
                            qh.num_groups, qh.q.get() + r * qh.ld, qh.scale.get() + r,
                            qh.sums.get() + r * qh.num_groups);
    }
    float* acc = thread_scratch_f32(p.num_tokens * kDownBlocks * kInt4BlockN);
#pragma omp for schedule(dynamic, 1)
    for (int64_t panel = 0; panel < num_panels; ++panel) {
      down_task(isa, p, route, qh, panel, acc);
    }
  }
}

}  // namespace

void register_moe_int4(py::module_& m) {
  m.def(
      "fused_moe_int4",
      [](uintptr_t x, int64_t num_tokens, int64_t ldx, uintptr_t w13, uintptr_t w13_scales,
         uintptr_t w2, uintptr_t w2_scales, int64_t num_experts, int64_t inter, int64_t hidden,
         int64_t group, uintptr_t topk_weights, uintptr_t topk_ids, int64_t top_k,
         int64_t expert_offset, uintptr_t out, int64_t ldo, const std::vector<int>& dtypes) {
        check_dtypes("fused_moe_int4", dtypes,
                     {{"x", DType::kBFloat16}, {"w13", DType::kUInt8},
                      {"w13 scales", DType::kFloat32}, {"w2", DType::kUInt8},
                      {"w2 scales", DType::kFloat32}, {"topk_weights", DType::kFloat32},
                      {"topk_ids", DType::kInt32}, {"out", DType::kBFloat16}});
        if (num_tokens < 0 || num_experts < 0 || inter < 0 || hidden < 0 || top_k < 0 ||
            !int4_group_ok(group) || (num_tokens > 0 && ldx < hidden) || ldo < hidden) {
          throw std::invalid_argument("fused_moe_int4: bad sizes, group or strides");
        }
        const auto experts = [](uintptr_t packed, uintptr_t scales) {
          return Int4Experts{reinterpret_cast<const uint8_t*>(packed),
                             reinterpret_cast<const float*>(scales)};
        };
        fused_moe_int4(MoeInt4Args{reinterpret_cast<const bf16_t*>(x), num_tokens, ldx,
                                   experts(w13, w13_scales), experts(w2, w2_scales), num_experts,
                                   inter, hidden, group,
                                   reinterpret_cast<const float*>(topk_weights),
                                   reinterpret_cast<const int32_t*>(topk_ids), top_k,
                                   expert_offset, reinterpret_cast<bf16_t*>(out), ldo});
      },
      py::call_guard<py::gil_scoped_release>(),
      "Routed experts in W4A8: bf16 x [T, hidden] and out [T, hidden], packed int4 w13/w2 with "
      "fp32 group scales (native/_int4_ops.py), fp32 topk_weights [T, K], int32 topk_ids [T, K].");
}

}  // namespace duet

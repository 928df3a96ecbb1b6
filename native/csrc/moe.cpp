// Fused routed-expert MoE in bf16: out[t] = sum_k w[t,k] * W2_e (silu(G_e x_t) * (U_e x_t)),
// e = id[t,k] - expert_offset, over the experts held here (others contribute nothing).
//
// NOTE: the three stages.
// 1. Sort (moe_routing.h): a counting sort groups the (token, k) pairs by local expert (token
//    order inside an expert, so results are deterministic). Tiles address activations through
//    row pointers, so no gathered copy of x and no padding to a block size is needed.
// 2. Gate/up: tasks (expert, 64 columns of I) run in parallel across all experts; each computes
//    register tiles of (gate blocks | up blocks) for 6 rows (or all 4 blocks at once for <= 3
//    rows) and writes silu(gate) * up as bf16 into h [rows, I_pad], rows in sorted order.
// 3. Down: tasks are 128-column panels of the output; a task walks every expert's rows and adds
//    w[t,k] * (h W2^T) into an fp32 [T, 128] buffer, so the sum over k needs no atomics and is
//    done in a fixed order, then writes its columns of out as bf16.
// Decode (1-64 tokens) is the same code: each task streams its weight blocks once.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "gemm_kernels.h"
#include "moe_routing.h"

namespace py = pybind11;

namespace duet {
namespace {

// Blocks of 32 columns per task: of I in stage 2 (each with its gate and up half), of D in stage 3.
constexpr int kGateUpBlocks = 2;
constexpr int kDownBlocks = 4;
constexpr int64_t kMinParallelBytes = 256 << 10;

struct MoeArgs {
  const bf16_t* x;  // [T, 2 * d_pairs], row stride ldx
  int64_t num_tokens, ldx, d_pairs;
  const bf16_t* w13;  // packed [E][2 (gate, up)][ceil(I/32) blocks of K = D]
  const bf16_t* w2;   // packed [E][ceil(D/32) blocks of K = I]
  int64_t num_experts, inter, hidden;
  const float* topk_weights;  // [T, K]
  const int32_t* topk_ids;    // [T, K] global ids
  int64_t top_k, expert_offset;
  bf16_t* out;  // [T, hidden], row stride ldo
  int64_t ldo;
};

// c [rows, 32 * num_blocks] (row stride ldc) = rows x num_blocks (<= 4) packed blocks, cut into
// the widest register tiles `rows` allows. Decode rows (<= 3) read 4 blocks at once: 4 weight
// streams in flight per thread pull more bandwidth than 2.
void tile_wide(Isa isa, int rows, int num_blocks, const bf16_t* const* a_rows,
               const bf16_t* const* b_blocks, int64_t k_pairs, float* c, int64_t ldc) {
  const int step = tile_max_blocks(rows);
  for (int i = 0; i < num_blocks; i += step) {
    tile_gemm(isa, rows, std::min(step, num_blocks - i), a_rows, b_blocks + i, k_pairs,
              c + i * kPackBlockN, ldc, false);
  }
}

// Stage 2: h[row, 32*nb + j] = silu(gate) * up for every row of one expert and blocks
// [nb0, nb0 + num_blocks) of I (num_blocks <= 2).
void gate_up_task(Isa isa, const MoeArgs& p, const Routing& route, int64_t e, int64_t nb0,
                  int num_blocks, bf16_t* h, int64_t ldh) {
  alignas(64) float tile[kTileMaxRows * 2 * kGateUpBlocks * kPackBlockN];
  const int64_t ldt = 2 * num_blocks * kPackBlockN;
  const int64_t block_elems = p.d_pairs * 2 * kPackBlockN;
  const int64_t inter_blocks = pack_num_blocks(p.inter);
  const bf16_t* gate = p.w13 + (e * 2 * inter_blocks + nb0) * block_elems;
  const bf16_t* b_blocks[2 * kGateUpBlocks];  // gate blocks, then the same blocks of up
  for (int i = 0; i < num_blocks; ++i) {
    b_blocks[i] = gate + i * block_elems;
    b_blocks[num_blocks + i] = gate + (inter_blocks + i) * block_elems;
  }
  const int64_t cols = num_blocks * kPackBlockN;
  const int64_t first = route.offsets[e], count = route.offsets[e + 1] - first;
  for (int64_t t = 0; t < tile_count(count); ++t) {
    const int64_t r0 = first + tile_begin(t, count);
    const int rows = static_cast<int>(tile_begin(t + 1, count) - tile_begin(t, count));
    const bf16_t* a_rows[kTileMaxRows];
    for (int r = 0; r < rows; ++r) a_rows[r] = p.x + route.tokens[r0 + r] * p.ldx;
    tile_wide(isa, rows, 2 * num_blocks, a_rows, b_blocks, p.d_pairs, tile, ldt);
    for (int r = 0; r < rows; ++r) {
      silu_mul_row_bf16(isa, tile + r * ldt, tile + r * ldt + cols,
                        h + (r0 + r) * ldh + nb0 * kPackBlockN, cols);
    }
  }
}

// Stage 3: columns [128*panel, 128*panel + 128) of out for every token.
void down_task(Isa isa, const MoeArgs& p, const Routing& route, int64_t panel, const bf16_t* h,
               int64_t ldh, float* acc) {
  alignas(64) float tile[kTileMaxRows * kDownBlocks * kPackBlockN];
  constexpr int64_t ldt = kDownBlocks * kPackBlockN;
  const int64_t h_pairs = pack_k_pairs(p.inter);
  const int64_t block_elems = h_pairs * 2 * kPackBlockN;
  const int64_t hidden_blocks = pack_num_blocks(p.hidden);
  const int64_t block = panel * kDownBlocks;
  const int num_blocks = static_cast<int>(std::min<int64_t>(kDownBlocks, hidden_blocks - block));
  const int64_t col0 = block * kPackBlockN;
  const int64_t cols = std::min<int64_t>(num_blocks * kPackBlockN, p.hidden - col0);
  std::fill(acc, acc + p.num_tokens * ldt, 0.f);
  for (int64_t e = 0; e < p.num_experts; ++e) {
    const bf16_t* b_blocks[kDownBlocks];
    for (int i = 0; i < num_blocks; ++i) {
      b_blocks[i] = p.w2 + (e * hidden_blocks + block + i) * block_elems;
    }
    const int64_t first = route.offsets[e], count = route.offsets[e + 1] - first;
    for (int64_t t = 0; t < tile_count(count); ++t) {
      const int64_t r0 = first + tile_begin(t, count);
      const int rows = static_cast<int>(tile_begin(t + 1, count) - tile_begin(t, count));
      const bf16_t* a_rows[kTileMaxRows];
      for (int r = 0; r < rows; ++r) a_rows[r] = h + (r0 + r) * ldh;
      tile_wide(isa, rows, num_blocks, a_rows, b_blocks, h_pairs, tile, ldt);
      for (int r = 0; r < rows; ++r) {
        axpy_row_f32(isa, route.weights[r0 + r], tile + r * ldt, acc + route.tokens[r0 + r] * ldt,
                     cols);
      }
    }
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    store_row_bf16(isa, acc + t * ldt, p.out + t * p.ldo + col0, cols);
  }
}

void fused_moe_bf16(const MoeArgs& p) {
  if (p.num_tokens == 0 || p.hidden == 0) return;
  const Isa isa = active_isa();
  const Routing route = sort_by_expert(p.topk_ids, p.topk_weights, p.num_tokens, p.top_k,
                                       p.num_experts, p.expert_offset);
  const int64_t num_rows = route.offsets.back();
  const int64_t inter_blocks = pack_num_blocks(p.inter);
  const int64_t ldh = inter_blocks * kPackBlockN;
  std::unique_ptr<bf16_t[]> h(new bf16_t[std::max<int64_t>(num_rows * ldh, 1)]);

  const ExpertTasks work = expert_block_tasks(route, inter_blocks, kGateUpBlocks);
  const std::vector<int64_t>& tasks = work.tasks;
  const int64_t num_hit = work.num_hit;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t num_panels = (pack_num_blocks(p.hidden) + kDownBlocks - 1) / kDownBlocks;
  // Weights of the experts hit; below kMinParallelBytes a fork/join costs more than it saves.
  const int64_t weight_bytes = num_hit * 3 * p.inter * p.hidden * 2;
  // Dynamic scheduling: experts hold different numbers of rows, and the cores are shared.
#pragma omp parallel if (weight_bytes >= kMinParallelBytes)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) {
      const int64_t e = tasks[i] / inter_blocks, nb0 = tasks[i] % inter_blocks;
      const int num_blocks = static_cast<int>(std::min<int64_t>(kGateUpBlocks, inter_blocks - nb0));
      gate_up_task(isa, p, route, e, nb0, num_blocks, h.get(), ldh);
    }
    float* acc = thread_scratch_f32(p.num_tokens * kDownBlocks * kPackBlockN);
#pragma omp for schedule(dynamic, 1)
    for (int64_t panel = 0; panel < num_panels; ++panel) {
      down_task(isa, p, route, panel, h.get(), ldh, acc);
    }
  }
}

}  // namespace

void register_moe(py::module_& m) {
  m.def(
      "fused_moe_bf16",
      [](uintptr_t x, int64_t num_tokens, int64_t ldx, int64_t d_pairs, uintptr_t w13,
         uintptr_t w2, int64_t num_experts, int64_t inter, int64_t hidden, uintptr_t topk_weights,
         uintptr_t topk_ids, int64_t top_k, int64_t expert_offset, uintptr_t out, int64_t ldo,
         const std::vector<int>& dtypes) {
        check_dtypes("fused_moe_bf16", dtypes,
                     {{"x", DType::kBFloat16}, {"w13", DType::kBFloat16}, {"w2", DType::kBFloat16},
                      {"topk_weights", DType::kFloat32}, {"topk_ids", DType::kInt32},
                      {"out", DType::kBFloat16}});
        if (num_tokens < 0 || num_experts < 0 || inter < 0 || top_k < 0 ||
            d_pairs != pack_k_pairs(hidden) || ldx < 2 * d_pairs || ldo < hidden) {
          throw std::invalid_argument("fused_moe_bf16: bad sizes or strides");
        }
        fused_moe_bf16(MoeArgs{reinterpret_cast<const bf16_t*>(x), num_tokens, ldx, d_pairs,
                               reinterpret_cast<const bf16_t*>(w13),
                               reinterpret_cast<const bf16_t*>(w2), num_experts, inter, hidden,
                               reinterpret_cast<const float*>(topk_weights),
                               reinterpret_cast<const int32_t*>(topk_ids), top_k, expert_offset,
                               reinterpret_cast<bf16_t*>(out), ldo});
      },
      py::call_guard<py::gil_scoped_release>(),
      "Routed experts, bf16 x [T, 2*d_pairs] and out [T, hidden], packed w13/w2 "
      "(native/_gemm_ops.py), fp32 topk_weights [T, K], int32 topk_ids [T, K].");
}

}  // namespace duet

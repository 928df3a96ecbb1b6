// Stage 1 of the fused MoE kernels (moe.cpp in bf16, moe_int8.cpp in int8, moe_fp8.cpp in fp8): a counting sort
// that groups the (token, k) pairs by local expert, token order inside an expert, so results are
// deterministic. Tiles then address the activations through row pointers: no gathered copy of x
// and no padding to a block size.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace duet {

// Rows of the sorted problem: row i belongs to token tokens[i] with weight weights[i]; the rows of
// local expert e are [offsets[e], offsets[e+1]).
struct Routing {
  std::vector<int64_t> offsets;
  std::vector<int32_t> tokens;
  std::vector<float> weights;
};

// topk_ids / topk_weights: [num_tokens, top_k] (global ids); expert e is held here when
// expert_offset <= e < expert_offset + num_experts, other ids contribute no row.
inline Routing sort_by_expert(const int32_t* topk_ids, const float* topk_weights,
                              int64_t num_tokens, int64_t top_k, int64_t num_experts,
                              int64_t expert_offset) {
  Routing route;
  route.offsets.assign(num_experts + 1, 0);
  const int64_t pairs = num_tokens * top_k;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = static_cast<int64_t>(topk_ids[i]) - expert_offset;
    if (e >= 0 && e < num_experts) ++route.offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) route.offsets[e + 1] += route.offsets[e];
  std::vector<int64_t> fill(route.offsets.begin(), route.offsets.end() - 1);
  route.tokens.resize(route.offsets.back());
  route.weights.resize(route.offsets.back());
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = static_cast<int64_t>(topk_ids[i]) - expert_offset;
    if (e < 0 || e >= num_experts) continue;
    route.tokens[fill[e]] = static_cast<int32_t>(i / top_k);
    route.weights[fill[e]++] = topk_weights[i];
  }
  return route;
}

// Stage 2 of the three kernels: one task per (expert holding rows, group of `step` column blocks
// of I), encoded as e * inter_blocks + first block; with the experts hit (they size the weight
// traffic, hence whether to fork) and the most rows one expert holds.
struct ExpertTasks {
  std::vector<int64_t> tasks;
  int64_t num_hit = 0, max_rows = 0;
};

inline ExpertTasks expert_block_tasks(const Routing& route, int64_t inter_blocks, int64_t step) {
  ExpertTasks out;
  const int64_t num_experts = static_cast<int64_t>(route.offsets.size()) - 1;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = route.offsets[e + 1] - route.offsets[e];
    if (count == 0) continue;
    ++out.num_hit;
    out.max_rows = std::max(out.max_rows, count);
    for (int64_t nb = 0; nb < inter_blocks; nb += step) out.tasks.push_back(e * inter_blocks + nb);
  }
  return out;
}

}  // namespace duet

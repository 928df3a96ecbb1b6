// DeepSeek grouped top-k routing, twin of native/reference.py's grouped_topk.
//
// Per token: scores = softmax or sigmoid of the logits (fp32); choice = scores + bias; groups are
// ranked by the sum of their two best choice scores (noaux_tc) or their best one
// (group_limited_greedy) and only the best `topk_group` groups compete; the top_k experts by
// choice are returned best first with their unbiased scores as weights, renormalized and scaled.
// Only the scoring is vectorized (exp over E lanes); the selections are small insertion sorts
// (K, topk_group <= a few dozen) that scan in index order, so the lower index wins a tie.
#include <pybind11/pybind11.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "small_ops_simd.h"

namespace py = pybind11;

namespace duet {
namespace {

enum class GroupMethod : int { kGreedy = 0, kTop2Sum = 1, kMax = 2 };

struct TopkParams {
  int64_t num_experts, top_k, n_group, topk_group;
  bool softmax, norm;
  GroupMethod method;
  float scale;
};

// Inserts (value, id) into the descending list vals/ids of current length *len and capacity cap.
// Strict comparison: an equal value already in the list (a lower index) stays ahead.
inline void insert_top(float* vals, int32_t* ids, int64_t* len, int64_t cap, float value,
                       int32_t id) {
  int64_t pos = *len;
  if (pos == cap) {
    if (!(value > vals[cap - 1])) return;
    --pos;
  } else {
    ++*len;
  }
  while (pos > 0 && value > vals[pos - 1]) {
    vals[pos] = vals[pos - 1];
    ids[pos] = ids[pos - 1];
    --pos;
  }
  vals[pos] = value;
  ids[pos] = id;
}

template <typename T>
void scores_portable(const T* logits, float* scores, int64_t n, bool softmax) {
  if (softmax) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, small::to_f32(logits[i]));
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      scores[i] = std::exp(small::to_f32(logits[i]) - mx);
      sum += scores[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) scores[i] *= inv;
  } else {
    for (int64_t i = 0; i < n; ++i) scores[i] = 1.f / (1.f + std::exp(-small::to_f32(logits[i])));
  }
}

template <typename T>
DUET_TARGET_SMALL void scores_avx512(const T* logits, float* scores, int64_t n, bool softmax) {
  using namespace small;
  const __m512 one = _mm512_set1_ps(1.f);
  if (!softmax) {
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lane_mask(n - i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), load16(logits + i, m)));
      _mm512_mask_storeu_ps(scores + i, m, _mm512_div_ps(one, _mm512_add_ps(one, e)));
    }
    return;
  }
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    mx = _mm512_mask_max_ps(mx, m, mx, load16(logits + i, m));
  }
  const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(load16(logits + i, m), vmax)));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(scores + i, m, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    _mm512_mask_storeu_ps(scores + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scores + i), inv));
  }
}

// Selection for one token given its scores; `work` holds E + 2 * n_group + top_k floats and
// `group_ids` topk_group ints.
void select_token(const float* scores, const float* bias, const TopkParams& p, float* work,
                  int32_t* group_ids, float* weights_out, int32_t* ids_out) {
  const int64_t e = p.num_experts;
  float* choice = work;
  for (int64_t i = 0; i < e; ++i) choice[i] = bias ? scores[i] + bias[i] : scores[i];

  if (p.method != GroupMethod::kGreedy && p.n_group > 1) {
    const int64_t group_size = e / p.n_group;
    float* group_best = work + e;  // descending group scores, then the kept-group flags
    float* keep = group_best + p.n_group;
    int64_t kept = 0;
    for (int64_t g = 0; g < p.n_group; ++g) {
      const float* c = choice + g * group_size;
      float best = -std::numeric_limits<float>::infinity(), second = best;
      for (int64_t i = 0; i < group_size; ++i) {
        if (c[i] > best) {
          second = best;
          best = c[i];
        } else if (c[i] > second) {
          second = c[i];
        }
      }
      const float gs = p.method == GroupMethod::kTop2Sum ? best + second : best;
      insert_top(group_best, group_ids, &kept, p.topk_group, gs, static_cast<int32_t>(g));
      keep[g] = 0.f;
    }
    for (int64_t i = 0; i < kept; ++i) keep[group_ids[i]] = 1.f;
    for (int64_t g = 0; g < p.n_group; ++g) {
      if (keep[g] != 0.f) continue;
      std::fill(choice + g * group_size, choice + (g + 1) * group_size,
                -std::numeric_limits<float>::infinity());
    }
  }

  // Masked experts sit at -inf: they enter the list only while it is not full, so they fill the
  // slots left when fewer than top_k experts compete and are displaced by any real score.
  float* top_vals = work + e + 2 * p.n_group;
  int64_t len = 0;
  for (int64_t i = 0; i < e; ++i) {
    insert_top(top_vals, ids_out, &len, p.top_k, choice[i], static_cast<int32_t>(i));
  }

  float total = 0.f;
  for (int64_t k = 0; k < p.top_k; ++k) {
    weights_out[k] = scores[ids_out[k]];
    total += weights_out[k];
  }
  const bool renorm = p.norm && p.top_k > 1;
  for (int64_t k = 0; k < p.top_k; ++k) {
    const float w = renorm ? weights_out[k] / (total + 1e-20f) : weights_out[k];
    weights_out[k] = w * p.scale;
  }
}

template <typename T>
void grouped_topk_impl(const T* logits, int64_t stride, const float* bias, float* weights,
                       int32_t* ids, int64_t tokens, const TopkParams& p) {
  const bool simd = active_isa() >= Isa::kAvx512;
  const int64_t e = p.num_experts;
  parallel_for(tokens, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(2 * e + 2 * p.n_group + p.top_k));
    std::vector<int32_t> group_ids(static_cast<size_t>(std::max<int64_t>(p.topk_group, 1)));
    float* scores = buf.data();
    for (int64_t t = begin; t < end; ++t) {
      if (simd) {
        scores_avx512<T>(logits + t * stride, scores, e, p.softmax);
      } else {
        scores_portable<T>(logits + t * stride, scores, e, p.softmax);
      }
      select_token(scores, bias, p, scores + e, group_ids.data(), weights + t * p.top_k, ids + t * p.top_k);
    }
  }, std::max<int64_t>(1, 8192 / std::max<int64_t>(e, 1)));
}

}  // namespace

void register_topk(py::module_& m) {
  m.def(
      "grouped_topk",
      [](uintptr_t logits, int64_t stride, int dtype, uintptr_t bias, uintptr_t weights,
         uintptr_t ids, int64_t tokens, int64_t num_experts, int64_t top_k, int64_t n_group,
         int64_t topk_group, bool softmax, int method, bool norm, double scale) {
        TopkParams p{num_experts, top_k, std::max<int64_t>(n_group, 1), topk_group, softmax, norm,
                     static_cast<GroupMethod>(method), static_cast<float>(scale)};
        const bool grouped = p.method != GroupMethod::kGreedy && p.n_group > 1;
        if (top_k < 1 || top_k > num_experts) {
          throw std::invalid_argument("grouped_topk: top_k must be in [1, num_experts]");
        }
        if (method < 0 || method > 2) throw std::invalid_argument("grouped_topk: bad method");
        if (grouped && (num_experts % p.n_group != 0 || topk_group < 1 || topk_group > p.n_group)) {
          throw std::invalid_argument(
              "grouped_topk: n_group must divide num_experts and topk_group be in [1, n_group]");
        }
        const auto* b = reinterpret_cast<const float*>(bias);
        auto* w = reinterpret_cast<float*>(weights);
        auto* i = reinterpret_cast<int32_t*>(ids);
        if (dtype == static_cast<int>(DType::kBFloat16)) {
          grouped_topk_impl<bf16_t>(reinterpret_cast<const bf16_t*>(logits), stride, b, w, i,
                                    tokens, p);
        } else if (dtype == static_cast<int>(DType::kFloat32)) {
          grouped_topk_impl<float>(reinterpret_cast<const float*>(logits), stride, b, w, i,
                                   tokens, p);
        } else {
          throw std::invalid_argument("grouped_topk supports float32 and bfloat16 logits only");
        }
      },
      py::call_guard<py::gil_scoped_release>(),
      "Routing: logits [T, E] (rows strided), bias fp32 [E] or 0 -> weights fp32 [T, K], "
      "ids int32 [T, K]; method 0 greedy, 1 group top-2 sum (noaux_tc), 2 group max.");
}

}  // namespace duet

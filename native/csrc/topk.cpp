// DeepSeek grouped top-k routing, twin of native/reference.py's grouped_topk.
//
// Per token: scores = softmax or sigmoid of the logits (fp32); choice = scores + bias; groups are
// ranked by the sum of their two best choice scores (noaux_tc) or their best one
// (group_limited_greedy) and only the best `topk_group` groups compete; the top_k experts by
// choice are returned best first with their unbiased scores as weights, renormalized and scaled.
// The AVX-512 path vectorizes the scoring (exp over E lanes), the group scores (lane-wise top
// two) and the expert choice (top_k rounds of arg-max); the portable path scans with small
// insertion sorts. Both take the lower index on a tie; groups (a few dozen) are always chosen
// with the insertion sort.
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
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, vec::to_f32(logits[i]));
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      scores[i] = std::exp(vec::to_f32(logits[i]) - mx);
      sum += scores[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) scores[i] *= inv;
  } else {
    for (int64_t i = 0; i < n; ++i) scores[i] = 1.f / (1.f + std::exp(-vec::to_f32(logits[i])));
  }
}

template <typename T>
DUET_TARGET_SMALL void scores_avx512(const T* logits, float* scores, int64_t n, bool softmax) {
  const __m512 one = _mm512_set1_ps(1.f);
  if (!softmax) {
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = vec::mask16(n - i);
      const __m512 x = vec::load16(logits + i, m);
      const __m512 e = vec::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
      _mm512_mask_storeu_ps(scores + i, m, _mm512_div_ps(one, _mm512_add_ps(one, e)));
    }
    return;
  }
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vec::mask16(n - i);
    mx = _mm512_mask_max_ps(mx, m, mx, vec::load16(logits + i, m));
  }
  const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vec::mask16(n - i);
    const __m512 x = vec::load16(logits + i, m);
    const __m512 e = _mm512_maskz_mov_ps(m, vec::exp16(_mm512_sub_ps(x, vmax)));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(scores + i, m, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vec::mask16(n - i);
    _mm512_mask_storeu_ps(scores + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scores + i), inv));
  }
}

// Work buffer of one thread: E choice values, then 3 * n_group floats, then top_k floats.
int64_t work_floats(const TopkParams& p) { return p.num_experts + 3 * p.n_group + p.top_k; }

bool is_grouped(const TopkParams& p) { return p.method != GroupMethod::kGreedy && p.n_group > 1; }

// keep[g] = 1 for the topk_group best groups by group_scores, else 0 (ties: lower index).
inline void choose_groups(const float* group_scores, const TopkParams& p, float* group_best,
                          int32_t* group_ids, float* keep) {
  int64_t kept = 0;
  for (int64_t g = 0; g < p.n_group; ++g) {
    insert_top(group_best, group_ids, &kept, p.topk_group, group_scores[g],
               static_cast<int32_t>(g));
    keep[g] = 0.f;
  }
  for (int64_t i = 0; i < kept; ++i) keep[group_ids[i]] = 1.f;
}

// Weights of the chosen experts: unbiased scores, renormalized, scaled (as the reference).
inline void finish_weights(const float* scores, const TopkParams& p, const int32_t* ids,
                           float* weights) {
  float total = 0.f;
  for (int64_t k = 0; k < p.top_k; ++k) {
    weights[k] = scores[ids[k]];
    total += weights[k];
  }
  const bool renorm = p.norm && p.top_k > 1;
  for (int64_t k = 0; k < p.top_k; ++k) {
    weights[k] = (renorm ? weights[k] / (total + 1e-20f) : weights[k]) * p.scale;
  }
}

void select_token_portable(const float* scores, const float* bias, const TopkParams& p,
                           float* work, int32_t* group_ids, float* weights_out, int32_t* ids_out) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t e = p.num_experts;
  float* choice = work;
  float* group_scores = work + e;
  for (int64_t i = 0; i < e; ++i) choice[i] = bias ? scores[i] + bias[i] : scores[i];
  if (is_grouped(p)) {
    const int64_t group_size = e / p.n_group;
    for (int64_t g = 0; g < p.n_group; ++g) {
      const float* c = choice + g * group_size;
      float best = -kInf, second = -kInf;
      for (int64_t i = 0; i < group_size; ++i) {
        if (c[i] > best) {
          second = best;
          best = c[i];
        } else if (c[i] > second) {
          second = c[i];
        }
      }
      group_scores[g] = p.method == GroupMethod::kTop2Sum ? best + second : best;
    }
    float* keep = group_scores + 2 * p.n_group;
    choose_groups(group_scores, p, group_scores + p.n_group, group_ids, keep);
    for (int64_t g = 0; g < p.n_group; ++g) {
      if (keep[g] == 0.f) std::fill(choice + g * group_size, choice + (g + 1) * group_size, -kInf);
    }
  }
  // Masked experts sit at -inf: they enter the list only while it is not full, so they fill the
  // slots left when fewer than top_k experts compete and are displaced by any real score.
  float* top_vals = work + e + 3 * p.n_group;
  int64_t len = 0;
  for (int64_t i = 0; i < e; ++i) {
    insert_top(top_vals, ids_out, &len, p.top_k, choice[i], static_cast<int32_t>(i));
  }
  finish_weights(scores, p, ids_out, weights_out);
}

// Best (or best + second best, a duplicate counting twice) of c[0, n).
DUET_TARGET_SMALL float group_score_avx512(const float* c, int64_t n, bool top2) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = ninf, second = ninf;  // lane-wise top two
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_mask_loadu_ps(ninf, vec::mask16(n - i), c + i);
    second = _mm512_max_ps(second, _mm512_min_ps(best, v));
    best = _mm512_max_ps(best, v);
  }
  const float b1 = _mm512_reduce_max_ps(best);
  if (!top2) return b1;
  // The runner-up: every lane's second, and every lane's best but one occurrence of b1.
  const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(b1), _CMP_EQ_OQ);
  const __mmask16 first = static_cast<__mmask16>(at_max & (~at_max + 1));
  const __m512 others = _mm512_mask_mov_ps(best, first, ninf);
  return b1 + _mm512_reduce_max_ps(_mm512_max_ps(others, second));
}

DUET_TARGET_SMALL void select_token_avx512(const float* scores, const float* bias,
                                           const TopkParams& p, float* work, int32_t* group_ids,
                                           float* weights_out, int32_t* ids_out) {
    constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t e = p.num_experts;
  float* choice = work;
  float* group_scores = work + e;
  for (int64_t i = 0; i < e; i += 16) {
    const __mmask16 m = vec::mask16(e - i);
    __m512 c = _mm512_maskz_loadu_ps(m, scores + i);
    if (bias) c = _mm512_add_ps(c, _mm512_maskz_loadu_ps(m, bias + i));
    _mm512_mask_storeu_ps(choice + i, m, c);
  }
  if (is_grouped(p)) {
    const int64_t group_size = e / p.n_group;
    for (int64_t g = 0; g < p.n_group; ++g) {
      group_scores[g] = group_score_avx512(choice + g * group_size, group_size,
                                           p.method == GroupMethod::kTop2Sum);
    }
    float* keep = group_scores + 2 * p.n_group;
    choose_groups(group_scores, p, group_scores + p.n_group, group_ids, keep);
    // Masked experts get the lowest finite value: below every real choice, above the -inf that
    // marks experts already taken, so they only fill slots when fewer than top_k compete.
    for (int64_t g = 0; g < p.n_group; ++g) {
      if (keep[g] == 0.f) {
        std::fill(choice + g * group_size, choice + (g + 1) * group_size,
                  -std::numeric_limits<float>::max());
      }
    }
  }
  // top_k rounds of arg-max (first index on ties), each taking its winner out.
  const __m512 ninf = _mm512_set1_ps(-kInf);
  for (int64_t k = 0; k < p.top_k; ++k) {
    __m512 mx = ninf;
    for (int64_t i = 0; i < e; i += 16) {
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, vec::mask16(e - i), choice + i));
    }
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    int64_t winner = 0;
    for (int64_t i = 0; i < e; i += 16) {
      const __mmask16 live = vec::mask16(e - i);
      const __mmask16 hit =
          _mm512_mask_cmp_ps_mask(live, _mm512_loadu_ps(choice + i), best, _CMP_EQ_OQ);
      if (hit) {
        winner = i + __builtin_ctz(hit);
        break;
      }
    }
    ids_out[k] = static_cast<int32_t>(winner);
    choice[winner] = -kInf;
  }
  finish_weights(scores, p, ids_out, weights_out);
}

template <typename T>
void grouped_topk_impl(const T* logits, int64_t stride, const float* bias, float* weights,
                       int32_t* ids, int64_t tokens, const TopkParams& p) {
  const bool simd = active_isa() >= Isa::kAvx512;
  const int64_t e = p.num_experts;
  parallel_for(tokens, [&](int64_t begin, int64_t end) {
    // Padded by 16 floats: the vector loops read whole 16-lane vectors (masked, but in bounds).
    std::vector<float> buf(static_cast<size_t>(e + work_floats(p) + 16));
    std::vector<int32_t> group_ids(static_cast<size_t>(std::max<int64_t>(p.topk_group, 1)));
    float* scores = buf.data();
    for (int64_t t = begin; t < end; ++t) {
      float* w = weights + t * p.top_k;
      int32_t* id = ids + t * p.top_k;
      if (simd) {
        scores_avx512<T>(logits + t * stride, scores, e, p.softmax);
        select_token_avx512(scores, bias, p, scores + e, group_ids.data(), w, id);
      } else {
        scores_portable<T>(logits + t * stride, scores, e, p.softmax);
        select_token_portable(scores, bias, p, scores + e, group_ids.data(), w, id);
      }
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

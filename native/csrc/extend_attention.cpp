// Extend (prefill) attention, FlashAttention-2 style, over a batch of variable-length sequences:
// each query attends its sequence's cached prefix (no mask) and the new keys up to itself
// (causal). Two phases in one parallel region:
//   1. pack: every block of bn keys of every (sequence, head) is packed once into a contiguous
//      tile (K and V in the layout the GEMMs read), so the strided rows of one head are read
//      once, not once per query block;
//   2. attend: tasks = (sequence, head, block of bm queries), longest sequences first. A task
//      walks its key tiles: S = Q K^T (fp32), online softmax (running max m, sum l, rescale
//      alpha), O = O * alpha + P V, and finally O / l.
//
// Paths, picked by the active ISA and dtype:
//   Bf16Path     bf16 in, vdpbf16ps for both GEMMs (K and V packed in VNNI pairs), bf16 P;
//   F32Path<T>   fp32 FMA GEMMs (K packed transposed), T = float, or bf16 converted on packing
//                (AVX-512 without BF16);
//   PortablePath scalar C++, the same tiles and masking.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_common.h"
#include "attention_gemm.h"
#include "common.h"
#include "cpu_features.h"

namespace py = pybind11;

namespace duet {
namespace {

using namespace attn;  // NOLINT(build/namespaces)

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A [tokens, heads, dim] tensor with a contiguous last dimension; strides in elements.
struct View3 {
  const char* data;
  int64_t token_stride;
  int64_t head_stride;
};

struct Problem {
  int64_t num_heads, dqk, dv;
  float sm_scale;
  View3 q, k, v, k_prefix, v_prefix, out;
  std::vector<int64_t> new_lens, prefix_lens, new_start, prefix_start;
};

// Sizes every task of one call shares.
struct Dims {
  int64_t dqk, dv;
  int64_t bm, bn;  // queries per task (a multiple of the path's row tile), keys per tile
};

// Key visibility inside one key tile: key j is seen by query row r iff j <= r + offset
// (prefix tiles use offset = n_len, i.e. no mask).
inline int64_t visible_keys(int64_t r, int64_t offset, int64_t n_len) {
  return std::clamp<int64_t>(r + offset + 1, 0, n_len);
}

// ---- portable path -----------------------------------------------------------------------------

// Tiles: K [bn][dqk] and V [bn][dv], fp32.
template <typename T>
struct PortablePath {
  static constexpr int kRows = 1;
  using Packed = float;
  struct Work {
    float *q, *s, *o, *m, *l;
  };

  static int64_t k_tile_elems(const Dims& d) { return d.bn * d.dqk; }
  static int64_t v_tile_elems(const Dims& d) { return d.bn * d.dv; }

  static void pack_k(float* dst, const Dims& d, const T* k, int64_t stride, int64_t n_len) {
    for (int64_t j = 0; j < n_len; ++j) {
      for (int64_t i = 0; i < d.dqk; ++i) dst[j * d.dqk + i] = to_float(k[j * stride + i]);
    }
  }
  static void pack_v(float* dst, const Dims& d, const T* v, int64_t stride, int64_t n_len) {
    for (int64_t j = 0; j < n_len; ++j) {
      for (int64_t i = 0; i < d.dv; ++i) dst[j * d.dv + i] = to_float(v[j * stride + i]);
    }
  }

  static Work carve(Arena& a, const Dims& d) {
    Work w;
    w.q = a.take<float>(d.bm * d.dqk);
    w.s = a.take<float>(d.bn);
    w.o = a.take<float>(d.bm * d.dv);
    w.m = a.take<float>(d.bm);
    w.l = a.take<float>(d.bm);
    return w;
  }

  static void load_q(Work& w, const Dims& d, const T* q, int64_t stride, int64_t m_len) {
    for (int64_t r = 0; r < m_len; ++r) {
      for (int64_t i = 0; i < d.dqk; ++i) w.q[r * d.dqk + i] = to_float(q[r * stride + i]);
    }
  }

  static void begin(Work& w, const Dims& d, int64_t m_len) {
    std::fill(w.m, w.m + m_len, kNegInf);
    std::fill(w.l, w.l + m_len, 0.0f);
    std::fill(w.o, w.o + m_len * d.dv, 0.0f);
  }

  static void block(Work& w, const Dims& d, int64_t m_len, const float* kt, const float* vt,
                    int64_t n_len, int64_t offset, float scale) {
    for (int64_t r = 0; r < m_len; ++r) {
      const int64_t nv = visible_keys(r, offset, n_len);
      if (nv == 0) continue;
      float row_max = kNegInf;
      for (int64_t j = 0; j < nv; ++j) {
        float acc = 0.0f;
        for (int64_t i = 0; i < d.dqk; ++i) acc += w.q[r * d.dqk + i] * kt[j * d.dqk + i];
        w.s[j] = acc * scale;
        row_max = std::max(row_max, w.s[j]);
      }
      const float m_new = std::max(w.m[r], row_max);
      const float alpha = std::exp(w.m[r] - m_new);
      float sum = 0.0f;
      float* o = w.o + r * d.dv;
      for (int64_t i = 0; i < d.dv; ++i) o[i] *= alpha;
      for (int64_t j = 0; j < nv; ++j) {
        const float p = std::exp(w.s[j] - m_new);
        sum += p;
        for (int64_t i = 0; i < d.dv; ++i) o[i] += p * vt[j * d.dv + i];
      }
      w.m[r] = m_new;
      w.l[r] = w.l[r] * alpha + sum;
    }
  }

  static void store(Work& w, const Dims& d, T* out, int64_t stride, int64_t m_len) {
    for (int64_t r = 0; r < m_len; ++r) {
      const float inv = 1.0f / w.l[r];
      for (int64_t i = 0; i < d.dv; ++i) out[r * stride + i] = from_float<T>(w.o[r * d.dv + i] * inv);
    }
  }
};

// ---- AVX-512 pieces shared by the two vector paths ----------------------------------------------

struct StoreF32 {
  DUET_TARGET_AVX512 void operator()(float* p, __m512 v) const { _mm512_storeu_ps(p, v); }
};
struct StoreBf16 {
  DUET_TARGET_AVX512_BF16 void operator()(bf16_t* p, __m512 v) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
  }
};

// Online-softmax update of rows [0, m_len) for one key tile: new running max, alpha, P
// (written as PT, zero past the visible keys up to a multiple of 32 columns), running sum.
template <int ExpDegree, typename PT, typename StoreP>
DUET_TARGET_AVX512 inline __attribute__((always_inline)) void softmax_rows(
    const float* s, PT* p, int64_t ld, float* m, float* l, float* alpha, int64_t m_len,
    int64_t n_len, int64_t offset, float scale, StoreP store_p) {
  const int64_t n_pad = round_up(n_len, 32);
  for (int64_t r = 0; r < m_len; ++r) {
    const float* sr = s + r * ld;
    PT* pr = p + r * ld;
    const int64_t nv = visible_keys(r, offset, n_len);
    if (nv == 0) {
      for (int64_t j = 0; j < n_pad; j += 16) store_p(pr + j, _mm512_setzero_ps());
      alpha[r] = 1.0f;
      continue;
    }
    __m512 vmax = _mm512_set1_ps(kNegInf);
    for (int64_t j = 0; j < nv; j += 16) {
      vmax = _mm512_mask_max_ps(vmax, mask16(nv - j), vmax, _mm512_loadu_ps(sr + j));
    }
    const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax) * scale);
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 vneg_m = _mm512_set1_ps(-m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_pad; j += 16) {
      __m512 e = _mm512_setzero_ps();
      if (j < nv) {
        const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(sr + j), vscale, vneg_m);
        e = _mm512_maskz_mov_ps(mask16(nv - j), exp_neg<ExpDegree>(x));
        vsum = _mm512_add_ps(vsum, e);
      }
      store_p(pr + j, e);
    }
    alpha[r] = std::exp(m[r] - m_new);
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(vsum);
    m[r] = m_new;
  }
}

DUET_TARGET_AVX512 void softmax_f32(const float* s, float* p, int64_t ld, float* m, float* l,
                                    float* alpha, int64_t m_len, int64_t n_len, int64_t offset,
                                    float scale) {
  softmax_rows<6>(s, p, ld, m, l, alpha, m_len, n_len, offset, scale, StoreF32());
}

DUET_TARGET_AVX512_BF16 void softmax_bf16(const float* s, bf16_t* p, int64_t ld, float* m,
                                          float* l, float* alpha, int64_t m_len, int64_t n_len,
                                          int64_t offset, float scale) {
  softmax_rows<4>(s, p, ld, m, l, alpha, m_len, n_len, offset, scale, StoreBf16());
}

// out[r] = o[r] / l[r] for rows [0, m_len), o with row stride ld.
template <typename T>
DUET_TARGET_AVX512 void store_rows(const float* o, int64_t ld, const float* l, int64_t m_len,
                                   int64_t dv, T* out, int64_t stride) {
  for (int64_t r = 0; r < m_len; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t i = 0; i < dv; i += 16) {
      store_f32(out + r * stride + i, _mm512_mul_ps(_mm512_loadu_ps(o + r * ld + i), inv),
                mask16(dv - i));
    }
  }
}

// Start of a task: running max -inf, sums 0, O zero, and on the padded rows (the GEMMs run over
// whole row tiles) P zero and alpha 1 so they stay finite.
template <typename PT>
void begin_rows(float* m, float* l, float* alpha, float* o, int64_t o_ld, PT* p, int64_t p_ld,
                int64_t m_len, int64_t m_pad) {
  std::fill(m, m + m_pad, kNegInf);
  std::fill(l, l + m_pad, 0.0f);
  std::fill(alpha, alpha + m_pad, 1.0f);
  std::fill(o, o + m_pad * o_ld, 0.0f);
  std::fill(p + m_len * p_ld, p + m_pad * p_ld, PT(0));
}

// K tiles of both vector paths are column panels of 64 keys, each [rows][64] contiguous, so the
// QK^T GEMM reads one 64-key panel (the L1-resident B operand) as one contiguous stream.
constexpr int64_t kPanel = 64;

// Transposes 32-bit words: rows j < n_len of `src` (row stride `stride` elements, `words` words
// each, loaded by load(row pointer, first word, word count)) into panel-major dst[panel][w][64].
template <typename Load, typename T>
DUET_TARGET_AVX512 inline __attribute__((always_inline)) void pack_transposed(
    uint32_t* dst, int64_t panel_rows, const T* src, int64_t stride, int64_t n_len,
    int64_t words, Load load) {
  __m512i rows[16];
  for (int64_t n0 = 0; n0 < n_len; n0 += 16) {
    uint32_t* panel = dst + (n0 / kPanel) * panel_rows * kPanel + n0 % kPanel;
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
      for (int64_t r = 0; r < 16; ++r) {
        rows[r] = n0 + r < n_len ? load(src + (n0 + r) * stride, w0, words - w0)
                                 : _mm512_setzero_si512();
      }
      transpose16x16(rows);
      for (int64_t c = 0; c < 16; ++c) _mm512_storeu_si512(panel + (w0 + c) * kPanel, rows[c]);
    }
  }
}

// S[:, :n_len] = Q K^T, panel by panel, skipping the row tiles that see none of a panel (the
// upper part of the causal diagonal). q: [m_pad][k_count], kt: panels of [rows][64].
template <int R, typename Packed>
void scores_gemm(int64_t m_pad, int64_t n_len, int64_t offset, int64_t k_count, const Packed* q,
                 const Packed* kt, int64_t panel_elems, float* s, int64_t ld_s) {
  for (int64_t n0 = 0; n0 < n_len; n0 += kPanel) {
    const int64_t r0 = std::max<int64_t>(0, n0 - offset) / R * R;
    if (r0 >= m_pad) break;
    const int64_t n_vec = ceil_div(std::min(kPanel, n_len - n0), 16);
    gemm<R>(m_pad - r0, n_vec, k_count, q + r0 * k_count, k_count, 1, kt + (n0 / kPanel) * panel_elems,
            kPanel, s + r0 * ld_s + n0, ld_s, nullptr);
  }
}

// O = O * alpha + P V. On a diagonal tile each row tile contracts only over the keys its last
// row sees. p: [m_pad][ld_p] (keys_per_elem keys per element: 2 for VNNI pairs), vt: [keys][dv_pad].
template <int R, typename Packed>
void values_gemm(int64_t m_pad, int64_t n_len, int64_t offset, int64_t keys_per_elem,
                 const Packed* p, int64_t ld_p, const Packed* vt, int64_t dv_pad, float* o,
                 const float* alpha) {
  if (offset + 1 >= n_len) {
    gemm<R>(m_pad, dv_pad / 16, ceil_div(n_len, keys_per_elem), p, ld_p, 1, vt, dv_pad, o, dv_pad,
            alpha);
    return;
  }
  for (int64_t r0 = 0; r0 < m_pad; r0 += R) {
    const int64_t nv = visible_keys(r0 + R - 1, offset, n_len);
    if (nv == 0) continue;  // every row of the tile has alpha 1 and no keys
    gemm<R>(R, dv_pad / 16, ceil_div(nv, keys_per_elem), p + r0 * ld_p, ld_p, 1, vt, dv_pad,
            o + r0 * dv_pad, dv_pad, alpha + r0);
  }
}

// ---- fp32 AVX-512 path ----------------------------------------------------------------------------

// Tiles: K [bn / 64][dqk16][64] (transposed panels), V [bn][dv_pad], fp32.
template <typename T>
struct F32Path {
  static constexpr int kRows = 6;
  using Packed = float;
  struct Work {
    float *q, *s, *p, *o, *m, *l, *alpha;
    int64_t dv_pad;
  };

  static int64_t k_tile_elems(const Dims& d) { return round_up(d.dqk, 16) * d.bn; }
  static int64_t v_tile_elems(const Dims& d) { return d.bn * round_up(d.dv, 16); }

  struct LoadRow {
    DUET_TARGET_AVX512 __m512i operator()(const T* row, int64_t w0, int64_t count) const {
      return _mm512_castps_si512(load_f32(row + w0, mask16(count)));
    }
  };

  DUET_TARGET_AVX512 static void pack_k(float* dst, const Dims& d, const T* k, int64_t stride,
                                        int64_t n_len) {
    pack_transposed(reinterpret_cast<uint32_t*>(dst), round_up(d.dqk, 16), k, stride, n_len, d.dqk,
                    LoadRow());
  }

  DUET_TARGET_AVX512 static void pack_v(float* dst, const Dims& d, const T* v, int64_t stride,
                                        int64_t n_len) {
    const int64_t dv_pad = round_up(d.dv, 16);
    for (int64_t j = 0; j < n_len; ++j) {
      for (int64_t i = 0; i < dv_pad; i += 16) {
        _mm512_storeu_ps(dst + j * dv_pad + i, load_f32(v + j * stride + i, mask16(d.dv - i)));
      }
    }
  }

  static Work carve(Arena& a, const Dims& d) {
    Work w;
    w.dv_pad = round_up(d.dv, 16);
    w.q = a.take<float>(d.bm * d.dqk);
    w.s = a.take<float>(d.bm * d.bn);
    w.p = a.take<float>(d.bm * d.bn);
    w.o = a.take<float>(d.bm * w.dv_pad);
    w.m = a.take<float>(d.bm);
    w.l = a.take<float>(d.bm);
    w.alpha = a.take<float>(d.bm);
    return w;
  }

  DUET_TARGET_AVX512 static void load_q(Work& w, const Dims& d, const T* q, int64_t stride,
                                        int64_t m_len) {
    const int64_t m_pad = round_up(m_len, kRows);
    for (int64_t r = 0; r < m_pad; ++r) {
      for (int64_t i = 0; i < d.dqk; i += 16) {
        const __m512 x = r < m_len ? load_f32(q + r * stride + i, mask16(d.dqk - i)) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(w.q + r * d.dqk + i, mask16(d.dqk - i), x);
      }
    }
  }

  static void begin(Work& w, const Dims& d, int64_t m_len) {
    begin_rows(w.m, w.l, w.alpha, w.o, w.dv_pad, w.p, d.bn, m_len, round_up(m_len, kRows));
  }

  static void block(Work& w, const Dims& d, int64_t m_len, const float* kt, const float* vt,
                    int64_t n_len, int64_t offset, float scale) {
    const int64_t m_pad = round_up(m_len, kRows);
    scores_gemm<kRows>(m_pad, n_len, offset, d.dqk, w.q, kt, round_up(d.dqk, 16) * kPanel, w.s, d.bn);
    softmax_f32(w.s, w.p, d.bn, w.m, w.l, w.alpha, m_len, n_len, offset, scale);
    values_gemm<kRows>(m_pad, n_len, offset, 1, w.p, d.bn, vt, w.dv_pad, w.o, w.alpha);
  }

  static void store(Work& w, const Dims& d, T* out, int64_t stride, int64_t m_len) {
    store_rows(w.o, w.dv_pad, w.l, m_len, d.dv, out, stride);
  }
};

// ---- bf16 AVX-512-BF16 path -----------------------------------------------------------------------

// NOTE: layouts (one 32-bit word = one VNNI pair of bf16; dqp = ceil(dqk / 2) pairs).
//   q    [bm][dqp]                  pair i of query r = (q[r][2i], q[r][2i+1])
//   K    [bn / 64][dqp16][64]       pair i of key j at panel j / 64, row i, column j % 64
//   p    [bm][bn] bf16              probabilities; pair i of row r = (p[r][2i], p[r][2i+1])
//   V    [bn / 2][dv_pad]           pair i of column c = (v[2i][c], v[2i+1][c])
// Odd dqk and odd key counts are zero-padded inside the pairs.
struct Bf16Path {
  static constexpr int kRows = 6;
  using Packed = uint32_t;
  struct Work {
    uint32_t* q;
    bf16_t* p;
    float *s, *o, *m, *l, *alpha;
    int64_t dqp, dv_pad;
  };

  static int64_t k_tile_elems(const Dims& d) { return round_up(ceil_div(d.dqk, 2), 16) * d.bn; }
  static int64_t v_tile_elems(const Dims& d) { return d.bn / 2 * round_up(d.dv, 32); }

  // Pairs w0 .. w0 + count - 1 of a row; the element past an odd dqk reads as zero.
  struct LoadPairs {
    int64_t dqk;
    DUET_TARGET_AVX512 __m512i operator()(const bf16_t* row, int64_t w0, int64_t) const {
      return _mm512_maskz_loadu_epi16(mask32(dqk - 2 * w0), row + 2 * w0);
    }
  };

  DUET_TARGET_AVX512 static void pack_k(uint32_t* dst, const Dims& d, const bf16_t* k,
                                        int64_t stride, int64_t n_len) {
    const int64_t dqp = ceil_div(d.dqk, 2);
    pack_transposed(dst, round_up(dqp, 16), k, stride, n_len, dqp, LoadPairs{d.dqk});
  }

  DUET_TARGET_AVX512 static void pack_v(uint32_t* dst, const Dims& d, const bf16_t* v,
                                        int64_t stride, int64_t n_len) {
    const int64_t dv_pad = round_up(d.dv, 16);
    for (int64_t j = 0; j < n_len; j += 2) {
      const bf16_t* a = v + j * stride;
      const bf16_t* b = v + (j + 1) * stride;
      uint32_t* row = dst + (j / 2) * dv_pad;
      for (int64_t i = 0; i < dv_pad; i += 32) {
        const __mmask32 mk = mask32(d.dv - i);
        const __m512i ra = _mm512_maskz_loadu_epi16(mk, a + i);
        const __m512i rb = j + 1 < n_len ? _mm512_maskz_loadu_epi16(mk, b + i) : _mm512_setzero_si512();
        __m512i lo, hi;
        interleave_pairs(ra, rb, &lo, &hi);
        _mm512_storeu_si512(row + i, lo);
        if (i + 16 < dv_pad) _mm512_storeu_si512(row + i + 16, hi);
      }
    }
  }

  static Work carve(Arena& a, const Dims& d) {
    Work w;
    w.dqp = ceil_div(d.dqk, 2);
    w.dv_pad = round_up(d.dv, 16);
    w.q = a.take<uint32_t>(d.bm * w.dqp);
    w.s = a.take<float>(d.bm * d.bn);
    w.p = a.take<bf16_t>(d.bm * d.bn);
    w.o = a.take<float>(d.bm * w.dv_pad);
    w.m = a.take<float>(d.bm);
    w.l = a.take<float>(d.bm);
    w.alpha = a.take<float>(d.bm);
    return w;
  }

  DUET_TARGET_AVX512 static void load_q(Work& w, const Dims& d, const bf16_t* q, int64_t stride,
                                        int64_t m_len) {
    const int64_t m_pad = round_up(m_len, kRows);
    const int64_t width = 2 * w.dqp;
    for (int64_t r = 0; r < m_pad; ++r) {
      bf16_t* dst = reinterpret_cast<bf16_t*>(w.q + r * w.dqp);
      for (int64_t i = 0; i < width; i += 32) {
        const __m512i x = r < m_len ? _mm512_maskz_loadu_epi16(mask32(d.dqk - i), q + r * stride + i)
                                    : _mm512_setzero_si512();
        _mm512_mask_storeu_epi16(dst + i, mask32(width - i), x);
      }
    }
  }

  static void begin(Work& w, const Dims& d, int64_t m_len) {
    begin_rows(w.m, w.l, w.alpha, w.o, w.dv_pad, w.p, d.bn, m_len, round_up(m_len, kRows));
  }

  static void block(Work& w, const Dims& d, int64_t m_len, const uint32_t* kt, const uint32_t* vt,
                    int64_t n_len, int64_t offset, float scale) {
    const int64_t m_pad = round_up(m_len, kRows);
    scores_gemm<kRows>(m_pad, n_len, offset, w.dqp, w.q, kt, round_up(w.dqp, 16) * kPanel, w.s, d.bn);
    softmax_bf16(w.s, w.p, d.bn, w.m, w.l, w.alpha, m_len, n_len, offset, scale);
    values_gemm<kRows>(m_pad, n_len, offset, 2, reinterpret_cast<const uint32_t*>(w.p), d.bn / 2,
                       vt, w.dv_pad, w.o, w.alpha);
  }

  static void store(Work& w, const Dims& d, bf16_t* out, int64_t stride, int64_t m_len) {
    store_rows(w.o, w.dv_pad, w.l, m_len, d.dv, out, stride);
  }
};

// ---- driver ---------------------------------------------------------------------------------------

template <typename T>
const T* row_ptr(const View3& t, int64_t token, int64_t head) {
  return reinterpret_cast<const T*>(t.data) + token * t.token_stride + head * t.head_stride;
}

// Where the packed tiles of each sequence live: tile (b, h, j) is number
// first_tile[b] + h * tiles_per_head[b] + j; j < prefix_tiles[b] are the prefix, then the new keys.
struct TileIndex {
  std::vector<int64_t> first_tile, tiles_per_head, prefix_tiles;
  int64_t num_tiles = 0;

  TileIndex(const Problem& pb, int64_t bn) {
    for (size_t b = 0; b < pb.new_lens.size(); ++b) {
      first_tile.push_back(num_tiles);
      prefix_tiles.push_back(pb.new_lens[b] > 0 ? ceil_div(pb.prefix_lens[b], bn) : 0);
      tiles_per_head.push_back(pb.new_lens[b] > 0 ? prefix_tiles.back() + ceil_div(pb.new_lens[b], bn) : 0);
      num_tiles += tiles_per_head.back() * pb.num_heads;
    }
  }
};

// One key tile to pack: its rows and how many.
template <typename T>
struct PackItem {
  const T* k;
  const T* v;
  int64_t k_stride, v_stride, n_len;
};

template <typename T>
std::vector<PackItem<T>> make_pack_items(const Problem& pb, const TileIndex& ti, int64_t bn) {
  std::vector<PackItem<T>> items(ti.num_tiles);
  for (size_t b = 0; b < pb.new_lens.size(); ++b) {
    for (int64_t h = 0; h < pb.num_heads; ++h) {
      PackItem<T>* it = &items[ti.first_tile[b] + h * ti.tiles_per_head[b]];
      for (int64_t j = 0; j < ti.prefix_tiles[b]; ++j) {
        const int64_t n0 = pb.prefix_start[b] + j * bn;
        *it++ = {row_ptr<T>(pb.k_prefix, n0, h), row_ptr<T>(pb.v_prefix, n0, h),
                 pb.k_prefix.token_stride, pb.v_prefix.token_stride,
                 std::min(bn, pb.prefix_lens[b] - j * bn)};
      }
      for (int64_t j = 0; j < ti.tiles_per_head[b] - ti.prefix_tiles[b]; ++j) {
        const int64_t n0 = pb.new_start[b] + j * bn;
        *it++ = {row_ptr<T>(pb.k, n0, h), row_ptr<T>(pb.v, n0, h), pb.k.token_stride,
                 pb.v.token_stride, std::min(bn, pb.new_lens[b] - j * bn)};
      }
    }
  }
  return items;
}

struct Task {
  int64_t seq, head, m0, m_len;
};

// Tasks of one (sequence, head) are consecutive, so the query blocks working on it share its
// tiles through the caches; sequences go longest first and, inside one, the query blocks with
// the most keys first, so the short tasks come last under dynamic scheduling.
std::vector<Task> make_tasks(const Problem& pb, int64_t bm) {
  std::vector<int64_t> order(pb.new_lens.size());
  for (size_t b = 0; b < order.size(); ++b) order[b] = static_cast<int64_t>(b);
  auto seq_cost = [&](int64_t b) { return pb.new_lens[b] * (pb.prefix_lens[b] + pb.new_lens[b]); };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return seq_cost(x) > seq_cost(y); });
  std::vector<Task> tasks;
  for (const int64_t b : order) {
    const int64_t num_blocks = ceil_div(pb.new_lens[b], bm);
    for (int64_t h = 0; h < pb.num_heads; ++h) {
      for (int64_t i = num_blocks - 1; i >= 0; --i) {
        tasks.push_back({b, h, i * bm, std::min(bm, pb.new_lens[b] - i * bm)});
      }
    }
  }
  return tasks;
}

// bm: up to 120 queries (a multiple of the row tile), smaller when that leaves threads idle;
// bn: up to 256 keys, a multiple of the K panel width. The per-thread working set (~320 KB at 192/128) stays in L2.
Dims choose_dims(const Problem& pb, int rows) {
  int64_t max_new = 0, max_keys = 0, total_new = 0;
  for (size_t b = 0; b < pb.new_lens.size(); ++b) {
    max_new = std::max(max_new, pb.new_lens[b]);
    max_keys = std::max(max_keys, pb.new_lens[b] + pb.prefix_lens[b]);
    total_new += pb.new_lens[b];
  }
  Dims d{pb.dqk, pb.dv, 0, 0};
  d.bm = std::min<int64_t>(round_up(120, rows), round_up(std::max<int64_t>(max_new, 1), rows));
  const int64_t want_tasks = 4 * num_threads();
  while (d.bm > 4 * rows && ceil_div(total_new, d.bm) * pb.num_heads < want_tasks) {
    d.bm = round_up(d.bm / 2, rows);
  }
  d.bn = std::min<int64_t>(256, round_up(std::max<int64_t>(max_keys, 1), kPanel));
  return d;
}

template <typename Path, typename T>
void run_task(const Problem& pb, const Dims& d, const TileIndex& ti, const char* tiles,
              int64_t tile_bytes, int64_t v_offset, const Task& t, typename Path::Work& w) {
  using Packed = typename Path::Packed;
  const int64_t new_start = pb.new_start[t.seq];
  Path::load_q(w, d, row_ptr<T>(pb.q, new_start + t.m0, t.head), pb.q.token_stride, t.m_len);
  Path::begin(w, d, t.m_len);
  const char* tile = tiles + (ti.first_tile[t.seq] + t.head * ti.tiles_per_head[t.seq]) * tile_bytes;
  auto attend = [&](int64_t n_len, int64_t offset) {
    Path::block(w, d, t.m_len, reinterpret_cast<const Packed*>(tile),
                reinterpret_cast<const Packed*>(tile + v_offset), n_len, offset, pb.sm_scale);
    tile += tile_bytes;
  };
  const int64_t prefix_len = pb.prefix_lens[t.seq];
  for (int64_t n0 = 0; n0 < prefix_len; n0 += d.bn) {
    const int64_t n_len = std::min(d.bn, prefix_len - n0);
    attend(n_len, n_len);
  }
  // New keys: key n0 + j is visible to query m0 + r iff n0 + j <= m0 + r.
  const int64_t key_end = t.m0 + t.m_len;
  for (int64_t n0 = 0; n0 < key_end; n0 += d.bn) attend(std::min(d.bn, key_end - n0), t.m0 - n0);
  T* out = const_cast<T*>(row_ptr<T>(pb.out, new_start + t.m0, t.head));
  Path::store(w, d, out, pb.out.token_stride, t.m_len);
}

template <typename Path, typename T>
void run(const Problem& pb) {
  using Packed = typename Path::Packed;
  const Dims d = choose_dims(pb, Path::kRows);
  const TileIndex ti(pb, d.bn);
  const std::vector<PackItem<T>> items = make_pack_items<T>(pb, ti, d.bn);
  const std::vector<Task> tasks = make_tasks(pb, d.bm);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  if (num_tasks == 0) return;
  const int64_t v_offset = arena_bytes<Packed>(Path::k_tile_elems(d));
  const int64_t tile_bytes = v_offset + arena_bytes<Packed>(Path::v_tile_elems(d));
  // The tiles are about as large as k, v, k_prefix and v_prefix; kept by the calling thread.
  char* tiles = thread_scratch(1, static_cast<size_t>(ti.num_tiles * tile_bytes));
  Arena layout(nullptr);
  Path::carve(layout, d);
  const int64_t work_bytes = layout.used();
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(num_threads(), num_tasks)))
  {
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < ti.num_tiles; ++i) {
      char* tile = tiles + i * tile_bytes;
      const PackItem<T>& it = items[i];
      Path::pack_k(reinterpret_cast<Packed*>(tile), d, it.k, it.k_stride, it.n_len);
      Path::pack_v(reinterpret_cast<Packed*>(tile + v_offset), d, it.v, it.v_stride, it.n_len);
    }
    Arena arena(thread_scratch(0, work_bytes));
    typename Path::Work w = Path::carve(arena, d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) {
      run_task<Path, T>(pb, d, ti, tiles, tile_bytes, v_offset, tasks[i], w);
    }
  }
}

void dispatch(const Problem& pb, DType dtype) {
  const Isa isa = active_isa();
  const bool avx512 = isa >= Isa::kAvx512;
  if (dtype == DType::kFloat32) {
    avx512 ? run<F32Path<float>, float>(pb) : run<PortablePath<float>, float>(pb);
  } else if (isa >= Isa::kAvx512Bf16) {
    run<Bf16Path, bf16_t>(pb);
  } else {
    avx512 ? run<F32Path<bf16_t>, bf16_t>(pb) : run<PortablePath<bf16_t>, bf16_t>(pb);
  }
}

std::vector<int64_t> exclusive_sum(const std::vector<int64_t>& lens, int64_t limit,
                                   const char* what) {
  std::vector<int64_t> start(lens.size());
  int64_t total = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] < 0) throw std::invalid_argument(std::string(what) + " must be >= 0");
    start[i] = total;
    total += lens[i];
  }
  if (total > limit) {
    throw std::invalid_argument(std::string(what) + " sum to " + std::to_string(total) +
                                " but the tensor has " + std::to_string(limit) + " rows");
  }
  return start;
}

// Binding: raw pointers and element strides from native/_attention_ops.py, which checks
// devices, dtypes and shapes. strides = (token, head) for q, k, v, k_prefix, v_prefix, out.
void extend_attention_binding(uintptr_t out, uintptr_t q, uintptr_t k, uintptr_t v,
                              uintptr_t k_prefix, uintptr_t v_prefix,
                              const std::vector<int64_t>& strides, std::vector<int64_t> new_lens,
                              std::vector<int64_t> prefix_lens, int64_t num_tokens,
                              int64_t num_prefix_tokens, int64_t num_heads, int64_t head_dim_qk,
                              int64_t head_dim_v, int dtype, double sm_scale) {
  if (strides.size() != 12) throw std::invalid_argument("extend_attention: expected 12 strides");
  if (new_lens.size() != prefix_lens.size()) {
    throw std::invalid_argument("extend_attention: new_lens and prefix_lens differ in length");
  }
  if (num_heads < 1 || head_dim_qk < 1 || head_dim_v < 1 || head_dim_qk > 1024 ||
      head_dim_v > 1024) {
    throw std::invalid_argument("extend_attention: head dims must be in [1, 1024], heads >= 1");
  }
  const DType dt = static_cast<DType>(dtype);
  if (dt != DType::kFloat32 && dt != DType::kBFloat16) {
    throw std::invalid_argument("extend_attention: dtype must be float32 or bfloat16");
  }
  Problem pb;
  pb.num_heads = num_heads;
  pb.dqk = head_dim_qk;
  pb.dv = head_dim_v;
  pb.sm_scale = static_cast<float>(sm_scale);
  auto view = [&](uintptr_t p, int i) {
    return View3{reinterpret_cast<const char*>(p), strides[2 * i], strides[2 * i + 1]};
  };
  pb.q = view(q, 0);
  pb.k = view(k, 1);
  pb.v = view(v, 2);
  pb.k_prefix = view(k_prefix, 3);
  pb.v_prefix = view(v_prefix, 4);
  pb.out = view(out, 5);
  pb.new_start = exclusive_sum(new_lens, num_tokens, "new_lens");
  pb.prefix_start = exclusive_sum(prefix_lens, num_prefix_tokens, "prefix_lens");
  pb.new_lens = std::move(new_lens);
  pb.prefix_lens = std::move(prefix_lens);
  dispatch(pb, dt);
}

}  // namespace

void register_extend_attention(py::module_& m) {
  m.def("extend_attention", &extend_attention_binding, py::call_guard<py::gil_scoped_release>(),
        "FA2 extend attention (see native/_attention_ops.py for the contract).");
}

}  // namespace duet

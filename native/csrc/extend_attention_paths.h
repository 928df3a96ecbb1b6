// Per-ISA paths of extend attention (extend_attention.cpp): the packed K/V tile layouts, the
// per-tile step (S = Q K^T, online softmax, O = O * alpha + P V) and the final O / l.
//
// Every path has the same static interface, used by the driver in extend_attention.cpp:
//   kRows                          row tile of its GEMMs (query blocks are padded to it)
//   Packed                         element type of the packed tiles
//   k_tile_elems(d), v_tile_elems(d), pack_k(..), pack_v(..)    one tile of up to bn keys
//   Work carve(arena, d)           per-thread buffers
//   load_q, begin, block, store    one task: load a query block, walk the tiles, write O / l
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_common.h"
#include "attention_gemm.h"
#include "common.h"

namespace duet {
namespace extend {

using namespace attn;  // NOLINT(build/namespaces)

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
      for (int64_t i = 0; i < d.dqk; ++i) dst[j * d.dqk + i] = vec::to_f32(k[j * stride + i]);
    }
  }
  static void pack_v(float* dst, const Dims& d, const T* v, int64_t stride, int64_t n_len) {
    for (int64_t j = 0; j < n_len; ++j) {
      for (int64_t i = 0; i < d.dv; ++i) dst[j * d.dv + i] = vec::to_f32(v[j * stride + i]);
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
      for (int64_t i = 0; i < d.dqk; ++i) w.q[r * d.dqk + i] = vec::to_f32(q[r * stride + i]);
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
      for (int64_t i = 0; i < d.dv; ++i)
        out[r * stride + i] = vec::from_f32<T>(w.o[r * d.dv + i] * inv);
    }
  }
};

// ---- AVX-512 pieces shared by the two vector paths ---------------------------------------------

struct StoreF32 {
  DUET_TARGET_AVX512 void operator()(float* p, __m512 v) const { _mm512_storeu_ps(p, v); }
};
struct StoreBf16 {
  DUET_TARGET_AVX512_BF16 void operator()(bf16_t* p, __m512 v) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), vec::f32x16_to_bf16_insn(v));
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
      vmax = _mm512_mask_max_ps(vmax, vec::mask16(nv - j), vmax, _mm512_loadu_ps(sr + j));
    }
    const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax) * scale);
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 vneg_m = _mm512_set1_ps(-m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_pad; j += 16) {
      __m512 e = _mm512_setzero_ps();
      if (j < nv) {
        const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(sr + j), vscale, vneg_m);
        e = _mm512_maskz_mov_ps(vec::mask16(nv - j), vec::exp16_nonpos<ExpDegree>(x));
        vsum = _mm512_add_ps(vsum, e);
      }
      store_p(pr + j, e);
    }
    alpha[r] = std::exp(m[r] - m_new);
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(vsum);
    m[r] = m_new;
  }
}

DUET_TARGET_AVX512 inline void softmax_f32(const float* s, float* p, int64_t ld, float* m, float* l,
                                           float* alpha, int64_t m_len, int64_t n_len,
                                           int64_t offset, float scale) {
  softmax_rows<6>(s, p, ld, m, l, alpha, m_len, n_len, offset, scale, StoreF32());
}

DUET_TARGET_AVX512_BF16 inline void softmax_bf16(const float* s, bf16_t* p, int64_t ld, float* m,
                                                 float* l, float* alpha, int64_t m_len,
                                                 int64_t n_len, int64_t offset, float scale) {
  softmax_rows<4>(s, p, ld, m, l, alpha, m_len, n_len, offset, scale, StoreBf16());
}

// out[r] = o[r] / l[r] for rows [0, m_len), o with row stride ld.
template <typename T>
DUET_TARGET_AVX512 void store_rows(const float* o, int64_t ld, const float* l, int64_t m_len,
                                   int64_t dv, T* out, int64_t stride) {
  for (int64_t r = 0; r < m_len; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t i = 0; i < dv; i += 16) {
      vec::store16(out + r * stride + i, _mm512_mul_ps(_mm512_loadu_ps(o + r * ld + i), inv),
                   vec::mask16(dv - i));
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
    uint32_t* dst, int64_t panel_rows, const T* src, int64_t stride, int64_t n_len, int64_t words,
    Load load) {
  __m512i rows[16];
  for (int64_t n0 = 0; n0 < n_len; n0 += 16) {
    uint32_t* panel = dst + (n0 / kPanel) * panel_rows * kPanel + n0 % kPanel;
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
      for (int64_t r = 0; r < 16; ++r) {
        rows[r] =
            n0 + r < n_len ? load(src + (n0 + r) * stride, w0, words - w0) : _mm512_setzero_si512();
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
    gemm<R>(m_pad - r0, n_vec, k_count, q + r0 * k_count, k_count, 1,
            kt + (n0 / kPanel) * panel_elems, kPanel, s + r0 * ld_s + n0, ld_s, nullptr);
  }
}

// O = O * alpha + P V. On a diagonal tile each row tile contracts only over the keys its last
// row sees. p: [m_pad][ld_p] with keys_per_elem keys per element (2 for VNNI pairs);
// vt: [keys / keys_per_elem][dv_pad].
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

// ---- fp32 AVX-512 path -------------------------------------------------------------------------

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
      return _mm512_castps_si512(vec::load16(row + w0, vec::mask16(count)));
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
        const __m512 x = vec::load16(v + j * stride + i, vec::mask16(d.dv - i));
        _mm512_storeu_ps(dst + j * dv_pad + i, x);
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
        const __mmask16 mk = vec::mask16(d.dqk - i);
        const __m512 x = r < m_len ? vec::load16(q + r * stride + i, mk) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(w.q + r * d.dqk + i, mk, x);
      }
    }
  }

  static void begin(Work& w, const Dims& d, int64_t m_len) {
    begin_rows(w.m, w.l, w.alpha, w.o, w.dv_pad, w.p, d.bn, m_len, round_up(m_len, kRows));
  }

  static void block(Work& w, const Dims& d, int64_t m_len, const float* kt, const float* vt,
                    int64_t n_len, int64_t offset, float scale) {
    const int64_t m_pad = round_up(m_len, kRows);
    scores_gemm<kRows>(m_pad, n_len, offset, d.dqk, w.q, kt, round_up(d.dqk, 16) * kPanel, w.s,
                       d.bn);
    softmax_f32(w.s, w.p, d.bn, w.m, w.l, w.alpha, m_len, n_len, offset, scale);
    values_gemm<kRows>(m_pad, n_len, offset, 1, w.p, d.bn, vt, w.dv_pad, w.o, w.alpha);
  }

  static void store(Work& w, const Dims& d, T* out, int64_t stride, int64_t m_len) {
    store_rows(w.o, w.dv_pad, w.l, m_len, d.dv, out, stride);
  }
};

// ---- bf16 AVX-512-BF16 path --------------------------------------------------------------------

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
      return _mm512_maskz_loadu_epi16(vec::mask32(dqk - 2 * w0), row + 2 * w0);
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
        const __mmask32 mk = vec::mask32(d.dv - i);
        const __m512i ra = _mm512_maskz_loadu_epi16(mk, a + i);
        const __m512i rb =
            j + 1 < n_len ? _mm512_maskz_loadu_epi16(mk, b + i) : _mm512_setzero_si512();
        __m512i lo, hi;
        vec::interleave_pairs(ra, rb, &lo, &hi);
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
        const __m512i x = r < m_len
                              ? _mm512_maskz_loadu_epi16(vec::mask32(d.dqk - i), q + r * stride + i)
                              : _mm512_setzero_si512();
        _mm512_mask_storeu_epi16(dst + i, vec::mask32(width - i), x);
      }
    }
  }

  static void begin(Work& w, const Dims& d, int64_t m_len) {
    begin_rows(w.m, w.l, w.alpha, w.o, w.dv_pad, w.p, d.bn, m_len, round_up(m_len, kRows));
  }

  static void block(Work& w, const Dims& d, int64_t m_len, const uint32_t* kt, const uint32_t* vt,
                    int64_t n_len, int64_t offset, float scale) {
    const int64_t m_pad = round_up(m_len, kRows);
    scores_gemm<kRows>(m_pad, n_len, offset, w.dqp, w.q, kt, round_up(w.dqp, 16) * kPanel, w.s,
                       d.bn);
    softmax_bf16(w.s, w.p, d.bn, w.m, w.l, w.alpha, m_len, n_len, offset, scale);
    values_gemm<kRows>(m_pad, n_len, offset, 2, reinterpret_cast<const uint32_t*>(w.p), d.bn / 2,
                       vt, w.dv_pad, w.o, w.alpha);
  }

  static void store(Work& w, const Dims& d, bf16_t* out, int64_t stride, int64_t m_len) {
    store_rows(w.o, w.dv_pad, w.l, m_len, d.dv, out, stride);
  }
};

}  // namespace extend
}  // namespace duet

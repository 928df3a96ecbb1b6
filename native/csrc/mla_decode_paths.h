// Per-ISA paths of MLA decode (mla_decode.cpp): the step over one chunk of up to kChunk cached
// rows (load the rows once, S = rows . q with heads in lanes, online softmax per head,
// O = O * alpha + P V) and the merge of KV splits by log-sum-exp.
//
// Every path has the same static interface, used by the driver in mla_decode.cpp:
//   kAvx512                        whether the vector merge may run
//   Work carve(arena, d)           per-thread buffers
//   begin(w, d, q, head_stride)    load one sequence's query (all heads), reset m, l, O
//   chunk(w, d, rows, n_len, ..)   one chunk of up to kChunk rows (pointers into the cache)
//   finish(w, d, out, lse)         O / l (and m + log l for a split)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_common.h"
#include "attention_gemm.h"
#include "common.h"

namespace duet {
namespace mla {

using namespace attn;  // NOLINT(build/namespaces)

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Tokens per chunk: a multiple of 16, so chunks (and splits) start on 16-token boundaries and,
// when 16 divides the page size, every 16-row group of a chunk is contiguous in one page.
constexpr int64_t kChunk = 128;
// Rows of the chunk buffers: the QK^T GEMM on copied rows runs on whole tiles of up to 24 rows.
constexpr int64_t kMaxRowTile = 24;
constexpr int64_t kChunkRows = (kChunk + kMaxRowTile - 1) / kMaxRowTile * kMaxRowTile;

struct Dims {
  int64_t width, rank, heads;
  int64_t heads_pad;   // heads rounded up to 16 (one zmm of heads)
  bool keys_in_place;  // bf16 path: QK^T reads the cache rows directly (see Bf16Path)
  bool lane_pairs;     // bf16 path: value pairs built in-lane, columns permuted (see Bf16Path)
};

// ---- portable path -----------------------------------------------------------------------------

template <typename T>
struct PortablePath {
  static constexpr bool kAvx512 = false;
  struct Work {
    float *q, *s, *o, *m, *l;
  };

  static Work carve(Arena& a, const Dims& d) {
    Work w;
    w.q = a.take<float>(d.heads * d.width);
    w.s = a.take<float>(kChunk * d.heads);
    w.o = a.take<float>(d.heads * d.rank);
    w.m = a.take<float>(d.heads);
    w.l = a.take<float>(d.heads);
    return w;
  }

  static void begin(Work& w, const Dims& d, const T* q, int64_t head_stride) {
    for (int64_t h = 0; h < d.heads; ++h) {
      for (int64_t i = 0; i < d.width; ++i) {
        w.q[h * d.width + i] = vec::to_f32(q[h * head_stride + i]);
      }
    }
    std::fill(w.m, w.m + d.heads, kNegInf);
    std::fill(w.l, w.l + d.heads, 0.0f);
    std::fill(w.o, w.o + d.heads * d.rank, 0.0f);
  }

  static void chunk(Work& w, const Dims& d, const T* const* rows, int64_t n_len, float scale,
                    LinePrefetch*) {
    for (int64_t h = 0; h < d.heads; ++h) {
      float* s = w.s + h * kChunk;
      float row_max = kNegInf;
      for (int64_t j = 0; j < n_len; ++j) {
        float acc = 0.0f;
        for (int64_t i = 0; i < d.width; ++i) acc += w.q[h * d.width + i] * vec::to_f32(rows[j][i]);
        s[j] = acc * scale;
        row_max = std::max(row_max, s[j]);
      }
      const float m_new = std::max(w.m[h], row_max);
      const float alpha = std::exp(w.m[h] - m_new);
      float* o = w.o + h * d.rank;
      for (int64_t i = 0; i < d.rank; ++i) o[i] *= alpha;
      float sum = 0.0f;
      for (int64_t j = 0; j < n_len; ++j) {
        const float p = std::exp(s[j] - m_new);
        sum += p;
        for (int64_t i = 0; i < d.rank; ++i) o[i] += p * vec::to_f32(rows[j][i]);
      }
      w.m[h] = m_new;
      w.l[h] = w.l[h] * alpha + sum;
    }
  }

  // o[h] / l[h] as U, and the log-sum-exp m + log l of each head (when lse is given).
  template <typename U>
  static void finish(const Work& w, const Dims& d, U* out, float* lse) {
    for (int64_t h = 0; h < d.heads; ++h) {
      const float inv = 1.0f / w.l[h];
      for (int64_t i = 0; i < d.rank; ++i) {
        out[h * d.rank + i] = vec::from_f32<U>(w.o[h * d.rank + i] * inv);
      }
      if (lse) lse[h] = w.m[h] + std::log(w.l[h]);
    }
  }
};

// ---- AVX-512 pieces shared by the vector paths -------------------------------------------------

// Online softmax over one chunk, heads in lanes: s [kChunk][heads_pad] fp32 scores of rows
// j < n_len. Updates m, l (per head), writes alpha and the probabilities through store_pair
// (rows 2i and 2i+1 together; a missing odd row is zero).
template <int ExpDegree, typename StorePair>
DUET_TARGET_AVX512 inline __attribute__((always_inline)) void softmax_heads(
    const float* s, int64_t heads_pad, int64_t n_len, float scale, float* m, float* l, float* alpha,
    StorePair store_pair) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t h = 0; h < heads_pad; h += 16) {
    __m512 vmax = _mm512_set1_ps(kNegInf);
    for (int64_t j = 0; j < n_len; ++j) {
      vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j * heads_pad + h));
    }
    const __m512 m_old = _mm512_loadu_ps(m + h);
    const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(vmax, vscale));
    const __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m_new);
    // alpha = exp(m_old - m_new); m_old = -inf on the first chunk gives 0.
    const __m512 a =
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ),
                            vec::exp16_nonpos<6>(_mm512_add_ps(m_old, neg_m)));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_len; j += 2) {
      const __m512 p0 = vec::exp16_nonpos<ExpDegree>(
          _mm512_fmadd_ps(_mm512_loadu_ps(s + j * heads_pad + h), vscale, neg_m));
      const __m512 p1 = j + 1 < n_len
                            ? vec::exp16_nonpos<ExpDegree>(_mm512_fmadd_ps(
                                  _mm512_loadu_ps(s + (j + 1) * heads_pad + h), vscale, neg_m))
                            : _mm512_setzero_ps();
      vsum = _mm512_add_ps(vsum, _mm512_add_ps(p0, p1));
      store_pair(j, h, p0, p1);
    }
    _mm512_storeu_ps(alpha + h, a);
    _mm512_storeu_ps(l + h, _mm512_fmadd_ps(_mm512_loadu_ps(l + h), a, vsum));
    _mm512_storeu_ps(m + h, m_new);
  }
}

// The order of o's columns within each 32-column group, as two permutex2var index vectors (the
// group's first 16 output columns from its two halves, then the next 16).
struct ColumnOrder {
  alignas(64) int32_t lo[16];
  alignas(64) int32_t hi[16];
};
// Bf16Path::pair_values with lane_pairs: column c sits in slot 4 * (c / 8) + c % 4 (+ 16 if
// c % 8 >= 4).
inline constexpr ColumnOrder kLanePairColumns = {
    {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
    {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
// Even columns first, then odd: column c sits in slot c / 2 (+ 16 if c is odd).
inline constexpr ColumnOrder kEvenOddColumns = {
    {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23},
    {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}};

// out[h] = o[h] / l[h] (U = float or bf16) and lse[h] = m[h] + log l[h] when lse is given.
// o's columns are in their natural order, or (order given, rank % 32 == 0) permuted per group.
template <typename U>
DUET_TARGET_AVX512 void finish_rows(const float* o, int64_t ld, const float* m, const float* l,
                                    const Dims& d, const ColumnOrder* order, U* out, float* lse) {
  for (int64_t h = 0; h < d.heads; ++h) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[h]);
    const float* oh = o + h * ld;
    U* dst = out + h * d.rank;
    if (order != nullptr) {
      const __m512i lo = _mm512_load_si512(order->lo), hi = _mm512_load_si512(order->hi);
      for (int64_t i = 0; i < d.rank; i += 32) {
        const __m512 x = _mm512_loadu_ps(oh + i), y = _mm512_loadu_ps(oh + i + 16);
        vec::store16(dst + i, _mm512_mul_ps(_mm512_permutex2var_ps(x, lo, y), inv), 0xffff);
        vec::store16(dst + i + 16, _mm512_mul_ps(_mm512_permutex2var_ps(x, hi, y), inv), 0xffff);
      }
    } else {
      for (int64_t i = 0; i < d.rank; i += 16) {
        vec::store16(dst + i, _mm512_mul_ps(_mm512_loadu_ps(oh + i), inv), vec::mask16(d.rank - i));
      }
    }
    if (lse) lse[h] = m[h] + std::log(l[h]);
  }
}

// S [rows][heads_pad] = chunk rows . q, for the first n_len rows (rounded up to the row tile,
// chosen so that 24 accumulators cover the head vectors).
template <typename Packed>
void scores_gemm(int64_t n_len, int64_t head_vecs, int64_t k_count, const Packed* rows,
                 int64_t row_stride, const Packed* q, int64_t q_stride, float* s,
                 LinePrefetch* pf) {
  switch (head_vecs) {
    case 1:
      return gemm<24>(round_up(n_len, 24), 1, k_count, rows, row_stride, 1, q, q_stride, s,
                      q_stride, nullptr, pf);
    case 2:
      return gemm<12>(round_up(n_len, 12), 2, k_count, rows, row_stride, 1, q, q_stride, s,
                      q_stride, nullptr, pf);
    case 3:
      return gemm<8>(round_up(n_len, 8), 3, k_count, rows, row_stride, 1, q, q_stride, s, q_stride,
                     nullptr, pf);
    default:
      return gemm<6>(round_up(n_len, 6), head_vecs, k_count, rows, row_stride, 1, q, q_stride, s,
                     q_stride, nullptr, pf);
  }
}

// PV row tile: rows are heads (16 per tile, heads_pad is a multiple of 16).
constexpr int kHeadRows = 16;

// ---- fp32 AVX-512 path -------------------------------------------------------------------------

// NOTE: layouts (fp32). q [width][heads_pad] (transposed: heads in lanes); k [rows][width_pad]
// the chunk's rows (converted), also the values (first rank columns); s and p [rows][heads_pad].
template <typename T>
struct F32Path {
  static constexpr bool kAvx512 = true;
  struct Work {
    float *q, *k, *s, *p, *o, *m, *l, *alpha;
    int64_t width_pad;
  };

  static Work carve(Arena& a, const Dims& d) {
    Work w;
    w.width_pad = round_up(d.width, 16);
    w.q = a.take<float>(d.width * d.heads_pad);
    w.k = a.take<float>(kChunkRows * w.width_pad);
    w.s = a.take<float>(kChunkRows * d.heads_pad);
    w.p = a.take<float>(kChunkRows * d.heads_pad);
    w.o = a.take<float>(d.heads_pad * w.width_pad);
    w.m = a.take<float>(d.heads_pad);
    w.l = a.take<float>(d.heads_pad);
    w.alpha = a.take<float>(d.heads_pad);
    return w;
  }

  static void begin(Work& w, const Dims& d, const T* q, int64_t head_stride) {
    std::fill(w.q, w.q + d.width * d.heads_pad, 0.0f);
    for (int64_t h = 0; h < d.heads; ++h) {
      for (int64_t i = 0; i < d.width; ++i) {
        w.q[i * d.heads_pad + h] = vec::to_f32(q[h * head_stride + i]);
      }
    }
    std::fill(w.m, w.m + d.heads_pad, kNegInf);
    std::fill(w.l, w.l + d.heads_pad, 0.0f);
    std::fill(w.o, w.o + d.heads_pad * w.width_pad, 0.0f);
  }

  struct StorePair {
    float* p;
    int64_t heads_pad;
    DUET_TARGET_AVX512 void operator()(int64_t j, int64_t h, __m512 p0, __m512 p1) const {
      _mm512_storeu_ps(p + j * heads_pad + h, p0);
      _mm512_storeu_ps(p + (j + 1) * heads_pad + h, p1);
    }
  };

  DUET_TARGET_AVX512 static void softmax(Work& w, const Dims& d, int64_t n_len, float scale) {
    softmax_heads<6>(w.s, d.heads_pad, n_len, scale, w.m, w.l, w.alpha,
                     StorePair{w.p, d.heads_pad});
  }

  DUET_TARGET_AVX512 static void gather(Work& w, const Dims& d, const T* const* rows,
                                        int64_t n_len) {
    for (int64_t j = 0; j < round_up(n_len, kMaxRowTile); ++j) {
      float* dst = w.k + j * w.width_pad;
      for (int64_t i = 0; i < w.width_pad; i += 16) {
        const __m512 x =
            j < n_len ? vec::load16(rows[j] + i, vec::mask16(d.width - i)) : _mm512_setzero_ps();
        _mm512_storeu_ps(dst + i, x);
      }
    }
  }

  static void chunk(Work& w, const Dims& d, const T* const* rows, int64_t n_len, float scale,
                    LinePrefetch* pf) {
    gather(w, d, rows, n_len);
    pf->k_steps_per_line = 2;  // spread the next chunk's lines over both GEMMs
    scores_gemm(n_len, d.heads_pad / 16, d.width, w.k, w.width_pad, w.q, d.heads_pad, w.s, pf);
    softmax(w, d, n_len, scale);
    pf->k_steps_per_line = 1;
    // O[h] = O[h] * alpha[h] + sum_j p[j][h] rows[j][:rank]: A = p transposed (a_rs = 1).
    gemm<kHeadRows>(d.heads_pad, ceil_div(d.rank, 16), n_len, w.p, 1, d.heads_pad, w.k, w.width_pad,
                    w.o, w.width_pad, w.alpha, pf);
  }

  template <typename U>
  static void finish(const Work& w, const Dims& d, U* out, float* lse) {
    finish_rows(w.o, w.width_pad, w.m, w.l, d, nullptr, out, lse);
  }
};

// ---- bf16 AVX-512-BF16 path --------------------------------------------------------------------

// NOTE: layouts (one 32-bit word = one VNNI pair of bf16; wp = ceil(width / 2) pairs).
//   q [wp][heads_pad]            pair i of head h = (q[h][2i], q[h][2i+1])   (heads in lanes)
//   k [rows][row_words]          the chunk's rows copied, as pairs (A of QK^T), unless the rows
//                                are read in place (Dims::keys_in_place)
//   v [kChunk / 2][rank_pad]     pair i of column c = (row[2i][c], row[2i+1][c])
//   p [kChunk / 2][heads_pad]    pair i of head h = (p[2i][h], p[2i+1][h])
struct Bf16Path {
  static constexpr bool kAvx512 = true;
  struct Work {
    uint32_t *q, *k, *v, *p;
    float *s, *o, *m, *l, *alpha;
    int64_t row_words, rank_pad;
  };

  static Work carve(Arena& a, const Dims& d) {
    Work w;
    w.row_words = round_up(d.width, 32) / 2;
    w.rank_pad = round_up(d.rank, 16);
    w.q = a.take<uint32_t>(round_up(ceil_div(d.width, 2), 16) * d.heads_pad);
    w.k = a.take<uint32_t>(kChunkRows * w.row_words);
    // gather() writes value pairs for every row of the padded row tiles (up to kChunkRows), not
    // just kChunk: sized for kChunk, the zero pairs of a 121..128-row chunk spilled into p, s
    // and the running output o, wiping the sum of the earlier chunks of the task.
    w.v = a.take<uint32_t>(kChunkRows / 2 * round_up(d.rank, 32));
    w.p = a.take<uint32_t>(kChunk / 2 * d.heads_pad);
    w.s = a.take<float>(kChunkRows * d.heads_pad);
    w.o = a.take<float>(d.heads_pad * w.rank_pad);
    w.m = a.take<float>(d.heads_pad);
    w.l = a.take<float>(d.heads_pad);
    w.alpha = a.take<float>(d.heads_pad);
    return w;
  }

  // q pairs transposed to [wp][heads_pad] with 16x16 word transposes (missing heads are zero).
  DUET_TARGET_AVX512 static void begin(Work& w, const Dims& d, const bf16_t* q,
                                       int64_t head_stride) {
    const int64_t wp = ceil_div(d.width, 2);
    __m512i t[16];
    for (int64_t h0 = 0; h0 < d.heads_pad; h0 += 16) {
      for (int64_t i0 = 0; i0 < wp; i0 += 16) {
        for (int64_t r = 0; r < 16; ++r) {
          const __mmask32 mk = vec::mask32(d.width - 2 * i0);
          t[r] = h0 + r < d.heads
                     ? _mm512_maskz_loadu_epi16(mk, q + (h0 + r) * head_stride + 2 * i0)
                     : _mm512_setzero_si512();
        }
        transpose16x16(t);
        for (int64_t c = 0; c < 16; ++c) {
          _mm512_storeu_si512(w.q + (i0 + c) * d.heads_pad + h0, t[c]);
        }
      }
    }
    std::fill(w.m, w.m + d.heads_pad, kNegInf);
    std::fill(w.l, w.l + d.heads_pad, 0.0f);
    std::fill(w.o, w.o + d.heads_pad * w.rank_pad, 0.0f);
  }

  // VNNI value pairs of two rows' 32 columns: (a[c], b[c]) for c in order (lo: columns 0-15,
  // hi: 16-31), or, with lane_pairs, two in-lane unpacks (half the cost of the cross-lane
  // permutes) that leave the columns permuted within the group; finish_rows puts them back.
  DUET_TARGET_AVX512 static inline __attribute__((always_inline)) void pair_values(
      const Dims& d, __m512i a, __m512i b, __m512i* lo, __m512i* hi) {
    if (d.lane_pairs) {
      *lo = _mm512_unpacklo_epi16(a, b);
      *hi = _mm512_unpackhi_epi16(a, b);
    } else {
      vec::interleave_pairs(a, b, lo, hi);
    }
  }

  // Loads each row pair once: stores it as value pairs and as keys (contiguous rows, zero rows
  // up to the row tile), for QK^T when the keys cannot be read in place.
  DUET_TARGET_AVX512 static void gather(Work& w, const Dims& d, const bf16_t* const* rows,
                                        int64_t n_len) {
    const int64_t row_elems = 2 * w.row_words;
    const int64_t num_rows = round_up(n_len, kMaxRowTile);
    const int64_t width = d.width, rank = d.rank, rank_pad = w.rank_pad, row_words = w.row_words;
    for (int64_t j = 0; j < num_rows; j += 2) {
      const bool has0 = j < n_len, has1 = j + 1 < n_len;
      bf16_t* k0 = reinterpret_cast<bf16_t*>(w.k + j * row_words);
      bf16_t* k1 = k0 + 2 * row_words;
      uint32_t* v = w.v + (j / 2) * rank_pad;
      for (int64_t i = 0; i < row_elems; i += 32) {
        const __mmask32 mk = vec::mask32(width - i);
        const __m512i a = has0 ? _mm512_maskz_loadu_epi16(mk, rows[j] + i) : _mm512_setzero_si512();
        const __m512i b =
            has1 ? _mm512_maskz_loadu_epi16(mk, rows[j + 1] + i) : _mm512_setzero_si512();
        _mm512_storeu_si512(k0 + i, a);
        _mm512_storeu_si512(k1 + i, b);
        if (i < rank_pad) {
          const __mmask32 mv = vec::mask32(rank - i);
          __m512i lo, hi;
          pair_values(d, _mm512_maskz_mov_epi16(mv, a), _mm512_maskz_mov_epi16(mv, b), &lo, &hi);
          _mm512_storeu_si512(v + i, lo);
          if (i + 16 < rank_pad) _mm512_storeu_si512(v + i + 16, hi);
        }
      }
    }
  }

  // Value pairs only (keys read in place). Whole row pairs and 32-column segments, the common
  // case, run without masks.
  DUET_TARGET_AVX512 static void pack_values(Work& w, const Dims& d, const bf16_t* const* rows,
                                             int64_t n_len) {
    const int64_t rank = d.rank, rank_pad = w.rank_pad, full = rank / 32 * 32;
    for (int64_t j = 0; j < n_len; j += 2) {
      const bf16_t* a = rows[j];
      const bf16_t* b = j + 1 < n_len ? rows[j + 1] : nullptr;
      uint32_t* v = w.v + (j / 2) * rank_pad;
      int64_t i = 0;
      __m512i lo, hi;
      if (b != nullptr) {
        for (; i < full; i += 32) {
          pair_values(d, _mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i), &lo, &hi);
          _mm512_storeu_si512(v + i, lo);
          _mm512_storeu_si512(v + i + 16, hi);
        }
      }
      for (; i < rank_pad; i += 32) {  // the column tail, or a last row without a partner
        const __mmask32 mk = vec::mask32(rank - i);
        const __m512i rb =
            b != nullptr ? _mm512_maskz_loadu_epi16(mk, b + i) : _mm512_setzero_si512();
        pair_values(d, _mm512_maskz_loadu_epi16(mk, a + i), rb, &lo, &hi);
        _mm512_storeu_si512(v + i, lo);
        if (i + 16 < rank_pad) _mm512_storeu_si512(v + i + 16, hi);
      }
    }
  }

  // QK^T on the cache rows in place: every 16-row group of the chunk is contiguous in one page
  // (kChunk), so a row tile is one pointer plus a fixed row stride. Rows of the last tile past
  // n_len are other rows of the same page: finite or not, their scores are never read.
  static void scores_in_place(Work& w, const Dims& d, const bf16_t* const* rows, int64_t n_len,
                              LinePrefetch* pf) {
    const int64_t head_vecs = d.heads_pad / 16, k_count = d.width / 2, row_words = d.width / 2;
    for (int64_t r0 = 0; r0 < n_len; r0 += 16) {
      const uint32_t* a = reinterpret_cast<const uint32_t*>(rows[r0]);
      float* s = w.s + r0 * d.heads_pad;
      if (head_vecs == 1) {
        tile_any<16, 1>(1, a, row_words, 1, w.q, d.heads_pad, k_count, s, d.heads_pad, nullptr, pf);
        continue;
      }
      for (int64_t j0 = 0; j0 < head_vecs; j0 += 3) {  // 2 x (8 rows x 3 head vectors)
        for (int64_t r = 0; r < 16; r += 8) {
          tile_any<8, 3>(std::min<int64_t>(3, head_vecs - j0), a + r * row_words, row_words, 1,
                         w.q + 16 * j0, d.heads_pad, k_count, s + r * d.heads_pad + 16 * j0,
                         d.heads_pad, nullptr, pf);
        }
      }
    }
  }

  struct StorePair {
    uint32_t* p;
    int64_t heads_pad;
    DUET_TARGET_AVX512_BF16 void operator()(int64_t j, int64_t h, __m512 p0, __m512 p1) const {
      alignas(64) static const uint16_t kInterleave[32] = {
          0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 in the low half
      _mm512_storeu_si512(p + (j / 2) * heads_pad + h,
                          _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both));
    }
  };

  DUET_TARGET_AVX512_BF16 static void softmax(Work& w, const Dims& d, int64_t n_len, float scale) {
    softmax_heads<4>(w.s, d.heads_pad, n_len, scale, w.m, w.l, w.alpha,
                     StorePair{w.p, d.heads_pad});
  }

  static void chunk(Work& w, const Dims& d, const bf16_t* const* rows, int64_t n_len, float scale,
                    LinePrefetch* pf) {
    pf->k_steps_per_line = 2;  // spread the next chunk's lines over both GEMMs
    if (d.keys_in_place) {
      pack_values(w, d, rows, n_len);
      scores_in_place(w, d, rows, n_len, pf);
    } else {
      gather(w, d, rows, n_len);
      scores_gemm(n_len, d.heads_pad / 16, ceil_div(d.width, 2), w.k, w.row_words, w.q, d.heads_pad,
                  w.s, pf);
    }
    softmax(w, d, n_len, scale);
    pf->k_steps_per_line = 1;
    gemm<kHeadRows>(d.heads_pad, w.rank_pad / 16, ceil_div(n_len, 2), w.p, 1, d.heads_pad, w.v,
                    w.rank_pad, w.o, w.rank_pad, w.alpha, pf);
  }

  template <typename U>
  static void finish(const Work& w, const Dims& d, U* out, float* lse) {
    finish_rows(w.o, w.rank_pad, w.m, w.l, d, d.lane_pairs ? &kLanePairColumns : nullptr, out,
                lse);
  }
};

// Merge of the splits of one (sequence, head): out = sum_s w_s partial_s / sum_s w_s with
// w_s = exp(lse_s - max lse). partial and lse point at split 0 of this head; split s lies
// s * heads * rank (partial) and s * heads (lse) elements further.
inline void split_weights(int64_t num_splits, const float* lse, int64_t heads, float* weights) {
  float max_lse = kNegInf;
  for (int64_t s = 0; s < num_splits; ++s) max_lse = std::max(max_lse, lse[s * heads]);
  float total = 0.0f;
  for (int64_t s = 0; s < num_splits; ++s) total += weights[s] = std::exp(lse[s * heads] - max_lse);
  for (int64_t s = 0; s < num_splits; ++s) weights[s] /= total;
}

template <typename T>
void merge_head_scalar(const Dims& d, int64_t num_splits, const float* partial, const float* lse,
                       float* weights, T* out) {
  split_weights(num_splits, lse, d.heads, weights);
  for (int64_t i = 0; i < d.rank; ++i) {
    float acc = 0.0f;
    for (int64_t s = 0; s < num_splits; ++s) acc += weights[s] * partial[s * d.heads * d.rank + i];
    out[i] = vec::from_f32<T>(acc);
  }
}

template <typename T>
DUET_TARGET_AVX512 void merge_head_avx512(const Dims& d, int64_t num_splits, const float* partial,
                                          const float* lse, float* weights, T* out) {
  split_weights(num_splits, lse, d.heads, weights);
  for (int64_t i = 0; i < d.rank; i += 16) {
    const __mmask16 mk = vec::mask16(d.rank - i);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t s = 0; s < num_splits; ++s) {
      acc = _mm512_fmadd_ps(_mm512_set1_ps(weights[s]),
                            _mm512_maskz_loadu_ps(mk, partial + s * d.heads * d.rank + i), acc);
    }
    vec::store16(out + i, acc, mk);
  }
}

}  // namespace mla
}  // namespace duet

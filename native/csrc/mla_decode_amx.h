// The AMX path of MLA decode (mla_decode.cpp), for CPUs with AMX-BF16 tiles: both products of a
// chunk run on the tile unit straight from the cache rows, which are never repacked. A row is
// touched twice, by the scores' tile loads and by the values', both from L2, where the previous
// chunk's prefetches put it. Packing the values into VNNI row pairs first, as Bf16Path does,
// reads and writes every row once more: timed by phase, that pass took a third of a chunk, more
// than either tile product. Here the values product multiplies zeros in half of each tile
// instead (below), which costs the tile unit less than the pass did.
//
// NOTE: layouts (tiles are 16 rows x 64 bytes; one 32-bit word = one bf16 pair).
//   S^T = K . Q     per 16-row group and 16-head block: A = 16 cache rows x 32 values (in place,
//                   stride W * 2 bytes, or a contiguous copy), B = 16 of the query's pairs x 16
//                   heads (Bf16Path's q [wp][heads_pad]); C is stored as S rows.
//   O += P . V      per 16-head block, 16-row group and 32-column block: B = the 16 rows' 32
//                   value columns as they lie in the cache, so a B word pairs two neighbouring
//                   columns of one row, not two rows. Two A tiles pick one column of each pair:
//                   the group's P^T (16 heads x 16 rows) with each p in the low half of its word
//                   (the pair's even column) or in the high half (the odd one), the other half
//                   zero. Their products are O's even and odd columns, kept apart in o as
//                   [even 16 | odd 16] per 32 columns (kEvenOddColumns), put in order at the end.
// Taken for W and L multiples of 32 (DeepSeek's 576 and 512); other shapes run Bf16Path.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "mla_decode_paths.h"

namespace duet {
namespace mla {

struct AmxPath {
  static constexpr bool kAvx512 = true;
  static constexpr int64_t kGroups = kChunk / 16;  // 16-row groups of a chunk
  static constexpr int64_t kTileWords = 16 * 16;

  struct Work {
    uint32_t* q;   // [wp rounded to 16][heads_pad] query pairs (Bf16Path::begin)
    bf16_t* k;     // [kChunk][width]: the chunk's rows when they cannot be read in place
    bf16_t* tail;  // [16][rank]: a last part-group's value columns, zero rows after it
    uint32_t* pw;  // [kChunk][heads_pad]: each probability as bf16 in the low half of a word
    uint32_t* pt;  // [heads_pad / 16][kGroups][2][16][16]: per group, P^T even and odd tiles
    float *s, *o, *m, *l, *alpha;
    int64_t rank_pad;
  };

  static Work carve(Arena& a, const Dims& d) {
    Work w;
    w.rank_pad = d.rank;  // a multiple of 32
    w.q = a.take<uint32_t>(round_up(ceil_div(d.width, 2), 16) * d.heads_pad);
    w.k = a.take<bf16_t>(kChunk * d.width);
    w.tail = a.take<bf16_t>(16 * d.rank);
    w.pw = a.take<uint32_t>(kChunk * d.heads_pad);
    w.pt = a.take<uint32_t>(d.heads_pad / 16 * kGroups * 2 * kTileWords);
    w.s = a.take<float>(kChunk * d.heads_pad);
    w.o = a.take<float>(d.heads_pad * w.rank_pad);
    w.m = a.take<float>(d.heads_pad);
    w.l = a.take<float>(d.heads_pad);
    w.alpha = a.take<float>(d.heads_pad);
    return w;
  }

  static void begin(Work& w, const Dims& d, const bf16_t* q, int64_t head_stride) {
    Bf16Path::Work query{};
    query.q = w.q;
    query.o = w.o;
    query.m = w.m;
    query.l = w.l;
    query.rank_pad = w.rank_pad;
    Bf16Path::begin(query, d, q, head_stride);
  }

  // Where a 16-row group's rows lie: the cache pages (16 rows of a group share a page), or the
  // chunk's copy; the values of a part-filled last group read in place come from `tail`.
  struct Rows {
    const bf16_t* const* rows;  // in place: rows[16 g] starts group g
    const bf16_t* copy;         // else: the contiguous copy
    int64_t stride;             // bytes between a group's rows
    int64_t full_groups;        // groups whose every row is a row of the chunk

    const char* keys(int64_t g) const {
      return reinterpret_cast<const char*>(copy != nullptr ? copy + g * 16 * (stride / 2)
                                                           : rows[16 * g]);
    }
  };

  // Rows (and zero rows up to a whole group) copied when the page size keeps groups apart.
  static void copy_keys(Work& w, const Dims& d, const bf16_t* const* rows, int64_t n_len) {
    for (int64_t j = 0; j < round_up(n_len, 16); ++j) {
      bf16_t* row = w.k + j * d.width;
      if (j < n_len) {
        std::memcpy(row, rows[j], d.width * sizeof(bf16_t));
      } else {
        std::memset(row, 0, d.width * sizeof(bf16_t));
      }
    }
  }

  // The value columns of the last group's rows (from row 16 * g0 on), zero rows after n_len: a
  // row of the page past the chunk may hold anything, and 0 * inf is not 0.
  static void copy_tail(Work& w, const Dims& d, const bf16_t* const* rows, int64_t g0,
                        int64_t n_len) {
    for (int64_t r = 0; r < 16; ++r) {
      bf16_t* dst = w.tail + r * d.rank;
      if (16 * g0 + r < n_len) {
        std::memcpy(dst, rows[16 * g0 + r], d.rank * sizeof(bf16_t));
      } else {
        std::memset(dst, 0, d.rank * sizeof(bf16_t));
      }
    }
  }

  static void prefetch_n(LinePrefetch* pf, int64_t n) {
    for (int64_t i = 0; i < n; ++i) prefetch_one(pf);
  }

  // S[r][h] for r < 16 * groups: tiles 0-3 = S of up to four row groups, 4 = query pairs,
  // 5 = a group's keys. Each query tile is loaded once for four groups.
  DUET_TARGET_AMX static void scores(Work& w, const Dims& d, const Rows& src, int64_t groups,
                                     LinePrefetch* pf, int64_t lines_per_load) {
    const int64_t k_steps = d.width / 32;
    const int64_t q_stride = d.heads_pad * 4, s_stride = d.heads_pad * 4;
    for (int64_t h0 = 0; h0 < d.heads_pad; h0 += 16) {
      for (int64_t g0 = 0; g0 < groups; g0 += 4) {
        const int64_t n = std::min<int64_t>(4, groups - g0);
        const char* keys[4] = {};
        for (int64_t i = 0; i < n; ++i) keys[i] = src.keys(g0 + i);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < k_steps; ++kk) {
          _tile_loadd(4, w.q + kk * 16 * d.heads_pad + h0, q_stride);
          // (the tile intrinsics take their tile numbers as literals)
          _tile_loadd(5, keys[0] + kk * 64, src.stride);
          _tile_dpbf16ps(0, 5, 4);
          if (n > 1) {
            _tile_loadd(5, keys[1] + kk * 64, src.stride);
            _tile_dpbf16ps(1, 5, 4);
          }
          if (n > 2) {
            _tile_loadd(5, keys[2] + kk * 64, src.stride);
            _tile_dpbf16ps(2, 5, 4);
          }
          if (n > 3) {
            _tile_loadd(5, keys[3] + kk * 64, src.stride);
            _tile_dpbf16ps(3, 5, 4);
          }
          prefetch_n(pf, n * lines_per_load);
        }
        float* s = w.s + g0 * 16 * d.heads_pad + h0;
        _tile_stored(0, s, s_stride);
        if (n > 1) _tile_stored(1, s + 16 * d.heads_pad, s_stride);
        if (n > 2) _tile_stored(2, s + 32 * d.heads_pad, s_stride);
        if (n > 3) _tile_stored(3, s + 48 * d.heads_pad, s_stride);
      }
    }
  }

  // Probabilities as bf16, one per word (rows j and j + 1 of 16 heads).
  struct StoreWords {
    uint32_t* pw;
    int64_t heads_pad;
    DUET_TARGET_AMX void operator()(int64_t j, int64_t h, __m512 p0, __m512 p1) const {
      _mm512_storeu_si512(pw + j * heads_pad + h,
                          _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0)));
      _mm512_storeu_si512(pw + (j + 1) * heads_pad + h,
                          _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1)));
    }
  };

  // The A tiles of every group (P^T, rows past n_len zero) and O *= alpha.
  DUET_TARGET_AMX static void prepare_values(Work& w, const Dims& d, int64_t n_len,
                                             int64_t groups) {
    __m512i t[16];
    for (int64_t h0 = 0; h0 < d.heads_pad; h0 += 16) {
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t row = 16 * g + i;
          t[i] = row < n_len ? _mm512_loadu_si512(w.pw + row * d.heads_pad + h0)
                             : _mm512_setzero_si512();
        }
        transpose16x16(t);
        uint32_t* even = w.pt + ((h0 / 16 * kGroups + g) * 2) * kTileWords;
        uint32_t* odd = even + kTileWords;
        for (int64_t h = 0; h < 16; ++h) {
          _mm512_storeu_si512(even + 16 * h, t[h]);
          _mm512_storeu_si512(odd + 16 * h, _mm512_slli_epi32(t[h], 16));
        }
      }
    }
    for (int64_t h = 0; h < d.heads_pad; ++h) {
      // Once a head's running max settles, alpha is exactly 1 and the scaling is the identity:
      // skipped, it leaves O's lines alone for the tile loads that follow.
      if (w.alpha[h] == 1.0f) continue;
      const __m512 a = _mm512_set1_ps(w.alpha[h]);
      float* o = w.o + h * w.rank_pad;
      for (int64_t c = 0; c < w.rank_pad; c += 16) {
        _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), a));
      }
    }
  }

  // O += P V: tiles 0-3 = O's even and odd columns of two 32-column blocks, 4 / 5 = a group's
  // even / odd P^T, 6 = the group's 16 rows x 32 value columns.
  DUET_TARGET_AMX static void values(Work& w, const Dims& d, const Rows& src, int64_t groups,
                                     LinePrefetch* pf, int64_t lines_per_load) {
    const int64_t o_stride = w.rank_pad * 4;
    for (int64_t h0 = 0; h0 < d.heads_pad; h0 += 16) {
      const uint32_t* pt = w.pt + h0 / 16 * kGroups * 2 * kTileWords;
      for (int64_t c0 = 0; c0 < d.rank; c0 += 64) {
        const bool two = c0 + 32 < d.rank;
        float* o = w.o + h0 * w.rank_pad + c0;
        _tile_loadd(0, o, o_stride);
        _tile_loadd(1, o + 16, o_stride);
        if (two) {
          _tile_loadd(2, o + 32, o_stride);
          _tile_loadd(3, o + 48, o_stride);
        }
        for (int64_t g = 0; g < groups; ++g) {
          const bool tail = g >= src.full_groups && src.copy == nullptr;
          const char* v = tail ? reinterpret_cast<const char*>(w.tail) : src.keys(g);
          const int64_t v_stride = tail ? d.rank * 2 : src.stride;
          v += c0 * 2;
          _tile_loadd(4, pt + g * 2 * kTileWords, 64);
          _tile_loadd(5, pt + (g * 2 + 1) * kTileWords, 64);
          _tile_loadd(6, v, v_stride);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          if (two) {
            _tile_loadd(6, v + 64, v_stride);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 5, 6);
          }
          prefetch_n(pf, lines_per_load);
        }
        _tile_stored(0, o, o_stride);
        _tile_stored(1, o + 16, o_stride);
        if (two) {
          _tile_stored(2, o + 32, o_stride);
          _tile_stored(3, o + 48, o_stride);
        }
      }
    }
  }

  // The next chunk's lines are spread over the tile loads of this one, half over each product,
  // so the rows stream from memory while the tile unit works instead of in one burst after it.
  // The tiles are configured and released around each chunk: a thread holds no tile state
  // between calls (cpu_features.cpp asked Linux for it once, for the process).
  DUET_TARGET_AMX static void chunk(Work& w, const Dims& d, const bf16_t* const* rows,
                                    int64_t n_len, float scale, LinePrefetch* pf) {
    configure_full_tiles(7);
    const int64_t groups = ceil_div(n_len, 16), full_groups = n_len / 16;
    Rows src{rows, nullptr, d.width * 2, full_groups};
    if (!d.keys_in_place) {
      copy_keys(w, d, rows, n_len);
      src.copy = w.k;
    } else if (full_groups < groups) {
      copy_tail(w, d, rows, full_groups, n_len);
    }
    const int64_t head_blocks = d.heads_pad / 16, lines = pf->end - pf->next;
    const int64_t score_loads = head_blocks * groups * (d.width / 32);
    const int64_t value_loads = head_blocks * ceil_div(d.rank, 64) * groups;
    scores(w, d, src, groups, pf, ceil_div(lines, 2 * score_loads));
    softmax_heads<4>(w.s, d.heads_pad, n_len, scale, w.m, w.l, w.alpha,
                     StoreWords{w.pw, d.heads_pad});
    prepare_values(w, d, n_len, groups);
    values(w, d, src, groups, pf, ceil_div(pf->end - pf->next, value_loads));
    _tile_release();
  }

  template <typename U>
  static void finish(const Work& w, const Dims& d, U* out, float* lse) {
    finish_rows(w.o, w.rank_pad, w.m, w.l, d, &kEvenOddColumns, out, lse);
  }
};

}  // namespace mla
}  // namespace duet

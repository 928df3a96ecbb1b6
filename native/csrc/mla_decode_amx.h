// The AMX path of MLA decode (mla_decode.cpp), for CPUs with AMX-BF16 tiles: the two products of
// a chunk run on the tile unit, everything else as in Bf16Path (the query's pairs, the value
// pairs, the online softmax, the merge). With vdpbf16ps the chunk is compute-bound (about 0.12
// TFLOP/s a core here against a tile unit measured at 3.2); with tiles the two products are
// cheap and the rest of the chunk's work (value pairs, softmax, P transposes, O's tile loads
// and stores) now costs more than streaming its rows.
//
// NOTE: layouts (tiles are 16 rows x 64 bytes; one 32-bit word = one bf16 pair).
//   S^T = K . Q     per 16-row group and 16-head block: A = 16 cache rows x 32 values (in place,
//                   stride W * 2 bytes, or Bf16Path's contiguous copy), B = 16 of the query's
//                   pairs x 16 heads (Bf16Path's q [wp][heads_pad]); C is stored as S rows.
//   O += P . V      per 16-head block and 16-column block: A = 16 heads x 32 rows of p (pt, the
//                   16 x 16 word transposes of Bf16Path's p pairs), B = 16 row pairs x 16 columns
//                   (Bf16Path's value pairs, column order as theirs); C is O, loaded and stored.
// Taken for W and L multiples of 32 (DeepSeek's 576 and 512); other shapes run Bf16Path.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "amx.h"
#include "mla_decode_paths.h"

namespace duet {
namespace mla {

struct AmxPath {
  static constexpr bool kAvx512 = true;
  static constexpr int64_t kPairs = kChunk / 2;  // row pairs of a chunk (pt's row length)

  struct Work : Bf16Path::Work {
    uint32_t* pt;  // [heads_pad][kPairs]: p transposed, heads as rows
  };

  static Work carve(Arena& a, const Dims& d) {
    Work w;
    static_cast<Bf16Path::Work&>(w) = Bf16Path::carve(a, d);
    w.pt = a.take<uint32_t>(d.heads_pad * kPairs);
    return w;
  }

  static void begin(Work& w, const Dims& d, const bf16_t* q, int64_t head_stride) {
    Bf16Path::begin(w, d, q, head_stride);
  }

  // S[r][h] for r < round_up(n_len, 16): tile 0 = C, 2 = rows, 3 = query pairs.
  DUET_TARGET_AMX static void scores(Work& w, const Dims& d, const bf16_t* const* rows,
                                     int64_t n_len, LinePrefetch* pf) {
    const int64_t k_steps = d.width / 32;
    const int64_t q_stride = d.heads_pad * 4, s_stride = d.heads_pad * 4;
    for (int64_t r0 = 0; r0 < n_len; r0 += 16) {
      const char* a;
      int64_t a_stride;
      if (d.keys_in_place) {
        a = reinterpret_cast<const char*>(rows[r0]);
        a_stride = d.width * 2;
      } else {
        a = reinterpret_cast<const char*>(w.k + r0 * w.row_words);
        a_stride = w.row_words * 4;
      }
      for (int64_t h0 = 0; h0 < d.heads_pad; h0 += 16) {
        _tile_zero(0);
        for (int64_t kk = 0; kk < k_steps; ++kk) {
          _tile_loadd(2, a + kk * 64, a_stride);
          _tile_loadd(3, w.q + kk * 16 * d.heads_pad + h0, q_stride);
          _tile_dpbf16ps(0, 2, 3);
          prefetch_one(pf);
          prefetch_one(pf);
        }
        _tile_stored(0, w.s + r0 * d.heads_pad + h0, s_stride);
      }
    }
  }

  // pt = p transposed (pairs past the chunk's zeroed), value pairs past it zeroed, O *= alpha.
  DUET_TARGET_AMX static void prepare_values(Work& w, const Dims& d, int64_t n_len) {
    const int64_t pairs = ceil_div(n_len, 2), pair_blocks = ceil_div(n_len, 32);
    __m512i t[16];
    for (int64_t h0 = 0; h0 < d.heads_pad; h0 += 16) {
      for (int64_t b = 0; b < pair_blocks; ++b) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t pair = 16 * b + i;
          t[i] = pair < pairs ? _mm512_loadu_si512(w.p + pair * d.heads_pad + h0)
                              : _mm512_setzero_si512();
        }
        transpose16x16(t);
        for (int64_t h = 0; h < 16; ++h) {
          _mm512_storeu_si512(w.pt + (h0 + h) * kPairs + 16 * b, t[h]);
        }
      }
    }
    for (int64_t pair = pairs; pair < 16 * pair_blocks; ++pair) {
      std::memset(w.v + pair * w.rank_pad, 0, w.rank_pad * sizeof(uint32_t));
    }
    for (int64_t h = 0; h < d.heads_pad; ++h) {
      const __m512 a = _mm512_set1_ps(w.alpha[h]);
      float* o = w.o + h * w.rank_pad;
      for (int64_t c = 0; c < w.rank_pad; c += 16) {
        _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), a));
      }
    }
  }

  // O += P V: tile 0 = O, 1 = value pairs, 4.. = the chunk's p (at most 4 blocks of 32 rows).
  DUET_TARGET_AMX static void values(Work& w, const Dims& d, int64_t n_len, LinePrefetch* pf) {
    const int64_t pair_blocks = ceil_div(n_len, 32);
    const int64_t o_stride = w.rank_pad * 4, v_stride = w.rank_pad * 4, pt_stride = kPairs * 4;
    for (int64_t h0 = 0; h0 < d.heads_pad; h0 += 16) {
      const uint32_t* pt = w.pt + h0 * kPairs;
      _tile_loadd(4, pt, pt_stride);
      if (pair_blocks > 1) _tile_loadd(5, pt + 16, pt_stride);
      if (pair_blocks > 2) _tile_loadd(6, pt + 32, pt_stride);
      if (pair_blocks > 3) _tile_loadd(7, pt + 48, pt_stride);
      for (int64_t c0 = 0; c0 < w.rank_pad; c0 += 16) {
        float* o = w.o + h0 * w.rank_pad + c0;
        const uint32_t* v = w.v + c0;
        _tile_loadd(0, o, o_stride);
        _tile_loadd(1, v, v_stride);
        _tile_dpbf16ps(0, 4, 1);
        if (pair_blocks > 1) {
          _tile_loadd(1, v + 16 * w.rank_pad, v_stride);
          _tile_dpbf16ps(0, 5, 1);
        }
        if (pair_blocks > 2) {
          _tile_loadd(1, v + 32 * w.rank_pad, v_stride);
          _tile_dpbf16ps(0, 6, 1);
        }
        if (pair_blocks > 3) {
          _tile_loadd(1, v + 48 * w.rank_pad, v_stride);
          _tile_dpbf16ps(0, 7, 1);
        }
        _tile_stored(0, o, o_stride);
        prefetch_one(pf);
        prefetch_one(pf);
      }
    }
  }

  // The tiles are configured and released around each chunk: a thread holds no tile state
  // between calls (cpu_features.cpp asked Linux for it once, for the process).
  DUET_TARGET_AMX static void chunk(Work& w, const Dims& d, const bf16_t* const* rows,
                                    int64_t n_len, float scale, LinePrefetch* pf) {
    configure_full_tiles(8);
    if (d.keys_in_place) {
      Bf16Path::pack_values(w, d, rows, n_len);
    } else {
      Bf16Path::gather(w, d, rows, n_len);
    }
    scores(w, d, rows, n_len, pf);
    Bf16Path::softmax(w, d, n_len, scale);
    prepare_values(w, d, n_len);
    values(w, d, n_len, pf);
    _tile_release();
  }

  template <typename U>
  static void finish(const Work& w, const Dims& d, U* out, float* lse) {
    Bf16Path::finish(w, d, out, lse);
  }
};

}  // namespace mla
}  // namespace duet

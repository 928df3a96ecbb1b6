// Counter-based sampling: the exponential race over a batch of rows in one call, and the uniforms
// it is built from. Twin of native/reference_sampling.py (bit for bit: tokens, uniforms, E).
//
// NOTE: the random stream. A request's random numbers are a pure function of (seed, draw, index):
//   key(seed, draw) = mix64(mix64(seed ^ kSeedSalt) ^ draw)         once per row
//   bits            = mix64(key + index * kGolden)                  splitmix64's output #index
//   U               = (2 * (bits >> 41) + 1) * 2^-24                23 bits, exact fp32, in (0, 1)
//   E               = -log(U), the Cephes logf polynomial in fp32
//   token           = the first v maximizing probs[v] / E_v, among positive ratios (else -1)
// with mix64 the splitmix64 finalizer (Stafford's variant 13) and all integer arithmetic mod 2^64.
// probs[v] / E_v with E_v ~ Exp(1) independent is the exponential race: the winner is v with
// probability probs[v] / sum(probs) (torch.multinomial draws one sample the same way). The race
// reads indices [0, V); other indices (negative ones, by convention) are free for other uses of
// the same (seed, draw), e.g. the acceptance test of a speculative token (`random_uniform`).
//
// NOTE: exactness. Every fp32 step is one IEEE-rounded +, *, / or an exact one (frexp, the
// int -> float of a 24-bit integer, negation), in the same order as the torch twin, and never a
// fused multiply-add: the AVX-512 path uses the explicitly rounded *_round_ps intrinsics (GCC
// would contract plain _mm512_mul_ps + _mm512_add_ps into vfmadd), the AVX2 path is compiled for
// AVX2 without FMA, the portable path with fp-contract off. So every ISA and the twin give the
// same E bits, hence the same tokens.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "vec.h"

namespace py = pybind11;

namespace duet {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;    // splitmix64's Weyl increment
constexpr uint64_t kSeedSalt = 0x2545f4914f6cdd1dull;  // so that seed 0 does not key with 0
constexpr uint64_t kMix1 = 0xbf58476d1ce4e5b9ull;
constexpr uint64_t kMix2 = 0x94d049bb133111ebull;
constexpr int kUniformShift = 41;  // the top 23 bits make U
constexpr int64_t kChunk = 8192;   // tokens per task: one row of a large vocabulary spans threads

// The logf constants as torch holds them: the decimal read as a double, then rounded to fp32.
#define DUET_F32(x) static_cast<float>(x)
const float kSqrtHalf = DUET_F32(0.707106781186547524);
const float kLogPoly[9] = {
    DUET_F32(7.0376836292e-2),  DUET_F32(-1.1514610310e-1), DUET_F32(1.1676998740e-1),
    DUET_F32(-1.2420140846e-1), DUET_F32(1.4249322787e-1),  DUET_F32(-1.6668057665e-1),
    DUET_F32(2.0000714765e-1),  DUET_F32(-2.4999993993e-1), DUET_F32(3.3333331174e-1)};
const float kLn2Lo = DUET_F32(-2.12194440e-4);
const float kLn2Hi = DUET_F32(0.693359375);
const float kTwoPowMinus24 = DUET_F32(5.9604644775390625e-08);
#undef DUET_F32

// The portable path's fp32 steps stay separate roundings on CPUs whose baseline has FMA too.
#define DUET_NO_CONTRACT __attribute__((optimize("fp-contract=off")))

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

inline uint64_t row_key(int64_t seed, int64_t draw) {
  return mix64(mix64(static_cast<uint64_t>(seed) ^ kSeedSalt) ^ static_cast<uint64_t>(draw));
}

inline float uniform_of(uint64_t key, int64_t index) {
  const uint64_t bits = mix64(key + static_cast<uint64_t>(index) * kGolden);
  return static_cast<float>(2 * static_cast<int32_t>(bits >> kUniformShift) + 1) * kTwoPowMinus24;
}

// -log(u) for u in (0, 1): u = m 2^e, m in [sqrt(1/2), sqrt(2)), log(u) = e ln2 + log(1 + x).
DUET_NO_CONTRACT inline float neg_log(float u) {
  // frexp from the bits (u is a normal number): m in [0.5, 1), u = m 2^e.
  uint32_t bits;
  std::memcpy(&bits, &u, sizeof(bits));
  float e = static_cast<float>(static_cast<int32_t>((bits >> 23) & 0xff) - 126);
  bits = (bits & 0x807fffffu) | 0x3f000000u;
  float m;
  std::memcpy(&m, &bits, sizeof(m));
  float x;
  if (m < kSqrtHalf) {
    e = e - 1.0f;
    x = (m + m) - 1.0f;
  } else {
    x = m - 1.0f;
  }
  const float z = x * x;
  float y = kLogPoly[0];
  for (int i = 1; i < 9; ++i) y = y * x + kLogPoly[i];
  y = (y * x) * z;
  y = y + kLn2Lo * e;
  y = y - 0.5f * z;
  float r = x + y;
  r = r + kLn2Hi * e;
  return -r;
}

struct Best {
  float ratio = 0.0f;  // only a positive ratio wins
  int64_t index = -1;
};

DUET_NO_CONTRACT Best race_portable(const float* probs, uint64_t key, int64_t begin,
                                     int64_t end) {
  Best best;
  for (int64_t v = begin; v < end; ++v) {
    const float ratio = probs[v] / neg_log(uniform_of(key, v));
    if (ratio > best.ratio) best = {ratio, v};
  }
  return best;
}

DUET_NO_CONTRACT void exponentials_portable(uint64_t key, int64_t begin, int64_t end, float* out) {
  for (int64_t v = begin; v < end; ++v) out[v] = neg_log(uniform_of(key, v));
}

// ---- AVX-512: 16 tokens a step (two 8-lane halves of 64-bit hashes) ----------------------------

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

DUET_TARGET_AVX512 inline __m512i mix64x8(__m512i z) {
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(kMix1)));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(kMix2)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// The Weyl state of tokens index .. index + 15 (lo: the first 8, hi: the next 8), and its step.
struct Weyl16 {
  __m512i lo, hi, step;
};

DUET_TARGET_AVX512 inline Weyl16 weyl_at(uint64_t key, int64_t index) {
  alignas(64) uint64_t lanes[16];
  for (int i = 0; i < 16; ++i) lanes[i] = key + static_cast<uint64_t>(index + i) * kGolden;
  return {_mm512_load_si512(lanes), _mm512_load_si512(lanes + 8),
          _mm512_set1_epi64(static_cast<int64_t>(16 * kGolden))};
}

// The 16 uniforms of the state, then the state advanced by 16 tokens.
DUET_TARGET_AVX512 inline __m512 next_uniforms(Weyl16* w) {
  const __m256i lo = _mm512_cvtepi64_epi32(_mm512_srli_epi64(mix64x8(w->lo), kUniformShift));
  const __m256i hi = _mm512_cvtepi64_epi32(_mm512_srli_epi64(mix64x8(w->hi), kUniformShift));
  w->lo = _mm512_add_epi64(w->lo, w->step);
  w->hi = _mm512_add_epi64(w->hi, w->step);
  __m512i odd = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  odd = _mm512_or_si512(_mm512_slli_epi32(odd, 1), _mm512_set1_epi32(1));
  return _mm512_mul_round_ps(_mm512_cvtepi32_ps(odd), _mm512_set1_ps(kTwoPowMinus24), kRound);
}

DUET_TARGET_AVX512 inline __m512 mul(__m512 a, __m512 b) {
  return _mm512_mul_round_ps(a, b, kRound);
}
DUET_TARGET_AVX512 inline __m512 add(__m512 a, __m512 b) {
  return _mm512_add_round_ps(a, b, kRound);
}

// neg_log on 16 lanes, step for step.
DUET_TARGET_AVX512 inline __m512 neg_log16(__m512 u) {
  // frexp: m in [0.5, 1) and e with u = m 2^e (getexp gives e - 1).
  const __m512 m = _mm512_getmant_ps(u, _MM_MANT_NORM_p5_1, _MM_MANT_SIGN_src);
  __m512 e = _mm512_add_ps(_mm512_getexp_ps(u), _mm512_set1_ps(1.0f));  // small integers: exact
  const __mmask16 low = _mm512_cmp_ps_mask(m, _mm512_set1_ps(kSqrtHalf), _CMP_LT_OQ);
  e = _mm512_mask_sub_ps(e, low, e, _mm512_set1_ps(1.0f));
  const __m512 mm = _mm512_mask_add_ps(m, low, m, m);  // exact
  const __m512 x = _mm512_sub_ps(mm, _mm512_set1_ps(1.0f));  // exact (Sterbenz)
  const __m512 z = mul(x, x);
  __m512 y = _mm512_set1_ps(kLogPoly[0]);
  for (int i = 1; i < 9; ++i) y = add(mul(y, x), _mm512_set1_ps(kLogPoly[i]));
  y = mul(mul(y, x), z);
  y = add(y, mul(_mm512_set1_ps(kLn2Lo), e));
  y = _mm512_sub_round_ps(y, mul(_mm512_set1_ps(0.5f), z), kRound);
  const __m512 r = add(add(x, y), mul(_mm512_set1_ps(kLn2Hi), e));
  return _mm512_sub_ps(_mm512_setzero_ps(), r);  // exact negation (r < 0)
}

DUET_TARGET_AVX512 Best race_avx512(const float* probs, uint64_t key, int64_t begin, int64_t end) {
  Weyl16 w = weyl_at(key, begin);
  __m512 best = _mm512_setzero_ps();
  __m512i best_index = _mm512_set1_epi32(-1);
  __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(begin)),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                     13, 14, 15));
  for (int64_t v = begin; v < end; v += 16) {
    const __mmask16 live = vec::mask16(end - v);
    const __m512 e = neg_log16(next_uniforms(&w));
    const __m512 ratio = _mm512_div_round_ps(_mm512_maskz_loadu_ps(live, probs + v), e, kRound);
    // Strict: a lane keeps its first maximum; a NaN ratio never wins.
    const __mmask16 wins = _mm512_mask_cmp_ps_mask(live, ratio, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, wins, ratio);
    best_index = _mm512_mask_mov_epi32(best_index, wins, index);
    index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
  }
  // The largest ratio, and the lowest index holding it (the first occurrence overall).
  const float top = _mm512_reduce_max_ps(best);
  if (!(top > 0.0f)) return {};
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const int32_t first =
      _mm512_mask_reduce_min_epi32(at_top, best_index);  // lanes at top all hold an index
  return {top, first};
}

DUET_TARGET_AVX512 void exponentials_avx512(uint64_t key, int64_t begin, int64_t end, float* out) {
  Weyl16 w = weyl_at(key, begin);
  for (int64_t v = begin; v < end; v += 16) {
    _mm512_mask_storeu_ps(out + v, vec::mask16(end - v), neg_log16(next_uniforms(&w)));
  }
}

// ---- AVX2: 8 tokens a step (two 4-lane halves of 64-bit hashes) -------------------------------
//
// Targeted at plain AVX2, without FMA, so the compiler cannot contract the polynomial's steps.
// AVX2 has no 64-bit multiply: lo * c + ((hi * c_lo + lo * c_hi) << 32) from 32-bit products.
#define DUET_TARGET_AVX2_NO_FMA __attribute__((target("avx2")))

DUET_TARGET_AVX2_NO_FMA inline __m256i mul64x4(__m256i a, uint64_t c) {
  const __m256i c_lo = _mm256_set1_epi64x(static_cast<int64_t>(c & 0xffffffffu));
  const __m256i c_hi = _mm256_set1_epi64x(static_cast<int64_t>(c >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), c_lo),
                                         _mm256_mul_epu32(a, c_hi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, c_lo), _mm256_slli_epi64(cross, 32));
}

DUET_TARGET_AVX2_NO_FMA inline __m256i mix64x4(__m256i z) {
  z = mul64x4(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), kMix1);
  z = mul64x4(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), kMix2);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

struct Weyl8 {
  __m256i lo, hi, step;
};

DUET_TARGET_AVX2_NO_FMA inline Weyl8 weyl8_at(uint64_t key, int64_t index) {
  alignas(32) uint64_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = key + static_cast<uint64_t>(index + i) * kGolden;
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(lanes)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes + 4)),
          _mm256_set1_epi64x(static_cast<int64_t>(8 * kGolden))};
}

DUET_TARGET_AVX2_NO_FMA inline __m256 next_uniforms8(Weyl8* w) {
  const __m256i lo = _mm256_srli_epi64(mix64x4(w->lo), kUniformShift);
  const __m256i hi = _mm256_srli_epi64(mix64x4(w->hi), kUniformShift);
  w->lo = _mm256_add_epi64(w->lo, w->step);
  w->hi = _mm256_add_epi64(w->hi, w->step);
  // The low 32 bits of the 8 lanes, in order: (lo0 lo1 hi0 hi1 | lo2 lo3 hi2 hi3), then sorted.
  const __m256 mixed = _mm256_shuffle_ps(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi),
                                         _MM_SHUFFLE(2, 0, 2, 0));
  __m256i k = _mm256_permute4x64_epi64(_mm256_castps_si256(mixed), _MM_SHUFFLE(3, 1, 2, 0));
  k = _mm256_or_si256(_mm256_slli_epi32(k, 1), _mm256_set1_epi32(1));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(k), _mm256_set1_ps(kTwoPowMinus24));
}

DUET_TARGET_AVX2_NO_FMA inline __m256 neg_log8(__m256 u) {
  const __m256i bits = _mm256_castps_si256(u);  // frexp from the bits, as neg_log
  const __m256i biased = _mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff));
  const __m256i exponent = _mm256_sub_epi32(biased, _mm256_set1_epi32(126));
  __m256 e = _mm256_cvtepi32_ps(exponent);
  const __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x807fffffu))),
                      _mm256_set1_epi32(0x3f000000)));
  const __m256 low = _mm256_cmp_ps(m, _mm256_set1_ps(kSqrtHalf), _CMP_LT_OQ);
  const __m256 one = _mm256_set1_ps(1.0f);
  e = _mm256_sub_ps(e, _mm256_and_ps(low, one));
  const __m256 x = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(low, m)), one);  // exact
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(kLogPoly[0]);
  for (int i = 1; i < 9; ++i) y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(kLogPoly[i]));
  y = _mm256_mul_ps(_mm256_mul_ps(y, x), z);
  y = _mm256_add_ps(y, _mm256_mul_ps(_mm256_set1_ps(kLn2Lo), e));
  y = _mm256_sub_ps(y, _mm256_mul_ps(_mm256_set1_ps(0.5f), z));
  const __m256 r = _mm256_add_ps(_mm256_add_ps(x, y), _mm256_mul_ps(_mm256_set1_ps(kLn2Hi), e));
  return _mm256_sub_ps(_mm256_setzero_ps(), r);
}

// Lanes [0, n) of 8 set (all for n >= 8).
DUET_TARGET_AVX2_NO_FMA inline __m256i live8(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, 8))),
                            lane);
}

DUET_TARGET_AVX2_NO_FMA Best race_avx2(const float* probs, uint64_t key, int64_t begin,
                                       int64_t end) {
  Weyl8 w = weyl8_at(key, begin);
  __m256 best = _mm256_setzero_ps();
  __m256i best_index = _mm256_set1_epi32(-1);
  __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(begin)),
                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t v = begin; v < end; v += 8) {
    const __m256i live = live8(end - v);
    const __m256 e = neg_log8(next_uniforms8(&w));
    const __m256 ratio = _mm256_div_ps(_mm256_maskload_ps(probs + v, live), e);
    const __m256 wins =
        _mm256_and_ps(_mm256_castsi256_ps(live), _mm256_cmp_ps(ratio, best, _CMP_GT_OQ));
    best = _mm256_blendv_ps(best, ratio, wins);
    best_index = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_index),
                                                      _mm256_castsi256_ps(index), wins));
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  }
  alignas(32) float ratios[8];
  alignas(32) int32_t ids[8];
  _mm256_store_ps(ratios, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ids), best_index);
  Best out;
  for (int i = 0; i < 8; ++i) {  // the largest ratio, then the lowest index holding it
    if (ratios[i] > out.ratio || (ratios[i] == out.ratio && out.index >= 0 && ids[i] < out.index)) {
      out = {ratios[i], ids[i]};
    }
  }
  return out;
}

DUET_TARGET_AVX2_NO_FMA void exponentials_avx2(uint64_t key, int64_t begin, int64_t end,
                                               float* out) {
  Weyl8 w = weyl8_at(key, begin);
  for (int64_t v = begin; v < end; v += 8) {
    _mm256_maskstore_ps(out + v, live8(end - v), neg_log8(next_uniforms8(&w)));
  }
}

// ---- batch drivers ----------------------------------------------------------------------------

// Calls f(row, begin, end) for every chunk of every row, in parallel when the batch is large
// enough to pay for a fork/join; chunk c of a row covers [c * kChunk, (c + 1) * kChunk).
template <typename F>
void for_each_chunk(int64_t rows, int64_t vocab, const F& f) {
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  parallel_tasks(rows * chunks, rows * vocab >= 4 * kChunk, [&](int64_t task) {
    const int64_t row = task / chunks, begin = (task % chunks) * kChunk;
    f(row, task, begin, std::min(vocab, begin + kChunk));
  });
}

void race_sample_impl(const float* probs, const int64_t* seeds, const int64_t* draws,
                      int64_t* tokens, int64_t rows, int64_t vocab) {
  const Isa isa = active_isa();
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<Best> partial(static_cast<size_t>(rows * chunks));
  for_each_chunk(rows, vocab, [&](int64_t row, int64_t task, int64_t begin, int64_t end) {
    const uint64_t key = row_key(seeds[row], draws[row]);
    const float* p = probs + row * vocab;
    if (isa >= Isa::kAvx512) {
      partial[task] = race_avx512(p, key, begin, end);
    } else if (isa >= Isa::kAvx2) {
      partial[task] = race_avx2(p, key, begin, end);
    } else {
      partial[task] = race_portable(p, key, begin, end);
    }
  });
  for (int64_t row = 0; row < rows; ++row) {
    Best best;
    for (int64_t c = 0; c < chunks; ++c) {  // chunks in token order: a tie keeps the lower index
      const Best& b = partial[row * chunks + c];
      if (b.ratio > best.ratio) best = b;
    }
    tokens[row] = best.index;  // -1: no positive ratio (all zero, negative or NaN)
  }
}

void check_rows(const char* op, int64_t rows, int64_t vocab) {
  if (rows < 0 || vocab < 1 || vocab > std::numeric_limits<int32_t>::max() - 16) {
    throw std::invalid_argument(std::string(op) + ": need rows >= 0 and 1 <= vocab < 2^31 - 16");
  }
}

}  // namespace

void register_sampling(py::module_& m) {
  m.def(
      "race_sample",
      [](uintptr_t probs, uintptr_t seeds, uintptr_t draws, uintptr_t tokens, int64_t rows,
         int64_t vocab, const std::vector<int>& tags) {
        check_dtypes("race_sample", tags,
                     {{"probs", DType::kFloat32}, {"seeds", DType::kInt64},
                      {"counters", DType::kInt64}, {"tokens", DType::kInt64}});
        check_rows("race_sample", rows, vocab);
        race_sample_impl(reinterpret_cast<const float*>(probs),
                         reinterpret_cast<const int64_t*>(seeds),
                         reinterpret_cast<const int64_t*>(draws),
                         reinterpret_cast<int64_t*>(tokens), rows, vocab);
      },
      py::call_guard<py::gil_scoped_release>(),
      "probs fp32 [R, V] contiguous, seeds, counters int64 [R] -> tokens int64 [R]: the first "
      "argmax of probs / E(seed, counter, v), -1 for a row with no positive ratio.");
  m.def(
      "race_exponentials",
      [](uintptr_t seeds, uintptr_t draws, uintptr_t out, int64_t rows, int64_t vocab,
         const std::vector<int>& tags) {
        check_dtypes("race_exponentials", tags,
                     {{"seeds", DType::kInt64}, {"counters", DType::kInt64},
                      {"out", DType::kFloat32}});
        check_rows("race_exponentials", rows, vocab);
        const auto* s = reinterpret_cast<const int64_t*>(seeds);
        const auto* d = reinterpret_cast<const int64_t*>(draws);
        auto* o = reinterpret_cast<float*>(out);
        const Isa isa = active_isa();
        for_each_chunk(rows, vocab, [&](int64_t row, int64_t, int64_t begin, int64_t end) {
          const uint64_t key = row_key(s[row], d[row]);
          float* row_out = o + row * vocab;
          if (isa >= Isa::kAvx512) {
            exponentials_avx512(key, begin, end, row_out);
          } else if (isa >= Isa::kAvx2) {
            exponentials_avx2(key, begin, end, row_out);
          } else {
            exponentials_portable(key, begin, end, row_out);
          }
        });
      },
      py::call_guard<py::gil_scoped_release>(),
      "seeds, counters int64 [R] -> out fp32 [R, V]: the race's E(seed, counter, v).");
  m.def(
      "random_uniform",
      [](uintptr_t seeds, uintptr_t draws, uintptr_t out, int64_t rows, int64_t index,
         const std::vector<int>& tags) {
        check_dtypes("random_uniform", tags,
                     {{"seeds", DType::kInt64}, {"counters", DType::kInt64},
                      {"out", DType::kFloat32}});
        check_rows("random_uniform", rows, 1);
        const auto* s = reinterpret_cast<const int64_t*>(seeds);
        const auto* d = reinterpret_cast<const int64_t*>(draws);
        auto* o = reinterpret_cast<float*>(out);
        for (int64_t r = 0; r < rows; ++r) o[r] = uniform_of(row_key(s[r], d[r]), index);
      },
      "seeds, counters int64 [R], index -> out fp32 [R]: U(seed, counter, index) in (0, 1).");
}

}  // namespace duet

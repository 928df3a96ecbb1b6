// Helpers shared by the attention kernels (extend_attention.cpp, mla_decode.cpp): per-thread
// scratch and the 16x16 32-bit transpose; bf16 conversion, lane masks, loads / stores, exp and
// the VNNI pair interleave are vec.h's.
// Every AVX-512 helper carries DUET_TARGET_AVX512, so callers need that target or a superset.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "common.h"
#include "vec.h"

namespace duet {
namespace attn {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Per-thread scratch that outlives a call: OpenMP threads persist, so after the first call a
// kernel neither allocates nor page-faults. `slot` separates buffers that are alive together
// (the calling thread is also a worker of the parallel region).
inline char* thread_scratch(int slot, size_t bytes) {
  struct Buffer {
    char* data = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffers[2];
  Buffer& b = buffers[slot];
  if (b.size < bytes) {
    std::free(b.data);
    b.size = static_cast<size_t>(round_up(static_cast<int64_t>(bytes), 4096));
    b.data = static_cast<char*>(std::aligned_alloc(64, b.size));
    if (b.data == nullptr) throw std::bad_alloc();
  }
  return b.data;
}

// Carves 64-byte aligned arrays out of one scratch buffer. With a null base it only adds up the
// sizes: run a layout once that way, then allocate used() bytes and run it again for real.
class Arena {
 public:
  explicit Arena(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += round_up(count * static_cast<int64_t>(sizeof(T)), 64);
    return p;
  }
  int64_t used() const { return offset_; }

 private:
  char* base_;
  int64_t offset_ = 0;
};

// Bytes one Arena::take<T>(count) uses.
template <typename T>
inline int64_t arena_bytes(int64_t count) {
  return round_up(count * static_cast<int64_t>(sizeof(T)), 64);
}

// ---- AVX-512 ---------------------------------------------------------------------------------

// In-place transpose of a 16x16 matrix of 32-bit elements held one row per register.
DUET_TARGET_AVX512 inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + j], 128-bit lane L = column 4L + j of rows 4i .. 4i + 3.
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i x1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    r[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
}

}  // namespace attn
}  // namespace duet

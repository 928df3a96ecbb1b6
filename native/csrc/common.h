// Shared helpers of the CPU kernels: dtype tags, ISA target attributes, and the one place threads
// are used (OpenMP; the count is set through runtime.cpp). Element and vector helpers (bf16
// conversion, lane masks, exp) are in vec.h.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace duet {

// Element type tags passed from Python (native/ops.py) with every raw pointer.
enum class DType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kInt8 = 5,  // INT8 W8A8 packed weights (gemm_int8.cpp)
  kFloat8E4M3 = 6,  // FP8 e4m3fn packed weights (gemm_fp8.cpp)
  kUInt8 = 7,  // raw bytes (checksum.cpp)
};

using bf16_t = uint16_t;

inline const char* dtype_name(int tag) {
  switch (tag) {
    case 0: return "float32";
    case 1: return "bfloat16";
    case 2: return "float16";
    case 3: return "int32";
    case 4: return "int64";
    case 5: return "int8";
    case 6: return "float8_e4m3fn";
    case 7: return "uint8";
    default: return "a dtype the kernels do not know";
  }
}

// A binding's raw pointers come with their tensors' dtype tags (native/_tags.py), one per
// pointer, in the order of `expected` ({argument name, dtype}): a wrapper that hands over the
// wrong tensor gets this error, not memory read as the wrong type.
inline void check_dtypes(const char* op, const std::vector<int>& tags,
                         std::initializer_list<std::pair<const char*, DType>> expected) {
  if (tags.size() != expected.size()) {
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(tags.size()) +
                                " dtype tags for " + std::to_string(expected.size()) + " tensors");
  }
  size_t i = 0;
  for (const auto& [name, want] : expected) {
    if (tags[i] != static_cast<int>(want)) {
      throw std::invalid_argument(std::string(op) + ": " + name + " is " + dtype_name(tags[i]) +
                                  ", expected " + dtype_name(static_cast<int>(want)));
    }
    ++i;
  }
}

// One tag against the dtype it must be, for bindings that take tags one by one.
inline void check_dtype(const char* op, int tag, DType want, const char* name) {
  if (tag != static_cast<int>(want)) {
    throw std::invalid_argument(std::string(op) + ": " + name + " is " + dtype_name(tag) +
                                ", expected " + dtype_name(static_cast<int>(want)));
  }
}

// A tensor from Python: (data pointer, DType tag, number of elements it spans).
using TensorArg = std::tuple<uintptr_t, int, int64_t>;

// The tensor's pointer as T*, once its dtype is `want`, it spans at least `needed` elements
// and it is aligned for T.
template <typename T>
T* checked_tensor(const char* op, const TensorArg& t, DType want, int64_t needed,
                  const char* name) {
  const auto [ptr, dtype, numel] = t;
  check_dtype(op, dtype, want, name);
  if (numel < needed) {
    throw std::invalid_argument(std::string(op) + ": " + name + " holds " +
                                std::to_string(numel) + " elements, the sizes need " +
                                std::to_string(needed));
  }
  if (ptr % alignof(T) != 0) {
    throw std::invalid_argument(std::string(op) + ": " + name + " is misaligned");
  }
  return reinterpret_cast<T*>(ptr);
}

// Per-function ISA targets: one binary carries every path and runtime dispatch picks one.
#define DUET_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DUET_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define DUET_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c")))

inline int num_threads() { return omp_get_max_threads(); }

// Calls f(begin, end) on contiguous, near-equal slices of [0, n), one per thread.
// Falls back to one inline call when n is below `grain` (a fork/join costs more than the work).
template <typename F>
inline void parallel_for(int64_t n, F&& f, int64_t grain = 1) {
  const int threads = static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, n / std::max<int64_t>(grain, 1))));
  if (threads <= 1 || n <= 1) {
    f(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    const int64_t chunk = (n + threads - 1) / threads;
    const int64_t begin = std::min<int64_t>(n, tid * chunk);
    const int64_t end = std::min<int64_t>(n, begin + chunk);
    if (begin < end) f(begin, end);
  }
}

// Calls f(i) for each task i in [0, num_tasks), handed out dynamically one at a time (the
// cores are shared with other work, so static slices would wait on the slowest); inline when
// `parallel` is false, there is one task or one thread.
template <typename F>
inline void parallel_tasks(int64_t num_tasks, bool parallel, const F& f) {
  if (!parallel || num_tasks <= 1 || num_threads() <= 1) {
    for (int64_t i = 0; i < num_tasks; ++i) f(i);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < num_tasks; ++i) f(i);
}

// A per-thread buffer that grows and never shrinks (a decode step must not allocate).
template <typename T>
T* thread_buffer(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(static_cast<size_t>(size));
  return buffer.data();
}

// The rows of each of the near-equal chunks `m` rows are cut into (at most `max_rows` each),
// rounded up to whole `tile`-row tiles: 241 rows -> 2 chunks of 126, not 240 + a ragged 1.
inline int64_t equal_chunk_rows(int64_t m, int64_t max_rows, int64_t tile) {
  const int64_t num_chunks = (m + max_rows - 1) / max_rows;
  return ((m + num_chunks - 1) / num_chunks + tile - 1) / tile * tile;
}

}  // namespace duet

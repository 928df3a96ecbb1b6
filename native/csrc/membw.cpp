// Streaming-read bandwidth probe: the BW of the roofline (bench/roofline.py).
// Every thread reads its own slice of a large buffer (first touched by the same thread, so pages
// sit on its memory node) as 64-byte vectors folded into a few independent accumulators, which
// is all the arithmetic a memory-bound kernel can afford; the best of `repeats` passes is kept.
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "small_ops_simd.h"

namespace py = pybind11;

namespace duet {
namespace {

uint64_t read_portable(const uint64_t* p, int64_t words) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (int64_t i = 0; i + 4 <= words; i += 4) {
    a0 += p[i];
    a1 += p[i + 1];
    a2 += p[i + 2];
    a3 += p[i + 3];
  }
  return a0 ^ a1 ^ a2 ^ a3;
}

// words is a multiple of 32 (4 cache lines per iteration).
DUET_TARGET_AVX512 uint64_t read_avx512(const uint64_t* p, int64_t words) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < words; i += 32) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 8));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 16));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 24));
  }
  const __m512i s = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(s));
}

double stream_read_bandwidth(int64_t bytes, int repeats) {
  if (bytes < (1 << 20)) throw std::invalid_argument("stream_read_bandwidth: need >= 1 MiB");
  if (repeats < 1) throw std::invalid_argument("stream_read_bandwidth: repeats must be >= 1");
  const int threads = num_threads();
  // Each thread's slice is a whole number of 256-byte blocks (one AVX-512 iteration).
  const int64_t block_words = 32;
  const int64_t slice_words = (bytes / 8 / threads) / block_words * block_words;
  const int64_t words = slice_words * threads;
  auto* buf = static_cast<uint64_t*>(std::aligned_alloc(64, static_cast<size_t>(words) * 8));
  if (buf == nullptr) throw std::runtime_error("stream_read_bandwidth: allocation failed");
  const bool simd = active_isa() >= Isa::kAvx512;
  volatile uint64_t sink = 0;
#pragma omp parallel num_threads(threads)
  {
    uint64_t* p = buf + omp_get_thread_num() * slice_words;
    for (int64_t i = 0; i < slice_words; ++i) p[i] = static_cast<uint64_t>(i);
  }
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    uint64_t total = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(^ : total)
    {
      const uint64_t* p = buf + omp_get_thread_num() * slice_words;
      total ^= simd ? read_avx512(p, slice_words) : read_portable(p, slice_words);
    }
    const std::chrono::duration<double> secs = std::chrono::steady_clock::now() - start;
    sink = sink ^ total;
    best = std::max(best, static_cast<double>(words) * 8.0 / secs.count() / 1e9);
  }
  std::free(buf);
  return best;
}

}  // namespace

void register_membw(py::module_& m) {
  m.def("stream_read_bandwidth", &stream_read_bandwidth, py::arg("bytes"), py::arg("repeats") = 5,
        py::call_guard<py::gil_scoped_release>(),
        "Best streaming-read bandwidth in GB/s (1e9 B/s) over `repeats` passes of a `bytes` "
        "buffer read by all kernel threads.");
}

}  // namespace duet

// Streaming-read bandwidth probe: the BW of the roofline (bench/roofline.py).
// Every thread reads its own slice of a large buffer (first touched by the same thread, so pages
// sit on its memory node) as 64-byte vectors folded into a few independent accumulators, which
// is all the arithmetic a memory-bound kernel can afford; the best of `repeats` passes is kept.
// The same probe on a buffer that fits in L2 or L3 (several passes per sample) gives the cache
// roofs of cache-resident cases.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
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

constexpr size_t kHugePage = size_t{2} << 20;

// AnonHugePages of this process in bytes (transparent huge pages in use), -1 if unreadable.
int64_t anon_huge_page_bytes() {
  std::ifstream rollup("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(rollup, line)) {
    if (line.rfind("AnonHugePages:", 0) == 0) return std::stoll(line.substr(14)) * 1024;
  }
  return -1;
}

// NOTE: THP is opt-in on many hosts (enabled = [madvise]): a 2 MiB-aligned buffer advised with
// MADV_HUGEPAGE before its first touch gets huge pages, so a stream does not pay a TLB miss per
// 4 KiB page. The 4 KiB comparison advises MADV_NOHUGEPAGE, so it stays 4 KiB under THP=always.
uint64_t* alloc_probe_buffer(size_t bytes, bool huge_pages) {
  void* buf = nullptr;
  if (posix_memalign(&buf, kHugePage, bytes) != 0) return nullptr;
#ifdef MADV_HUGEPAGE
  madvise(buf, bytes, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);  // advice: failure is fine
#endif
  return static_cast<uint64_t*>(buf);
}

// Best read rate in GB/s over `repeats` timed samples, each `passes` reads of the buffer by all
// kernel threads (several passes make a cache-resident buffer's sample long enough to time), and
// the bytes of the buffer backed by huge pages (-1 if unknown).
std::pair<double, int64_t> stream_read_probe(int64_t bytes, int repeats, bool huge_pages,
                                             int passes) {
  if (bytes < (1 << 20)) throw std::invalid_argument("stream_read_bandwidth: need >= 1 MiB");
  if (repeats < 1) throw std::invalid_argument("stream_read_bandwidth: repeats must be >= 1");
  if (passes < 1) throw std::invalid_argument("stream_read_probe: passes must be >= 1");
  const int threads = num_threads();
  // Each thread's slice is a whole number of 256-byte blocks (one AVX-512 iteration), and of
  // huge pages when it is large enough, so each thread first-touches its own huge pages.
  const int64_t per_thread = bytes / threads;
  const int64_t block_bytes = huge_pages && per_thread >= int64_t{kHugePage} ? kHugePage : 256;
  const int64_t slice_words = per_thread / block_bytes * block_bytes / 8;
  const int64_t words = slice_words * threads;
  const size_t alloc_bytes =
      (static_cast<size_t>(words) * 8 + kHugePage - 1) / kHugePage * kHugePage;
  const int64_t huge_before = anon_huge_page_bytes();
  uint64_t* buf = alloc_probe_buffer(alloc_bytes, huge_pages);
  if (buf == nullptr) throw std::runtime_error("stream_read_bandwidth: allocation failed");
  const bool simd = active_isa() >= Isa::kAvx512;
  volatile uint64_t sink = 0;
#pragma omp parallel num_threads(threads)
  {
    uint64_t* p = buf + omp_get_thread_num() * slice_words;
    for (int64_t i = 0; i < slice_words; ++i) p[i] = static_cast<uint64_t>(i);
  }
  const int64_t huge_after = anon_huge_page_bytes();
  const int64_t huge_bytes =
      huge_before < 0 || huge_after < 0
          ? -1
          : std::min<int64_t>(std::max<int64_t>(huge_after - huge_before, 0), alloc_bytes);
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    uint64_t total = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(^ : total)
    {
      const uint64_t* p = buf + omp_get_thread_num() * slice_words;
      for (int pass = 0; pass < passes; ++pass) {
        // The buffer may have changed as far as the compiler knows: every pass is read again.
        __asm__ volatile("" ::: "memory");
        total ^= simd ? read_avx512(p, slice_words) : read_portable(p, slice_words);
      }
    }
    const std::chrono::duration<double> secs = std::chrono::steady_clock::now() - start;
    sink = sink ^ total;
    best = std::max(best, static_cast<double>(words) * 8.0 * passes / secs.count() / 1e9);
  }
  std::free(buf);
  return {best, huge_bytes};
}

double stream_read_bandwidth(int64_t bytes, int repeats) {
  return stream_read_probe(bytes, repeats, /*huge_pages=*/false, /*passes=*/1).first;
}

}  // namespace

void register_membw(py::module_& m) {
  m.def("stream_read_bandwidth", &stream_read_bandwidth, py::arg("bytes"), py::arg("repeats") = 5,
        py::call_guard<py::gil_scoped_release>(),
        "Best streaming-read bandwidth in GB/s (1e9 B/s) over `repeats` passes of a `bytes` "
        "buffer (4 KiB pages) read by all kernel threads.");
  m.def("stream_read_probe", &stream_read_probe, py::arg("bytes"), py::arg("repeats") = 5,
        py::arg("huge_pages") = true, py::arg("passes") = 1,
        py::call_guard<py::gil_scoped_release>(),
        "(GB/s, huge-page bytes): the best read rate over `repeats` samples, each `passes` reads "
        "of a `bytes` buffer by all kernel threads, on MADV_HUGEPAGE (or MADV_NOHUGEPAGE) "
        "memory first touched by the thread reading it; huge-page bytes is how much of the "
        "buffer the kernel backed with huge pages (AnonHugePages growth, -1 if unreadable).");
}

}  // namespace duet

// Checksum of a byte range, at memory speed: what a packed weight store (engine/weight_pack.py)
// verifies each tensor with when a process maps it, so a corrupt pack is refused every start
// without costing seconds (zlib's crc32 reads 1.5 GB/s here; this is bound by DRAM).
//
// Definition (native/reference.py `checksum` is the twin): the bytes, zero-padded to a multiple
// of 64, are rows of 8 little-endian uint64 lanes, cut into chunks of kChunkRows rows. Per chunk
// c and lane j, with n the chunk's rows, a = sum_k w[k][j] and b = sum_k (n - k) w[k][j]
// (Fletcher's two sums: b also sees the order). The result is
// sum_{c,j} (a * kMix + b) * (2 * (8c + j) + 1), all mod 2^64. Any change of one word changes the
// result (every factor is odd, so invertible mod 2^64).
#include <pybind11/pybind11.h>

#include <cstring>
#include <vector>

#include "common.h"
#include "cpu_features.h"

namespace py = pybind11;

namespace duet {
namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kChunkRows = 16384;  // 1 MiB a chunk: the unit of parallel work
constexpr uint64_t kMix = 0x9E3779B97F4A7C15ull;

struct LaneSums {
  uint64_t a[kLanes];
  uint64_t b[kLanes];
};

// The loop body, compiled once per ISA: plain 64-bit adds the compiler vectorizes.
#define DUET_CHECKSUM_ROWS                                    \
  uint64_t a[kLanes] = {0}, b[kLanes] = {0};                  \
  for (int64_t k = 0; k < rows; ++k) {                        \
    for (int64_t j = 0; j < kLanes; ++j) {                    \
      a[j] += w[k * kLanes + j];                              \
      b[j] += a[j];                                           \
    }                                                         \
  }                                                           \
  for (int64_t j = 0; j < kLanes; ++j) {                      \
    out->a[j] = a[j];                                         \
    out->b[j] = b[j];                                         \
  }

void rows_portable(const uint64_t* w, int64_t rows, LaneSums* out) { DUET_CHECKSUM_ROWS }

DUET_TARGET_AVX2 void rows_avx2(const uint64_t* w, int64_t rows, LaneSums* out) {
  DUET_CHECKSUM_ROWS
}

DUET_TARGET_AVX512 void rows_avx512(const uint64_t* w, int64_t rows, LaneSums* out) {
  DUET_CHECKSUM_ROWS
}
#undef DUET_CHECKSUM_ROWS

void chunk_sums(const uint8_t* data, int64_t nbytes, int64_t chunk, LaneSums* out) {
  const int64_t chunk_bytes = kChunkRows * kLanes * 8;
  const int64_t begin = chunk * chunk_bytes;
  const int64_t len = std::min(chunk_bytes, nbytes - begin);
  const int64_t whole_rows = len / (kLanes * 8);
  // Whole rows are read in place (memcpy-free: the mapping is 64-byte aligned or unaligned
  // loads are fine on x86); the ragged tail is copied into a zero-padded row.
  std::vector<uint64_t> tail;
  const int64_t tail_bytes = len - whole_rows * kLanes * 8;
  const Isa isa = active_isa();
  auto rows = isa >= Isa::kAvx512 ? rows_avx512 : isa >= Isa::kAvx2 ? rows_avx2 : rows_portable;
  LaneSums whole{};
  rows(reinterpret_cast<const uint64_t*>(data + begin), whole_rows, &whole);
  if (tail_bytes == 0) {
    *out = whole;
    return;
  }
  tail.assign(kLanes, 0);
  std::memcpy(tail.data(), data + begin + whole_rows * kLanes * 8, tail_bytes);
  LaneSums last{};
  rows(tail.data(), 1, &last);
  // Appending one row to Fletcher's sums: a' = a + t, b' = b + a' (b counts each earlier row
  // once more).
  for (int64_t j = 0; j < kLanes; ++j) {
    out->a[j] = whole.a[j] + last.a[j];
    out->b[j] = whole.b[j] + out->a[j];
  }
}

uint64_t checksum(const uint8_t* data, int64_t nbytes) {
  const int64_t chunk_bytes = kChunkRows * kLanes * 8;
  const int64_t chunks = (nbytes + chunk_bytes - 1) / chunk_bytes;
  std::vector<LaneSums> sums(static_cast<size_t>(chunks));
  parallel_for(chunks, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) chunk_sums(data, nbytes, c, &sums[c]);
  });
  uint64_t h = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const uint64_t lane = static_cast<uint64_t>(c * kLanes + j);
      h += (sums[c].a[j] * kMix + sums[c].b[j]) * (2 * lane + 1);
    }
  }
  return h;
}

}  // namespace

void register_checksum(py::module_& m) {
  m.def(
      "checksum",
      [](uintptr_t data, int data_tag, int64_t nbytes) {
        check_dtypes("checksum", {data_tag}, {{"data", DType::kUInt8}});
        if (nbytes < 0) throw std::invalid_argument("checksum: nbytes must be >= 0");
        py::gil_scoped_release release;
        return checksum(reinterpret_cast<const uint8_t*>(data), nbytes);
      },
      py::arg("data"), py::arg("data_tag"), py::arg("nbytes"),
      "Checksum of `nbytes` bytes at `data` (uint8); see checksum.cpp for the definition.");
}

}  // namespace duet

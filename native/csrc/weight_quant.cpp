// Weight conversions at load time, one pass each at memory speed (a full-depth model's int8
// weights took minutes of torch passes over fp32 copies):
// - dequantize_fp8_blocks: float8_e4m3fn [N, K] with fp32 scales per (b0 x b1) block -> fp32,
//   w = float(w_fp8) * scale_inv[n / b0][k / b1] (the same single fp32 multiply as the twin);
// - quantize_pack_int8_rows: float rows [n, K] (fp32 or bf16) -> per-row symmetric int8 written
//   straight into the packed layout of gemm_int8.h ([N/16][K/4][16][4], rows from `row_offset`
//   on), with the row's scale and its u8s8 compensation 128 * sum(q). The scale math is the
//   activation quantizer's (row_scales, quantize_one in gemm_int8_kernels.cpp): fp32 divisions,
//   round half to even. Twins: native/reference.py (dequantize_fp8_blocks,
//   quantize_pack_int8_rows).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "cpu_features.h"
#include "gemm_int8.h"
#include "vec.h"

namespace py = pybind11;

namespace duet {
namespace {

constexpr int64_t kPackRows = 16, kPackGroup = 4;

// Every e4m3fn byte as a float (exact): sign, 4 exponent bits (bias 7), 3 mantissa bits;
// exponent 0 is subnormal, S.1111.111 is NaN (no infinities).
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 0xF, mantissa = b & 7;
      float v = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)
                              : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 0xF && mantissa == 7) v = std::nanf("");
      value[b] = (b & 0x80) ? -v : v;
    }
  }
};
const E4m3Table kE4m3;

void dequantize_fp8(const uint8_t* w, const float* scale, int64_t n, int64_t k, int64_t b0,
                    int64_t b1, float* out) {
  const int64_t scale_cols = (k + b1 - 1) / b1;
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* s = scale + (r / b0) * scale_cols;
      const uint8_t* src = w + r * k;
      float* dst = out + r * k;
      for (int64_t block = 0; block < scale_cols; ++block) {
        const float block_scale = s[block];
        const int64_t end_col = std::min(k, (block + 1) * b1);
        for (int64_t c = block * b1; c < end_col; ++c) dst[c] = kE4m3.value[src[c]] * block_scale;
      }
    }
  }, 16);
}

// nearbyint for |x| <= 2^22 in the default rounding mode (half to even), without a libm call on
// the portable (SSE2, no FMA to fuse it with the multiply before) build: adding and subtracting
// 1.5 * 2^23 leaves x rounded to an integer. Here |x| <= 127 * (1 + 2^-23).
inline float round_half_even(float x) {
  return (x + 12582912.0f) - 12582912.0f;  // not folded: no -ffast-math (-fassociative-math)
}

// One row's absmax, scale and q; plain loops the compiler vectorizes, compiled once per ISA.
#define DUET_QUANTIZE_ROW(ROUND)                                                   \
  float absmax = 0.f;                                                              \
  for (int64_t c = 0; c < k; ++c) absmax = std::max(absmax, std::fabs(vec::to_f32(row[c]))); \
  const bool tiny = !(absmax >= kInt8MinAbsmax);                                   \
  const float inv = tiny ? 0.f : 127.f / absmax;                                   \
  int32_t sum = 0;                                                                 \
  for (int64_t c = 0; c < k; ++c) {                                                \
    const float v = ROUND(vec::to_f32(row[c]) * inv);                              \
    q[c] = static_cast<int8_t>(static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)))); \
    sum += q[c];                                                                   \
  }                                                                                \
  *scale = tiny ? 0.f : absmax / 127.f;                                            \
  return sum;

template <typename T>
int32_t quantize_row_portable(const T* row, int64_t k, int8_t* q, float* scale) {
  DUET_QUANTIZE_ROW(round_half_even)
}

template <typename T>
DUET_TARGET_AVX512 int32_t quantize_row_avx512(const T* row, int64_t k, int8_t* q, float* scale) {
  // vroundps here; the add-and-subtract rounding would be fused with the multiply (FMA)
  DUET_QUANTIZE_ROW(std::nearbyint)
}
#undef DUET_QUANTIZE_ROW

template <typename T>
void quantize_rows(const T* src, int64_t n, int64_t k, int64_t row_offset, int64_t k_groups,
                   int8_t* packed, float* scales, int32_t* comps) {
  const bool avx512 = active_isa() >= Isa::kAvx512;
  parallel_for(n, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> q(static_cast<size_t>(k_groups * kPackGroup), 0);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t dst_row = row_offset + r;
      const T* row = src + r * k;
      const int32_t sum = avx512 ? quantize_row_avx512(row, k, q.data(), &scales[dst_row])
                                 : quantize_row_portable(row, k, q.data(), &scales[dst_row]);
      const int64_t block = dst_row / kPackRows, lane = dst_row % kPackRows;
      int8_t* out = packed + (block * k_groups * kPackRows + lane) * kPackGroup;
      for (int64_t g = 0; g < k_groups; ++g) {
        std::memcpy(out + g * kPackRows * kPackGroup, q.data() + g * kPackGroup, kPackGroup);
      }
      comps[dst_row] = 128 * sum;
    }
  }, 4);
}

}  // namespace

void register_weight_quant(py::module_& m) {
  m.def(
      "dequantize_fp8_blocks",
      [](uintptr_t w, uintptr_t scale, int64_t n, int64_t k, int64_t b0, int64_t b1, uintptr_t out,
         const std::vector<int>& tags) {
        check_dtypes("dequantize_fp8_blocks", tags,
                     {{"w", DType::kFloat8E4M3}, {"scale_inv", DType::kFloat32},
                      {"out", DType::kFloat32}});
        if (n < 0 || k < 0 || b0 < 1 || b1 < 1) {
          throw std::invalid_argument("dequantize_fp8_blocks: bad sizes");
        }
        py::gil_scoped_release release;
        dequantize_fp8(reinterpret_cast<const uint8_t*>(w), reinterpret_cast<const float*>(scale),
                       n, k, b0, b1, reinterpret_cast<float*>(out));
      },
      "float32 [N, K] = e4m3 w [N, K] * scale_inv[n / b0][k / b1]");
  m.def(
      "quantize_pack_int8_rows",
      [](uintptr_t src, int64_t n, int64_t k, int64_t row_offset, int64_t k_groups,
         int64_t padded_rows, uintptr_t packed, uintptr_t scales, uintptr_t comps,
         const std::vector<int>& tags) {
        if (tags.size() != 4) throw std::invalid_argument("quantize_pack_int8_rows: 4 dtype tags");
        const DType src_type = tags[0] == static_cast<int>(DType::kBFloat16) ? DType::kBFloat16
                                                                             : DType::kFloat32;
        check_dtypes("quantize_pack_int8_rows", tags,
                     {{"weight", src_type}, {"packed", DType::kInt8}, {"scale", DType::kFloat32},
                      {"comp", DType::kInt32}});
        if (n < 0 || k < 0 || row_offset < 0 || row_offset + n > padded_rows ||
            k > k_groups * kPackGroup || padded_rows % kPackRows) {
          throw std::invalid_argument("quantize_pack_int8_rows: rows or columns out of range");
        }
        py::gil_scoped_release release;
        auto* p = reinterpret_cast<int8_t*>(packed);
        auto* s = reinterpret_cast<float*>(scales);
        auto* c = reinterpret_cast<int32_t*>(comps);
        if (src_type == DType::kBFloat16) {
          quantize_rows(reinterpret_cast<const bf16_t*>(src), n, k, row_offset, k_groups, p, s, c);
        } else {
          quantize_rows(reinterpret_cast<const float*>(src), n, k, row_offset, k_groups, p, s, c);
        }
      },
      "per-row int8 of float rows [n, K] into the packed int8 layout at row_offset");
}

}  // namespace duet

// quantize_pack_int4: float rows [N, K] (fp32 or bf16) -> the int4 layout of gemm_int4.h in one
// pass (the torch twin, reference_int4.quantize_weight_int4 then _int4_ops.pack_int4, made several
// passes and temporaries per matrix: 3x int8's load time). The same rule with the same fp32
// operations, so the same bytes: per (row, group), the value of largest magnitude (the first
// such, as torch.argmax takes it) e, scale = e / -8, q = clamp(round_half_even(w / scale), -8,
// 7), or 0 and scale 0 for an all-zero group; padding (K to whole groups, N to 16) holds q = 0.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "gemm_int4.h"
#include "vec.h"

namespace py = pybind11;

namespace duet {
namespace {

template <typename T>
void quantize_block(const T* w, int64_t n, int64_t k, int64_t group, int64_t num_groups,
                    int64_t block, uint8_t* packed, float* scales) {
  const int64_t padded = num_groups * group;
  std::vector<int8_t> q(static_cast<size_t>(kInt4BlockN * padded), 0);
  float* block_scales = scales + block * num_groups * kInt4BlockN;
  for (int64_t j = 0; j < kInt4BlockN; ++j) {
    const int64_t row = block * kInt4BlockN + j;
    for (int64_t g = 0; g < num_groups; ++g) {
      float scale = 0.f;
      if (row < n) {
        const int64_t begin = g * group, end = std::min(k, begin + group);
        float extreme = 0.f, best = -1.f;
        for (int64_t c = begin; c < end; ++c) {
          const float v = vec::to_f32(w[row * k + c]);
          if (std::fabs(v) > best) best = std::fabs(v), extreme = v;
        }
        scale = extreme / -8.0f;
        if (scale != 0.f) {
          for (int64_t c = begin; c < end; ++c) {
            const float r = std::nearbyint(vec::to_f32(w[row * k + c]) / scale);
            q[j * padded + c] = static_cast<int8_t>(std::min(7.f, std::max(-8.f, r)));
          }
        }
      }
      block_scales[g * kInt4BlockN + j] = scale;
    }
  }
  uint8_t* out = packed + block * int4_block_bytes(num_groups, group);
  for (int64_t kk = 0; kk < padded / 8; ++kk) {
    for (int64_t j = 0; j < kInt4BlockN; ++j) {
      for (int t = 0; t < 4; ++t) {
        const int lo = q[j * padded + 8 * kk + t] + 8, hi = q[j * padded + 8 * kk + 4 + t] + 8;
        out[(kk * kInt4BlockN + j) * 4 + t] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

}  // namespace

void register_weight_quant_int4(py::module_& m) {
  m.def(
      "quantize_pack_int4",
      [](uintptr_t src, int64_t n, int64_t k, int64_t group, uintptr_t packed, uintptr_t scales,
         const std::vector<int>& tags) {
        if (tags.size() != 3) throw std::invalid_argument("quantize_pack_int4: 3 dtype tags");
        const DType dtype = static_cast<DType>(tags[0]);
        if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) {
          throw std::invalid_argument("quantize_pack_int4: the weight must be fp32 or bf16");
        }
        check_dtype("quantize_pack_int4", tags[1], DType::kUInt8, "packed");
        check_dtype("quantize_pack_int4", tags[2], DType::kFloat32, "scales");
        if (n < 0 || k <= 0 || !int4_group_ok(group)) {
          throw std::invalid_argument("quantize_pack_int4: bad sizes or group");
        }
        const int64_t num_groups = int4_num_groups(k, group);
        const int64_t blocks = int4_num_blocks(n);
        auto* out = reinterpret_cast<uint8_t*>(packed);
        auto* s = reinterpret_cast<float*>(scales);
        py::gil_scoped_release release;
        parallel_for(blocks, [&](int64_t begin, int64_t end) {
          for (int64_t b = begin; b < end; ++b) {
            if (dtype == DType::kBFloat16) {
              quantize_block(reinterpret_cast<const bf16_t*>(src), n, k, group, num_groups, b,
                             out, s);
            } else {
              quantize_block(reinterpret_cast<const float*>(src), n, k, group, num_groups, b, out,
                             s);
            }
          }
        });
      },
      "float weight [N, K] (fp32 or bf16, contiguous) -> packed uint8 [ceil(N/16), Kp/8, 16, 4] "
      "and fp32 scales [ceil(N/16), Kp/group, 16] of gemm_int4.h, Q4_0's rule (see the file).");
}

}  // namespace duet

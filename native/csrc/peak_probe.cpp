// In-register peak rates of the instruction families the kernels are built on: the compute roofs
// of bench/roofline.py (a bf16 GEMM cannot beat the rate of vdpbf16ps on this CPU, whatever
// torch's matmul reaches).
//
// Every kernel thread runs `iterations` rounds of kAccumulators independent instructions on
// registers only: no loads or stores in the loop, so the rate is the execution ports' and not
// the caches'. kAccumulators independent chains cover latency x throughput of every x86 core we
// know (e.g. 4-cycle FMA x 2 ports = 8 in flight; vdpbf16ps 6 cycles x 2 on Zen 5); the
// accumulators are folded into a sink at the end so none of the work is dead. The best of
// `repeats` timed passes is kept (the first absorbs thread start-up and clock ramp).
//
// Dispatch is at run time on the active ISA (cpu_features.h, so DUET_ISA caps it as it caps
// the kernels): a family whose instruction the CPU (or the cap) lacks returns 0.
#include <pybind11/pybind11.h>

#include <chrono>
#include <stdexcept>
#include <string>

#include "amx.h"
#include "common.h"
#include "cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace duet {
namespace {

constexpr int kAccumulators = 12;

// NOTE: the empty asm marks the operands as changed every round, so the compiler can neither
// hoist nor fold the chain; it emits no instruction.
#if defined(__x86_64__)
DUET_TARGET_AVX512_BF16 float chains_bf16_dot(int64_t iterations) {
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  __m512bh b = (__m512bh)_mm512_set1_epi16(0x3a83);  // bf16 ~1e-3: sums stay finite
  for (int64_t it = 0; it < iterations; ++it) {
    __asm__ volatile("" : "+v"(a), "+v"(b));
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return _mm512_reduce_add_ps(sum);
}

DUET_TARGET_AVX512_BF16 float chains_int8_dot(int64_t iterations) {
  __m512i acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(1);  // u8
  __m512i b = _mm512_set1_epi8(3);  // s8; int32 sums wrap harmlessly
  for (int64_t it = 0; it < iterations; ++it) {
    __asm__ volatile("" : "+v"(a), "+v"(b));
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  }
  __m512i sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  return static_cast<float>(_mm512_reduce_add_epi32(sum));
}

DUET_TARGET_AVX512 float chains_fp32_fma_zmm(int64_t iterations) {
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-3f);
  for (int64_t it = 0; it < iterations; ++it) {
    __asm__ volatile("" : "+v"(a), "+v"(b));
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return _mm512_reduce_add_ps(sum);
}

// AMX-BF16: tdpbf16ps on 16 x 16 fp32 tiles (16 x 32 bf16 by 16 x 32): 4 accumulator tiles
// (the unit's latency over its throughput) from one A and one B tile, kAccumulators
// instructions a round. The tiles are configured and released around the loop.
DUET_TARGET_AMX float chains_amx_bf16(int64_t iterations) {
  static_assert(kAccumulators % 4 == 0, "rounds of 4 tiles");
  configure_full_tiles(6);
  alignas(64) uint16_t ones[16 * 32];
  for (uint16_t& v : ones) v = 0x3a83;  // bf16 ~1e-3: sums stay finite
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kAccumulators / 4; ++i) {
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 5);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}

// AVX2 has 16 ymm registers: 12 accumulators + 2 operands still fit.
DUET_TARGET_AVX2 float chains_fp32_fma_ymm(int64_t iterations) {
  __m256 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-3f);
  for (int64_t it = 0; it < iterations; ++it) {
    __asm__ volatile("" : "+x"(a), "+x"(b));
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
  }
  __m256 sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm256_add_ps(sum, acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.f;
  for (float v : lanes) total += v;
  return total;
}
#endif

struct Family {
  float (*chains)(int64_t);  // null: not compiled for this architecture
  double ops_per_instruction;  // a multiply-add counts 2
  bool supported;
};

Family family(const std::string& name) {
  const Isa isa = active_isa();
  const CpuFeatures& f = cpu_features();
#if defined(__x86_64__)
  // vdpbf16ps zmm: 16 fp32 lanes x 2 bf16 pairs; vpdpbusd zmm: 16 int32 lanes x 4 u8*s8.
  if (name == "bf16_dot") return {chains_bf16_dot, 64.0, isa >= Isa::kAvx512Bf16 && f.avx512_bf16};
  if (name == "int8_dot") return {chains_int8_dot, 128.0, isa >= Isa::kAvx512Bf16 && f.avx512_vnni};
  if (name == "fp32_fma_zmm") return {chains_fp32_fma_zmm, 32.0, isa >= Isa::kAvx512};
  // tdpbf16ps: 16 x 16 fp32 results x 32 products each.
  if (name == "amx_bf16") return {chains_amx_bf16, 16384.0, isa >= Isa::kAmx && f.amx_bf16};
  if (name == "fp32_fma_ymm") return {chains_fp32_fma_ymm, 16.0, isa >= Isa::kAvx2 && f.fma};
#else
  if (name == "bf16_dot" || name == "int8_dot" || name == "fp32_fma_zmm" ||
      name == "fp32_fma_ymm" || name == "amx_bf16")
    return {nullptr, 0.0, false};
#endif
  throw std::invalid_argument("peak_rate: unknown family '" + name +
                              "' (bf16_dot, int8_dot, fp32_fma_zmm, fp32_fma_ymm, amx_bf16)");
}

double peak_rate(const std::string& name, int64_t iterations, int repeats) {
  if (iterations < 1) throw std::invalid_argument("peak_rate: iterations must be >= 1");
  if (repeats < 1) throw std::invalid_argument("peak_rate: repeats must be >= 1");
  const Family fam = family(name);
  if (!fam.supported || fam.chains == nullptr) return 0.0;
  const int threads = num_threads();
  const double ops = static_cast<double>(threads) * static_cast<double>(iterations) *
                     kAccumulators * fam.ops_per_instruction;
  volatile float sink = 0.f;
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    float total = 0.f;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += fam.chains(iterations);
    const std::chrono::duration<double> secs = std::chrono::steady_clock::now() - start;
    sink = sink + total;
    best = std::max(best, ops / secs.count());
  }
  return best;
}

}  // namespace

void register_peak_probe(py::module_& m) {
  m.def("peak_rate", &peak_rate, py::arg("family"), py::arg("iterations") = int64_t{1} << 24,
        py::arg("repeats") = 5, py::call_guard<py::gil_scoped_release>(),
        "Best in-register rate, in ops/s (a multiply-add = 2), of one instruction family on all "
        "kernel threads: 'bf16_dot' (vdpbf16ps zmm), 'int8_dot' (vpdpbusd zmm), 'fp32_fma_zmm' "
        "(vfmadd231ps zmm), 'fp32_fma_ymm' (vfmadd231ps ymm, AVX2), 'amx_bf16' (tdpbf16ps tiles). "
        "Returns 0.0 when the CPU "
        "(or the DUET_ISA cap) lacks the instruction.");
}

}  // namespace duet

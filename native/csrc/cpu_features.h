// Run-time ISA detection. Kernels are compiled for several ISAs in one binary (per-function
// target attributes) and pick one at run time from these flags, so one build runs anywhere.
#pragma once

#include <string>

namespace duet {

enum class Isa : int {
  kPortable = 0,     // plain C++, any x86-64 or other CPU
  kAvx2 = 1,         // AVX2 + FMA
  kAvx512 = 2,       // AVX-512 F/BW/VL/DQ
  kAvx512Bf16 = 3,   // + AVX512_BF16 (vdpbf16ps) and VNNI (vpdpbusd)
  kAmx = 4,          // + AMX-BF16/INT8 tiles
};

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512_bf16 = false;
  bool avx512_vnni = false;
  bool avx512_vbmi = false;
  bool amx_bf16 = false;
  bool amx_int8 = false;
};

// Features of the CPU we run on (computed once).
const CpuFeatures& cpu_features();

// The best ISA this CPU supports, capped by the DUET_ISA environment variable
// ("portable", "avx2", "avx512", "avx512_bf16", "amx") so tests can force a slower path.
Isa active_isa();

// Overrides the active ISA (still capped by what the CPU supports); returns the one in effect.
Isa set_active_isa(Isa requested);

std::string isa_name(Isa isa);

}  // namespace duet

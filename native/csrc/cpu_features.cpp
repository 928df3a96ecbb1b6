#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define DUET_X86 1
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace duet {
namespace {

#ifdef DUET_X86
void cpuid(unsigned leaf, unsigned subleaf, unsigned regs[4]) {
  __cpuid_count(leaf, subleaf, regs[0], regs[1], regs[2], regs[3]);
}

// The OS must save the wide registers (XCR0) or the instructions fault even when CPUID has them.
unsigned long long xgetbv0() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

// One request for the process (every thread may then use the tiles).
bool request_amx_tiles() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#ifdef DUET_X86
  unsigned r[4];
  cpuid(0, 0, r);
  const unsigned max_leaf = r[0];
  if (max_leaf < 7) return f;
  cpuid(1, 0, r);
  const bool osxsave = (r[2] >> 27) & 1;
  if (!osxsave) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_ok = (xcr0 & 0x6) == 0x6;
  const bool zmm_ok = (xcr0 & 0xe6) == 0xe6;
  const bool amx_ok = (xcr0 & 0x60000) == 0x60000;
  f.fma = ymm_ok && ((r[2] >> 12) & 1);
  cpuid(7, 0, r);
  const unsigned ebx = r[1], ecx = r[2], edx = r[3];
  f.avx2 = ymm_ok && ((ebx >> 5) & 1);
  f.avx512f = zmm_ok && ((ebx >> 16) & 1);
  f.avx512dq = zmm_ok && ((ebx >> 17) & 1);
  f.avx512bw = zmm_ok && ((ebx >> 30) & 1);
  f.avx512vl = zmm_ok && ((ebx >> 31) & 1);
  f.avx512_vbmi = zmm_ok && ((ecx >> 1) & 1);
  f.avx512_vnni = zmm_ok && ((ecx >> 11) & 1);
  // Linux hands out the tile state only on request (arch_prctl); without it the tiles fault.
  const bool amx_granted = amx_ok && ((edx >> 24) & 1) && request_amx_tiles();
  f.amx_bf16 = amx_granted && ((edx >> 22) & 1);
  f.amx_int8 = amx_granted && ((edx >> 25) & 1);
  cpuid(7, 1, r);
  f.avx512_bf16 = zmm_ok && ((r[0] >> 5) & 1);
#endif
  return f;
}

Isa best_supported(const CpuFeatures& f) {
  const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  if (avx512 && f.avx512_bf16 && f.avx512_vnni && f.amx_bf16 && f.amx_int8) return Isa::kAmx;
  if (avx512 && f.avx512_bf16 && f.avx512_vnni) return Isa::kAvx512Bf16;
  if (avx512) return Isa::kAvx512;
  if (f.avx2 && f.fma) return Isa::kAvx2;
  return Isa::kPortable;
}

Isa parse_env_cap() {
  const char* env = std::getenv("DUET_ISA");
  if (env == nullptr || *env == '\0') return Isa::kAmx;
  if (!std::strcmp(env, "portable")) return Isa::kPortable;
  if (!std::strcmp(env, "avx2")) return Isa::kAvx2;
  if (!std::strcmp(env, "avx512")) return Isa::kAvx512;
  if (!std::strcmp(env, "avx512_bf16")) return Isa::kAvx512Bf16;
  return Isa::kAmx;
}

Isa min_isa(Isa a, Isa b) { return static_cast<int>(a) < static_cast<int>(b) ? a : b; }

Isa g_active = min_isa(best_supported(cpu_features()), parse_env_cap());

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

Isa active_isa() { return g_active; }

Isa set_active_isa(Isa requested) {
  g_active = min_isa(best_supported(cpu_features()), requested);
  return g_active;
}

std::string isa_name(Isa isa) {
  switch (isa) {
    case Isa::kPortable: return "portable";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAmx: return "amx";
  }
  return "unknown";
}

}  // namespace duet

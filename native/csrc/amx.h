// AMX tiles for the kernels that have a tile path (mla_decode_amx.h, peak_probe.cpp): the
// target attribute and the tile configuration. Linux hands out the tile state only on request,
// made once per process by cpu_features.cpp; Isa::kAmx means it was granted.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define DUET_TARGET_AMX                                                                    \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c," \
                        "amx-tile,amx-bf16")))

namespace duet {

// Palette 1 with tiles 0 .. count - 1 of 16 rows x 64 bytes (16 x 16 fp32, 16 x 32 bf16) on the
// calling thread; every user releases them (_tile_release) before it returns.
DUET_TARGET_AMX inline void configure_full_tiles(int count) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < count; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace duet

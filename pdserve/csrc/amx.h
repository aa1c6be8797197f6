// The AMX plumbing both C++ extensions share (the attention kernels, paged_decode.cpp; the GEMMs,
// model/csrc/linear_amx.h): whether this process may use the tile unit, and the one tile layout every
// pdserve AMX kernel configures. Defines PDSERVE_HAVE_AMX where the build targets AMX BF16 on Linux.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PDSERVE_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pdserve_amx {

// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA; oneDNN asks the same when it runs AMX). Asked once per process and extension;
// false where the CPU or the kernel has no AMX, and then every AMX kernel declines its calls.
inline bool ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return ok;
}

// Palette 1, tiles 0..7 all 16 rows of 64 bytes: every tile is 16 x 32 bf16 (A, B) or 16 x 16 fp32 (C).
// Load it from static storage or a member (a const local in a lambda made ldtilecfg fault with #GP in
// paged_decode.cpp, as if never stored).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

}  // namespace pdserve_amx
#endif

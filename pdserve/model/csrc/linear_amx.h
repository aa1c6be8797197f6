// pdserve's AMX BF16 GEMM over the packed panels (linear_common.h), shared by the bf16-weight kernel
// (linear_bf16.cpp: the panels are B tiles as they lie) and the int8-weight one (linear_int8.cpp: a
// panel of int8 weights is widened once into a bf16 panel in L2, exact since |q| <= 127, and the tile
// sums are scaled per column).
//
// A panel's 16 k pairs x 16 columns at a 128-byte stride are an AMX B tile; x's rows are the A tiles,
// 2 x 2 tiles per step (32 rows x 32 columns). A decode batch's x fits in L2: work items run
// panel-major, each thread on its own panels, and while a panel's tiles run the thread prefetches its
// next panel's stored bytes into L2, so weights stream from DRAM under the tile compute. A prompt
// chunk's x does not: it goes in row blocks that do, block-major, each panel read once per block
// (1.3-1.6x at 1,024-2,048 rows of K = 896, where every panel re-read all of x from L3). A row's result
// is the tile unit's fp32 sums in a fixed k order, whatever the other rows: batch-invariant.
#pragma once

#include "../../csrc/amx.h"
#include "linear_common.h"

#if defined(PDSERVE_HAVE_AVX512BF16) && defined(PDSERVE_HAVE_AMX)
#define PDSERVE_LINEAR_AMX 1
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

namespace pdserve_linear {
namespace amx {

using pdserve_amx::ready;
using Config = pdserve_amx::TileConfig;

constexpr int64_t kK = 32;       // k per tile step (16 k pairs)
constexpr int64_t kBlock = 256;  // rows per work item at most
// Bytes of x a thread keeps in L2: three quarters of an AMX core's 2 MB (Sapphire, Emerald and Granite
// Rapids), the rest for the panel at hand and the next one's prefetch.
constexpr int64_t kL2Budget = 1536 << 10;

// C tile `t` (16 rows x 16 fp32) times the columns' scales to rows [0, rows) of o as bf16, columns
// masked by keep.
inline void store_c(int t, at::BFloat16* o, int64_t os, int64_t rows, __mmask16 keep, __m512 scale) {
  alignas(64) float buf[16][16];
  switch (t) {  // the tile number must be an immediate
    case 0: _tile_stored(0, buf, 64); break;
    case 1: _tile_stored(1, buf, 64); break;
    case 2: _tile_stored(2, buf, 64); break;
    default: _tile_stored(3, buf, 64); break;
  }
  for (int64_t r = 0; r < rows; ++r) store_bf16x16(o + r * os, _mm512_mul_ps(_mm512_load_ps(buf[r]), scale), keep);
}

// Rows [first, first + rows) of x against one bf16 panel (wp: K/2 x 32 columns x 2), all of K, to o
// (already offset to the panel's first column), scaled per column by s0 / s1. Rows go 32 at a time (2 A
// tiles x 2 B tiles: 4 C tiles), a last 16 alone; a row tile reaching past M reads the zero-padded tail
// copy instead of x. While they run, lines [pf_from, pf_to) of the next panel's stored bytes are
// prefetched into L2, spread evenly over the item's tile steps.
inline void panel(const at::BFloat16* x, int64_t xs, const at::BFloat16* tail, int64_t tail_from, const char* wp,
                  const char* next, int64_t pf_from, int64_t pf_to, int64_t K, at::BFloat16* o, int64_t os,
                  int64_t first, int64_t rows, int64_t M, __mmask16 keep0, __mmask16 keep1, __m512 s0, __m512 s1) {
  const int64_t ksteps = K / kK, tiles16 = (rows + 15) / 16;
  const int64_t steps = ((tiles16 + 1) / 2) * ksteps;
  const int64_t lines_per_step = next ? (pf_to - pf_from + steps - 1) / steps : 0;
  int64_t pf = pf_from;  // the next line of the next panel to prefetch
  const auto a_tile = [&](int64_t m0, int64_t kb) -> std::pair<const void*, int64_t> {
    if (m0 + 16 > M) return {tail + (m0 - tail_from) * K + kb * kK, K * 2};
    return {x + m0 * xs + kb * kK, xs * 2};
  };
  for (int64_t t = 0; t < tiles16; t += 2) {
    const int64_t m0 = first + 16 * t;
    const bool two = t + 1 < tiles16;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kb = 0; kb < ksteps; ++kb) {
      for (int64_t l = 0; l < lines_per_step && pf < pf_to; ++l, ++pf) _mm_prefetch(next + pf * 64, _MM_HINT_T1);
      const char* b = wp + kb * 16 * 128;
      _tile_loadd(6, b, 128);
      _tile_loadd(7, b + 64, 128);
      const auto [a0, s0a] = a_tile(m0, kb);
      _tile_loadd(4, a0, s0a);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        const auto [a1, s1a] = a_tile(m0 + 16, kb);
        _tile_loadd(5, a1, s1a);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int64_t r0 = std::min<int64_t>(16, first + rows - m0);
    store_c(0, o + m0 * os, os, r0, keep0, s0);
    store_c(1, o + m0 * os + 16, os, r0, keep1, s1);
    if (two) {
      const int64_t r1 = std::min<int64_t>(16, first + rows - m0 - 16);
      store_c(2, o + (m0 + 16) * os, os, r1, keep0, s0);
      store_c(3, o + (m0 + 16) * os + 16, os, r1, keep1, s1);
    }
  }
}

// x [M, K] bf16 (checked by the caller; K a multiple of kK) times `panels` panels of n output columns ->
// [M, n] bf16. `src` says where panel p's stored bytes lie (`stored(p)`, `stored_lines` cache lines each,
// what is prefetched), gives its bf16 form (`bf16(p, scratch)`: the stored bytes themselves, or widened
// into `scratch`, K * 64 bytes of the thread's own, allocated where `Source::kWidens`) and its 32 column
// scales (`scales(p)`, or nullptr).
template <class Source>
torch::Tensor linear(const torch::Tensor& x, int64_t panels, int64_t n, const Source& src) {
  TORCH_CHECK(ready(), "this CPU or kernel grants no AMX tile state");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kK == 0, "the AMX kernel needs K a multiple of 32");
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const int64_t xs = x.stride(0);
  // The last partial 16-row tile reads a zero-padded copy (a tile load takes 16 rows).
  const int64_t tail_from = (M / 16) * 16;
  torch::Tensor tail;
  if (tail_from < M) {
    tail = torch::zeros({16, K}, x.options());
    tail.narrow(0, 0, M - tail_from).copy_(x.narrow(0, tail_from, M - tail_from));
  }
  const at::BFloat16* tp = tail.defined() ? tail.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t lines = src.stored_lines;
  // Work items panel-major while x fits the L2 budget: a panel's row blocks (near-equal, whole 32-row
  // pairs, up to kBlock rows) run one after the other on one thread, so the panel comes from DRAM once
  // (and is widened once) and from L2 after; each prefetches its share of the thread's next panel.
  // A taller x (a prompt chunk) goes block-major: row blocks sized so one block's x stays in L2 while
  // the thread's panels pass over it (a panel is then read once per block, from L3 after the first).
  // Threads split the items evenly.
  const bool block_major = M * K * 2 > kL2Budget;
  const int64_t max_rows = block_major ? std::clamp<int64_t>(kL2Budget / (K * 2) / 32 * 32, 64, kBlock) : kBlock;
  const int64_t blocks = (M + max_rows - 1) / max_rows;
  const int64_t block_rows = ((M + blocks - 1) / blocks + 31) / 32 * 32;
  at::parallel_for(0, blocks * panels, 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<char, decltype(&std::free)> scratch(
        Source::kWidens ? static_cast<char*>(std::aligned_alloc(64, K * 64)) : nullptr, &std::free);
    TORCH_CHECK(!Source::kWidens || scratch, "no memory for the AMX kernel's scratch panel");
    const Config config;
    _tile_loadconfig(&config);
    const char* wp = nullptr;
    int64_t have = -1;  // the panel wp holds
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = block_major ? i % panels : i / blocks, b = block_major ? i / panels : i % blocks;
      const int64_t first = b * block_rows;
      if (first >= M) continue;
      if (p != have) {
        wp = src.bf16(p, scratch.get());
        have = p;
      }
      const auto [keep0, keep1] = panel_masks(p, n);
      const float* s = src.scales(p);
      const __m512 s0 = s ? _mm512_loadu_ps(s) : _mm512_set1_ps(1.f), s1 = s ? _mm512_loadu_ps(s + 16) : s0;
      // The next panel this thread runs, and the share of its lines this item prefetches.
      const char* next = nullptr;
      int64_t pf_from = 0, pf_to = lines;
      if (block_major) {
        if (i + 1 < i1) next = src.stored((p + 1) % panels);
      } else {
        if ((p + 1) * blocks < i1 && p + 1 < panels) next = src.stored(p + 1);
        pf_from = lines * b / blocks;
        pf_to = lines * (b + 1) / blocks;
      }
      panel(xp, xs, tp, tail_from, wp, next, pf_from, pf_to, K, o + p * kPanel, n, first,
            std::min(block_rows, M - first), M, keep0, keep1, s0, s1);
    }
    _tile_release();
  });
  return out;
}

}  // namespace amx
}  // namespace pdserve_linear
#endif

namespace pdserve_linear {

// Whether this build and CPU run the AMX kernel (both extensions bind it as `amx_available`).
inline bool amx_available() {
#ifdef PDSERVE_LINEAR_AMX
  return amx::ready();
#else
  return false;
#endif
}

}  // namespace pdserve_linear

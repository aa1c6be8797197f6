// y = x W^T for bf16 on CPUs with AVX-512 BF16 (or, in a second build path, AVX2 + FMA), for decode
// steps' few rows and prompts' many alike.
//
// W is packed once into 32-column panels of k pairs, [N/32][K/2][32][2], so a panel is one contiguous
// stream and each pair of k of 32 columns is two vectors that `vdpbf16ps` takes as they are; a row of x
// contributes one broadcast pair per k pair. Up to 12 rows share each loaded vector (24 accumulators in
// registers), and W is software-prefetched 8 KB ahead in the panel, which keeps a decode step's weight
// stream near the memory bandwidth. Rows come in blocks of 192 whose x stays in L2 while the panels pass
// over it; a panel stays in L1 for the block's row tiles. (Walking a panel in slices shared by all row
// tiles, to stream W once for up to 64 rows, measured no better once the prefetch ran 8 KB ahead.)
// Accumulation is fp32 in a fixed k order per output element, so a row's result does not depend on the
// other rows of the call (batch-invariant); the output is rounded to bf16 to nearest even.
//
// On a CPU without AVX-512 BF16 but with AVX2 and FMA (AMD Zen 2/3, older Xeons) the same panels are read
// by fp32 FMA tiles (linear_avx2.h, shared with the int8-weight kernel): each k pair widened to fp32 in
// registers for decode's few rows, or a chunk of the panel widened once for many rows' 6 x 16 tiles; the
// same fp32 FMAs per output element in k order either way (batch-invariant).
#include "linear_avx2.h"
#include "linear_common.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

using namespace pdserve_linear;

#ifdef PDSERVE_HAVE_AVX512BF16
namespace {

constexpr int64_t kPrefetch = 64;  // k pairs ahead that W is prefetched (8 KB of a panel)

// Rows [0, R) of x (int32 = one k pair, row stride xs) against one panel, all K/2 k pairs, to o as
// bf16 (columns masked by keep0/keep1 on a partial last panel).
template <int R>
void tile(const int32_t* x, int64_t xs, const __m512i* w, int64_t KP, at::BFloat16* o, int64_t os, __mmask16 keep0,
          __mmask16 keep1) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * (kp + kPrefetch)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * (kp + kPrefetch) + 1), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_load_si512(w + 2 * kp), w1 = (__m512bh)_mm512_load_si512(w + 2 * kp + 1);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[r * xs + kp]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    store_bf16x16(o + r * os, acc[r][0], keep0);
    store_bf16x16(o + r * os + 16, acc[r][1], keep1);
  }
}

}  // namespace
#endif

// w [N, K] bf16, K even -> [ceil(N/32), K/2, 32, 2] (columns past N are zero).
torch::Tensor pack(torch::Tensor w) { return pack_panels(w, torch::kBFloat16); }

// x [M, K] bf16 (rows may be strided) times the packed W of n output columns -> [M, n] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
#ifdef PDSERVE_HAVE_AVX512BF16
  x = check_args(x, packed, n, torch::kBFloat16);
  const int64_t M = x.size(0), KP = packed.size(1), panels = packed.size(0);
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0) / 2;
  const __m512i* w = reinterpret_cast<const __m512i*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  // Blocks (x stays in L2 while the panels pass over it) x panels (a panel stays in L1 for the block's
  // row tiles), split over threads.
  const int64_t block = balanced_block_rows(M);
  at::parallel_for(0, num_blocks(M, block) * panels, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const PanelJob job = panel_job(i, M, n, panels, block);
      const __m512i* wp = w + job.panel * KP * 2;
      for_each_tile(job.first, job.rows, [&](int64_t m0, int64_t r) {
        with_rows<kMaxRows>(r, [&](auto R) {
          tile<decltype(R)::value>(xp + m0 * xs, xs, wp, KP, o + m0 * n + job.panel * kPanel, n, job.keep0, job.keep1);
        });
      });
    }
  });
  return out;
#elif defined(PDSERVE_LINEAR_AVX2)
  x = check_args(x, packed, n, torch::kBFloat16);
  const int64_t M = x.size(0), KP = packed.size(1), panels = packed.size(0);
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  const __m256i* w = reinterpret_cast<const __m256i*>(packed.data_ptr<at::BFloat16>());
  avx2::linear(x, KP, panels, n, [w, KP](int64_t p) { return avx2::Bf16Panel{w + p * KP * 4}; }, nullptr, out);
  return out;
#else
  TORCH_CHECK(false, "built without AVX-512 BF16 or AVX2 + FMA");
  return x;
#endif
}

#if defined(PDSERVE_HAVE_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PDSERVE_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
namespace {

// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA; oneDNN asks the same when it runs AMX). Asked once per process.
bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return ok;
}

// Palette 1, tiles 0..7 all 16 rows of 64 bytes: C tiles 0-3 (16 x 16 fp32), A tiles 4-5 (16 rows x 32 k
// of x), B tiles 6-7 (16 k pairs x 16 columns: half a panel's k pairs as they lie, row stride 128 bytes).
struct alignas(64) AmxConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

constexpr int64_t kAmxK = 32;       // k per tile step (16 k pairs)
constexpr int64_t kAmxBlock = 256;  // rows per work item at most

// C tile `t` (16 rows x 16 fp32) to rows [0, rows) of o as bf16, columns masked by keep.
inline void store_c(int t, at::BFloat16* o, int64_t os, int64_t rows, __mmask16 keep) {
  alignas(64) float buf[16][16];
  switch (t) {  // the tile number must be an immediate
    case 0: _tile_stored(0, buf, 64); break;
    case 1: _tile_stored(1, buf, 64); break;
    case 2: _tile_stored(2, buf, 64); break;
    default: _tile_stored(3, buf, 64); break;
  }
  for (int64_t r = 0; r < rows; ++r) store_bf16x16(o + r * os, _mm512_load_ps(buf[r]), keep);
}

// Rows [first, first + rows) of x against one panel (wp: K/2 x 32 columns x 2), all of K, to o (already
// offset to the panel's first column). Rows go 32 at a time (2 A tiles x 2 B tiles: 4 C tiles), a last
// 16 alone; a row tile reaching past M reads the zero-padded tail copy instead of x. While they run,
// lines [pf_from, pf_to) of the next panel are prefetched into L2, spread evenly over the item's tile
// steps, so the next panel's DRAM reads overlap this one's compute.
void amx_panel(const at::BFloat16* x, int64_t xs, const at::BFloat16* tail, int64_t tail_from, const char* wp,
               const char* next, int64_t pf_from, int64_t pf_to, int64_t K, at::BFloat16* o, int64_t os,
               int64_t first, int64_t rows, int64_t M, __mmask16 keep0, __mmask16 keep1) {
  const int64_t ksteps = K / kAmxK, tiles16 = (rows + 15) / 16;
  const int64_t steps = ((tiles16 + 1) / 2) * ksteps;
  const int64_t lines_per_step = next ? (pf_to - pf_from + steps - 1) / steps : 0;
  int64_t pf = pf_from;  // the next line of the next panel to prefetch
  const auto a_tile = [&](int64_t m0, int64_t kb) -> std::pair<const void*, int64_t> {
    if (m0 + 16 > M) return {tail + (m0 - tail_from) * K + kb * kAmxK, K * 2};
    return {x + m0 * xs + kb * kAmxK, xs * 2};
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
      const auto [a0, s0] = a_tile(m0, kb);
      _tile_loadd(4, a0, s0);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        const auto [a1, s1] = a_tile(m0 + 16, kb);
        _tile_loadd(5, a1, s1);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int64_t r0 = std::min<int64_t>(16, first + rows - m0);
    store_c(0, o + m0 * os, os, r0, keep0);
    store_c(1, o + m0 * os + 16, os, r0, keep1);
    if (two) {
      const int64_t r1 = std::min<int64_t>(16, first + rows - m0 - 16);
      store_c(2, o + (m0 + 16) * os, os, r1, keep0);
      store_c(3, o + (m0 + 16) * os + 16, os, r1, keep1);
    }
  }
}

}  // namespace
#endif

bool amx_available() {
#ifdef PDSERVE_HAVE_AMX
  return amx_ready();
#else
  return false;
#endif
}

// x [M, K] bf16 times the packed W of n output columns -> [M, n] bf16 on AMX BF16 tiles (K a multiple of
// 32). The panels pdserve's kernel reads are already B tiles (k pairs x columns), so both kernels share
// one packed copy. A row's result is the tile unit's fp32 sums in a fixed k order, whatever the other
// rows: batch-invariant, like `linear` (but not bitwise equal to it: the tile unit orders each k pair's
// two products differently from `vdpbf16ps`).
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, int64_t n) {
#ifdef PDSERVE_HAVE_AMX
  x = check_args(x, packed, n, torch::kBFloat16);
  TORCH_CHECK(amx_ready(), "this CPU or kernel grants no AMX tile state");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(K % kAmxK == 0, "linear_amx needs K a multiple of 32");
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
  const char* w = reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>());
  const int64_t panel_bytes = K * 64;  // = K cache lines
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  // Work items panel-major: a panel's row blocks (near-equal, whole 32-row pairs, up to kAmxBlock rows)
  // run one after the other on one thread, so the panel comes from DRAM once and from L2 after; each
  // prefetches its share of the thread's next panel. Threads split the panels evenly.
  const int64_t blocks = (M + kAmxBlock - 1) / kAmxBlock;
  const int64_t block_rows = ((M + blocks - 1) / blocks + 31) / 32 * 32;
  at::parallel_for(0, blocks * panels, 1, [&](int64_t i0, int64_t i1) {
    const AmxConfig config;
    _tile_loadconfig(&config);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / blocks, b = i % blocks, first = b * block_rows;
      if (first >= M) continue;
      const auto [keep0, keep1] = panel_masks(p, n);
      const bool has_next = (p + 1) * blocks < i1 && p + 1 < panels;
      amx_panel(xp, xs, tp, tail_from, w + p * panel_bytes, has_next ? w + (p + 1) * panel_bytes : nullptr,
                K * b / blocks, K * (b + 1) / blocks, K, o + p * kPanel, n, first, std::min(block_rows, M - first),
                M, keep0, keep1);
    }
    _tile_release();
  });
  return out;
#else
  TORCH_CHECK(false, "built without AMX BF16");
  return x;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has a kernel (AVX-512 BF16 or AVX2 + FMA)");
  m.def("isa", &isa, "the instruction set of this build's kernel");
  m.def("pack", &pack, "pack [N, K] bf16 weights into 32-column panels of k pairs");
  m.def("linear", &linear, "x @ W^T from packed W, bf16");
  m.def("amx_available", &amx_available, "whether this build and CPU run linear_amx");
  m.def("linear_amx", &linear_amx, "x @ W^T from packed W on AMX BF16 tiles (K a multiple of 32)");
}

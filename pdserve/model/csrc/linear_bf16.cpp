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
#include "linear_amx.h"
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

#ifdef PDSERVE_LINEAR_AMX
namespace {

// bf16 panels for amx::linear: B tiles as they lie.
struct Bf16Panels {
  static constexpr bool kWidens = false;
  const char* w;
  int64_t panel_bytes, stored_lines;
  const char* stored(int64_t p) const { return w + p * panel_bytes; }
  const char* bf16(int64_t p, char*) const { return stored(p); }
  const float* scales(int64_t) const { return nullptr; }
};

}  // namespace
#endif

// x [M, K] bf16 times the packed W of n output columns -> [M, n] bf16 on AMX BF16 tiles (K a multiple of
// 32; linear_amx.h). The panels pdserve's kernel reads are already B tiles (k pairs x columns), so both
// kernels share one packed copy. Batch-invariant, like `linear` (but not bitwise equal to it: the tile
// unit orders each k pair's two products differently from `vdpbf16ps`).
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, int64_t n) {
#ifdef PDSERVE_LINEAR_AMX
  x = check_args(x, packed, n, torch::kBFloat16);
  const int64_t K = x.size(1);
  const Bf16Panels src{reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>()), K * 64, K};
  return amx::linear(x, packed.size(0), n, src);
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

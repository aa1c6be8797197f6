// y = x W^T for bf16 on CPUs with AVX-512 BF16, for decode steps' few rows and prompts' many alike.
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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace {
constexpr int64_t kPanel = 32;    // output columns per panel (two vectors)
constexpr int64_t kMaxRows = 12;  // rows per register tile
constexpr int64_t kPrefetch = 64;   // k pairs ahead that W is prefetched (8 KB of a panel)
constexpr int64_t kBlockRows = 192; // rows per block: x of a block stays in L2 while the panels pass
}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_HAVE_AVX512BF16 1

namespace {

inline void store_bf16x16(at::BFloat16* o, __m512 v, __mmask16 keep) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_mask_storeu_epi16(o, keep, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

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

template <int R>
void run_tile(const int32_t* x, int64_t xs, const __m512i* w, int64_t KP, at::BFloat16* o, int64_t os, __mmask16 k0,
              __mmask16 k1, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return run_tile<R - 1>(x, xs, w, KP, o, os, k0, k1, rows);
  }
  tile<R>(x, xs, w, KP, o, os, k0, k1);
}

}  // namespace
#endif

bool available() {
#ifdef PDSERVE_HAVE_AVX512BF16
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16, K even -> [ceil(N/32), K/2, 32, 2] (columns past N are zero).
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.size(1) % 2 == 0, "w must be [N, K] bf16, K even");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bf16 (rows may be strided) times the packed W of n output columns -> [M, n] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
#ifdef PDSERVE_HAVE_AVX512BF16
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(), "x must be a 2-D bf16 CPU tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.size(1) * 2 == x.size(1) && n > (packed.size(0) - 1) * kPanel && n <= packed.size(0) * kPanel,
              "packed weight does not match x / n");
  if (x.stride(1) != 1 || x.stride(0) % 2 != 0) x = x.contiguous();
  const int64_t M = x.size(0), KP = packed.size(1), panels = packed.size(0);
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0) / 2;
  const __m512i* w = reinterpret_cast<const __m512i*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  // Blocks of kBlockRows rows (x stays in L2 while the panels pass over it) x panels (a panel stays in
  // L1 for the block's row tiles), split over threads; row tiles of near-equal size (16 = 8 + 8).
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks * panels, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / panels, p = i % panels, first = b * kBlockRows, rows = std::min(kBlockRows, M - first);
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      const auto k0 = static_cast<__mmask16>((1u << std::min<int64_t>(cols, 16)) - 1u);
      const auto k1 = static_cast<__mmask16>(cols > 16 ? (1u << (cols - 16)) - 1u : 0u);
      const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows, base = rows / tiles, extra = rows % tiles;
      for (int64_t t = 0, m0 = first; t < tiles; ++t) {
        const int64_t r = base + (t < extra ? 1 : 0);
        run_tile<kMaxRows>(xp + m0 * xs, xs, w + p * KP * 2, KP, o + m0 * n + p * kPanel, n, k0, k1, r);
        m0 += r;
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "built without AVX-512 BF16");
  return x;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX-512 BF16 kernel");
  m.def("pack", &pack, "pack [N, K] bf16 weights into 32-column panels of k pairs");
  m.def("linear", &linear, "x @ W^T from packed W, bf16");
}

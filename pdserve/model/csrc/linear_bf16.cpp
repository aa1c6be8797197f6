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
// On a CPU without AVX-512 BF16 but with AVX2 and FMA (AMD Zen 2/3, older Xeons), where oneDNN has no bf16
// matmul and torch's own bf16 GEMM runs at a few GFLOP/s, the same panels are read by an fp32 FMA tile:
// a 32-byte load of a k pair of 8 columns is two fp32 vectors after one shift (even k: the low halves moved
// up) and one mask (odd k: the high halves as they are), both exact, against x converted to fp32 once per
// call. Blocks of 1-3 rows (decode) stream the panel as bf16 in 3 x 32 tiles; blocks of more rows widen
// the panel to fp32 once (K x 128 bytes, in L2) and run 6 x 16 tiles on it, two weight loads and six
// broadcasts per 12 FMAs. Both do the same fp32 FMAs per output element in k order, so a row's result
// does not depend on the path (batch-invariant); the bf16 products are exact in fp32, so only that order
// and the final bf16 rounding differ from a float32 reference.
#include "linear_common.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

using namespace pdserve_linear;

namespace {
constexpr int64_t kPrefetch = 64;  // k pairs ahead that W is prefetched (8 KB of a panel)
}  // namespace

#ifdef PDSERVE_HAVE_AVX512BF16
namespace {

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
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_LINEAR_AVX2 1
// Register tiles: loops over a tile's rows and vectors fully unrolled, or GCC keeps the accumulator array
// on the stack and stores it back every k step.
#define PDSERVE_UNROLL _Pragma("GCC unroll 16")
namespace {

constexpr int64_t kMaxRowsAvx2 = 3;    // streaming tile: 12 accumulators + 2 weight vectors + 2 broadcasts
constexpr int64_t kMaxRowsWide = 6;    // widened tile: 6 rows x 16 columns = 12 accumulators (as BLIS's 6x16)
constexpr int64_t kWidenFrom = 16;     // a block of at least this many rows widens its panel first
constexpr int64_t kL2Budget = 384 << 10;  // bytes of L2 for a block's x and its widened panel

// 8 fp32 -> 8 bf16 bit patterns, rounded to nearest even.
inline __m128i to_bf16x8(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  // 32 -> 16 bits per lane (values fit: unsigned saturation never triggers), then the low 8 bytes of
  // each 128-bit half
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
}

// One row's V vectors of 8 accumulators to o as bf16, its first `cols` columns.
template <int V>
inline void store_row(const __m256* acc, at::BFloat16* o, int64_t cols) {
  if (cols <= 0) return;
  alignas(16) uint16_t row[8 * V];
  PDSERVE_UNROLL
  for (int c = 0; c < V; ++c) _mm_store_si128(reinterpret_cast<__m128i*>(row + 8 * c), to_bf16x8(acc[c]));
  std::memcpy(o, row, std::min<int64_t>(cols, 8 * V) * sizeof(uint16_t));
}

// The even and odd k of a k pair of 8 columns (one 32-byte load of the panel) as fp32, exactly.
inline void widen_pair(__m256i v, __m256& even, __m256& odd) {
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// Few rows (decode): rows [0, R) of x (fp32, row stride xs) against one panel read as bf16, all K/2 k
// pairs, to o as bf16 (the first `cols` columns: fewer on a partial last panel). The weights stream from
// memory once for the R rows.
template <int R>
void tile_stream(const float* x, int64_t xs, const __m256i* w, int64_t KP, at::BFloat16* o, int64_t os, int64_t cols) {
  __m256 acc[R][4];
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    PDSERVE_UNROLL
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t kp = 0; kp < KP; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * (kp + kPrefetch)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * (kp + kPrefetch) + 2), _MM_HINT_T0);
    PDSERVE_UNROLL
    for (int c = 0; c < 4; ++c) {
      __m256 w0, w1;
      widen_pair(_mm256_load_si256(w + 4 * kp + c), w0, w1);
      PDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + 2 * kp), w0, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + 2 * kp + 1), w1, acc[r][c]);
      }
    }
  }
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) store_row<4>(acc[r], o + r * os, cols);
}

// A panel's k pairs widened once to fp32 rows of 32 columns, wf [K][32], for the tiles of a block.
void widen_panel(const __m256i* w, int64_t KP, float* wf) {
  for (int64_t kp = 0; kp < KP; ++kp) {
    PDSERVE_UNROLL
    for (int c = 0; c < 4; ++c) {
      __m256 w0, w1;
      widen_pair(_mm256_load_si256(w + 4 * kp + c), w0, w1);
      _mm256_store_ps(wf + (2 * kp) * kPanel + 8 * c, w0);
      _mm256_store_ps(wf + (2 * kp + 1) * kPanel + 8 * c, w1);
    }
  }
}

// Many rows (prompts, large batches): rows [0, R) against 16 columns (`half` 0 or 1) of a widened panel,
// to o's columns [16 half, 16 half + 16) up to `cols`. Per k: two weight loads, R broadcasts, 2R FMAs.
// The same fp32 FMAs in the same k order as tile_stream: a row's result does not depend on the path.
template <int R>
void tile_wide(const float* x, int64_t xs, const float* wf, int64_t K, int half, at::BFloat16* o, int64_t os,
               int64_t cols) {
  __m256 acc[R][2];
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* w = wf + 16 * half;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_load_ps(w + k * kPanel), w1 = _mm256_load_ps(w + k * kPanel + 8);
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * xs + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) store_row<2>(acc[r], o + r * os + 16 * half, cols - 16 * half);
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
  at::parallel_for(0, num_blocks(M) * panels, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const PanelJob job = panel_job(i, M, n, panels);
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
  const auto xf = x.to(torch::kFloat).contiguous();  // broadcast as fp32: converted once per call
  const float* xp = xf.data_ptr<float>();
  const int64_t xs = xf.stride(0);
  const __m256i* w = reinterpret_cast<const __m256i*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  // Rows per block: the block's fp32 x and the widened panel (K x 128 bytes) together stay in a 512 KB L2.
  const int64_t K = 2 * KP;
  const int64_t block = std::clamp<int64_t>(((kL2Budget - K * 128) / (K * 4)) / kMaxRowsWide * kMaxRowsWide,
                                            4 * kMaxRowsWide, kBlockRows);
  at::parallel_for(0, num_blocks(M, block) * panels, 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<float, decltype(&std::free)> wide(nullptr, &std::free);  // this thread's widened panel
    for (int64_t i = i0; i < i1; ++i) {
      const PanelJob job = panel_job(i, M, n, panels, block);
      const __m256i* wp = w + job.panel * KP * 4;
      at::BFloat16* op = o + job.panel * kPanel;
      const int64_t cols = std::min(kPanel, n - job.panel * kPanel);
      if (job.rows < kWidenFrom) {
        for_each_tile(job.first, job.rows, [&](int64_t m0, int64_t r) {
          with_rows<kMaxRowsAvx2>(r, [&](auto R) {
            tile_stream<decltype(R)::value>(xp + m0 * xs, xs, wp, KP, op + m0 * n, n, cols);
          });
        }, kMaxRowsAvx2);
        continue;
      }
      if (!wide) wide.reset(static_cast<float*>(std::aligned_alloc(32, 2 * KP * kPanel * sizeof(float))));
      widen_panel(wp, KP, wide.get());
      for (int half = 0; half < 2 && 16 * half < cols; ++half)
        for_each_tile(job.first, job.rows, [&](int64_t m0, int64_t r) {
          with_rows<kMaxRowsWide>(r, [&](auto R) {
            tile_wide<decltype(R)::value>(xp + m0 * xs, xs, wide.get(), K, half, op + m0 * n, n, cols);
          });
        }, kMaxRowsWide);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "built without AVX-512 BF16 or AVX2 + FMA");
  return x;
#endif
}

// Which instruction set this build's kernel runs on ("" where it has none).
std::string isa() {
#ifdef PDSERVE_HAVE_AVX512BF16
  return "avx512-bf16";
#elif defined(PDSERVE_LINEAR_AVX2)
  return "avx2-fma";
#else
  return "";
#endif
}

bool bf16_available() { return !isa().empty(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &bf16_available, "whether this build has a kernel (AVX-512 BF16 or AVX2 + FMA)");
  m.def("isa", &isa, "the instruction set of this build's kernel");
  m.def("pack", &pack, "pack [N, K] bf16 weights into 32-column panels of k pairs");
  m.def("linear", &linear, "x @ W^T from packed W, bf16");
}

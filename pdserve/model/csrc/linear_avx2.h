// The AVX2 + FMA build of pdserve's two linear kernels (linear_bf16.cpp: bf16 weights, linear_int8.cpp:
// int8 weights with a per-column scale), for CPUs without AVX-512 BF16 (AMD Zen 2/3, older Xeons), where
// oneDNN has no bf16 matmul and torch's own bf16 GEMM runs at a few GFLOP/s.
//
// Both read linear_common.h's panels (32 columns, k pairs) and differ only in how one k pair of 8
// columns becomes two fp32 vectors, the even and the odd k (`Bf16Panel`, `Int8Panel`), both exactly.
// x is converted to fp32 once per call. Blocks of fewer than 16 rows (decode) stream the panel in 3 x 32
// tiles, widening each k pair in registers as it arrives; larger blocks widen the panel to fp32 128 k
// at a time (a 16 KB chunk, each half in L1 while every row tile of the block passes over it) and run
// 6 x 16 tiles on the chunk, two weight loads and six broadcasts per 12 FMAs, the tiles' fp32 sums
// carried from chunk to chunk. Both paths do the same fp32 FMAs per output element in k order, then the
// same scaling (int8) and bf16 rounding, so a row's result does not depend on the path or on the other
// rows (batch-invariant). The weights' values are exact in fp32, so only that order and the final
// roundings differ from a float32 reference.
#pragma once

#include "linear_common.h"

#include <string>

#if !defined(PDSERVE_HAVE_AVX512BF16) && defined(__AVX2__) && defined(__FMA__)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#define PDSERVE_LINEAR_AVX2 1
// Register tiles: loops over a tile's rows and vectors fully unrolled, or GCC keeps the accumulator array
// on the stack and stores it back every k step.
#define PDSERVE_UNROLL _Pragma("GCC unroll 16")

namespace pdserve_linear::avx2 {

constexpr int64_t kMaxRowsStream = 3;  // streaming tile: 12 accumulators + 2 weight vectors + 2 broadcasts
constexpr int64_t kMaxRowsWide = 6;    // widened tile: 6 rows x 16 columns = 12 accumulators (as BLIS's 6x16)
constexpr int64_t kWidenFrom = 16;     // a block of at least this many rows widens its panel first
constexpr int64_t kChunk = 128;        // k per widened chunk of a panel (a half: kChunk x 64 bytes, in L1)
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead in a panel the streaming tile prefetches
// Bytes of a widened block's fp32 x (rows x K x 4) and chunk: past a 512 KB L2, measured faster on a Zen 3
// host than blocks that fit it (x streams in order from L3 while the chunk sits in L1, and each panel
// comes from DRAM once per block, so fewer blocks read the weights fewer times).
constexpr int64_t kBlockBudget = 1024 << 10;

// A bf16 panel, [K/2][32][2]: one 32-byte load of a k pair of 8 columns is both k as fp32 after one shift
// (even k: the low halves moved up) and one mask (odd k: the high halves as they are).
struct Bf16Panel {
  static constexpr int64_t kPairBytes = 128;  // one k pair of the panel's 32 columns
  const __m256i* w;
  inline const char* bytes() const { return reinterpret_cast<const char*>(w); }
  inline void pair(int64_t kp, int c, __m256& even, __m256& odd) const {
    const __m256i v = _mm256_load_si256(w + 4 * kp + c);
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
};

// An int8 panel in this build's order, [K/2][4][2][8] (`int8_pair_order`): a k pair of 8 columns is 8
// bytes of even k then 8 of odd k, each one sign-extending load and one conversion to fp32.
struct Int8Panel {
  static constexpr int64_t kPairBytes = 64;
  const int8_t* q;
  inline const char* bytes() const { return reinterpret_cast<const char*>(q); }
  inline void pair(int64_t kp, int c, __m256& even, __m256& odd) const {
    const int8_t* p = q + kPairBytes * kp + 16 * c;
    even = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    odd = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
};

// linear_common.h's int8 panels [P][K/2][32][2] -> this build's [P][K/2][4][2][8] (even k of 8 columns,
// then their odd k), so `Int8Panel::pair` needs no shuffles.
inline torch::Tensor int8_pair_order(const torch::Tensor& panels) {
  const int64_t P = panels.size(0), KP = panels.size(1);
  return panels.view({P, KP, 4, 8, 2}).permute({0, 1, 2, 4, 3}).contiguous();
}

// 8 fp32 -> 8 bf16 bit patterns, rounded to nearest even.
inline __m128i to_bf16x8(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  // 32 -> 16 bits per lane (values fit: unsigned saturation never triggers), then the low 8 bytes of
  // each 128-bit half
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
}

// One row's V vectors of 8 accumulators to o as bf16, its first `cols` columns, each first multiplied by
// its column's scale where `s` is given (int8 weights).
template <int V>
inline void store_row(const __m256* acc, const float* s, at::BFloat16* o, int64_t cols) {
  if (cols <= 0) return;
  alignas(16) uint16_t row[8 * V];
  PDSERVE_UNROLL
  for (int c = 0; c < V; ++c) {
    const __m256 v = s ? _mm256_mul_ps(acc[c], _mm256_loadu_ps(s + 8 * c)) : acc[c];
    _mm_store_si128(reinterpret_cast<__m128i*>(row + 8 * c), to_bf16x8(v));
  }
  std::memcpy(o, row, std::min<int64_t>(cols, 8 * V) * sizeof(uint16_t));
}

// Few rows (decode): rows [0, R) of x (fp32, row stride xs) against one panel, all KP k pairs, widened
// in registers, to o as bf16 (the first `cols` columns: fewer on a partial last panel). The weights
// stream from memory once for the R rows.
template <int R, class Panel>
void tile_stream(const float* x, int64_t xs, const Panel& w, int64_t KP, const float* s, at::BFloat16* o, int64_t os,
                 int64_t cols) {
  constexpr int64_t kAhead = kPrefetchBytes / Panel::kPairBytes;
  const char* bytes = w.bytes();
  __m256 acc[R][4];
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    PDSERVE_UNROLL
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t kp = 0; kp < KP; ++kp) {
    PDSERVE_UNROLL
    for (int64_t line = 0; line < Panel::kPairBytes; line += 64)
      _mm_prefetch(bytes + Panel::kPairBytes * (kp + kAhead) + line, _MM_HINT_T0);
    PDSERVE_UNROLL
    for (int c = 0; c < 4; ++c) {
      __m256 w0, w1;
      w.pair(kp, c, w0, w1);
      PDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + 2 * kp), w0, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + 2 * kp + 1), w1, acc[r][c]);
      }
    }
  }
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) store_row<4>(acc[r], s, o + r * os, cols);
}

// k pairs [kp0, kp1) of a panel widened to fp32 rows of 32 columns, wf [2 (kp1 - kp0)][32], for the tiles
// of a block.
template <class Panel>
void widen_panel(const Panel& w, int64_t kp0, int64_t kp1, float* wf) {
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    float* row = wf + 2 * (kp - kp0) * kPanel;
    PDSERVE_UNROLL
    for (int c = 0; c < 4; ++c) {
      __m256 w0, w1;
      w.pair(kp, c, w0, w1);
      _mm256_store_ps(row + 8 * c, w0);
      _mm256_store_ps(row + kPanel + 8 * c, w1);
    }
  }
}

// Many rows (prompts, large batches): rows [0, R) against 16 columns (`half` 0 or 1) of a widened chunk of
// a panel, k in [k0, k0 + kc): wf [kc][32]. The tile's fp32 sums carry over chunks in c [R][32] (this
// half's 16 columns); the last chunk writes o's columns [16 half, 16 half + 16) up to `cols` as bf16.
// Per k: two weight loads, R broadcasts, 2R FMAs; the same fp32 FMAs in the same k order as tile_stream.
template <int R>
void tile_wide(const float* x, int64_t xs, const float* wf, int64_t k0, int64_t kc, bool first, bool last, int half,
               float* c, const float* s, at::BFloat16* o, int64_t os, int64_t cols) {
  __m256 acc[R][2];
  float* cp = c + 16 * half;
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    acc[r][0] = first ? _mm256_setzero_ps() : _mm256_load_ps(cp + r * kPanel);
    acc[r][1] = first ? _mm256_setzero_ps() : _mm256_load_ps(cp + r * kPanel + 8);
  }
  const float* w = wf + 16 * half;
  x += k0;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(w + k * kPanel), w1 = _mm256_load_ps(w + k * kPanel + 8);
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * xs + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    if (last) {
      store_row<2>(acc[r], s ? s + 16 * half : nullptr, o + r * os + 16 * half, cols - 16 * half);
    } else {
      _mm256_store_ps(cp + r * kPanel, acc[r][0]);
      _mm256_store_ps(cp + r * kPanel + 8, acc[r][1]);
    }
  }
}

// out [M, n] bf16 = x [M, K] bf16 times the packed weights: panel(p) gives panel p's `Panel`, `scale`
// (nullptr for bf16 weights) the fp32 scales of the padded columns.
template <class MakePanel>
void linear(const torch::Tensor& x, int64_t KP, int64_t panels, int64_t n, MakePanel panel, const float* scale,
            torch::Tensor& out) {
  const int64_t M = x.size(0);
  const auto xf = x.to(torch::kFloat).contiguous();  // broadcast as fp32: converted once per call
  const float* xp = xf.data_ptr<float>();
  const int64_t xs = xf.stride(0);
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  // Rows per block: near-equal blocks of at most what kBlockBudget allows (at least 24 rows).
  const int64_t K = 2 * KP;
  const int64_t most = std::clamp<int64_t>(((kBlockBudget - kChunk * 128) / (K * 4)) / kMaxRowsWide * kMaxRowsWide,
                                           4 * kMaxRowsWide, kBlockRows);
  const int64_t block = balanced_block_rows(M, most);
  at::parallel_for(0, num_blocks(M, block) * panels, 1, [&](int64_t i0, int64_t i1) {
    // this thread's widened chunk [kChunk][32] and its tiles' running sums [block][32]
    std::unique_ptr<float, decltype(&std::free)> wide(nullptr, &std::free), sums(nullptr, &std::free);
    for (int64_t i = i0; i < i1; ++i) {
      const PanelJob job = panel_job(i, M, n, panels, block);
      const auto wp = panel(job.panel);
      const float* sp = scale ? scale + job.panel * kPanel : nullptr;
      at::BFloat16* op = o + job.panel * kPanel;
      const int64_t cols = std::min(kPanel, n - job.panel * kPanel);
      if (job.rows < kWidenFrom) {
        for_each_tile(job.first, job.rows, [&](int64_t m0, int64_t r) {
          with_rows<kMaxRowsStream>(r, [&](auto R) {
            tile_stream<decltype(R)::value>(xp + m0 * xs, xs, wp, KP, sp, op + m0 * n, n, cols);
          });
        }, kMaxRowsStream);
        continue;
      }
      if (!wide) {
        wide.reset(static_cast<float*>(std::aligned_alloc(32, kChunk * kPanel * sizeof(float))));
        sums.reset(static_cast<float*>(std::aligned_alloc(32, block * kPanel * sizeof(float))));
      }
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        widen_panel(wp, k0 / 2, (k0 + kc) / 2, wide.get());
        for (int half = 0; half < 2 && 16 * half < cols; ++half)
          for_each_tile(job.first, job.rows, [&](int64_t m0, int64_t r) {
            with_rows<kMaxRowsWide>(r, [&](auto R) {
              tile_wide<decltype(R)::value>(xp + m0 * xs, xs, wide.get(), k0, kc, k0 == 0, k0 + kc == K, half,
                                            sums.get() + (m0 - job.first) * kPanel, sp, op + m0 * n, n, cols);
            });
          }, kMaxRowsWide);
      }
    }
  });
}

}  // namespace pdserve_linear::avx2
#endif

namespace pdserve_linear {

// Which instruction set this build's kernels run on ("" where they have none).
inline std::string isa() {
#ifdef PDSERVE_HAVE_AVX512BF16
  return "avx512-bf16";
#elif defined(PDSERVE_LINEAR_AVX2)
  return "avx2-fma";
#else
  return "";
#endif
}

// Whether this build has a kernel at all (AVX-512 BF16 or AVX2 + FMA).
inline bool available() { return !isa().empty(); }

}  // namespace pdserve_linear

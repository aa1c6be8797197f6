// What pdserve's two linear kernels (linear_bf16.cpp: bf16 weights, linear_int8.cpp: int8 weights
// widened to bf16) share: the panel layout and its packing, the split of rows into blocks and register
// tiles, the bf16 output rounding, and the checks on their arguments. Each kernel keeps only its inner
// tile (how a k pair of a panel reaches `vdpbf16ps`) and its prefetch distance.
//
// Layout: W [N, K] is packed once into 32-column panels of k pairs, [N/32][K/2][32][2] (columns past N
// are zero), so a panel is one contiguous stream and each k pair of 32 columns is what two `vdpbf16ps`
// take against one broadcast k pair of a row of x. Rows come in blocks of 192 whose x stays in L2 while
// the panels pass over it; a block's rows are cut into register tiles of at most 12 rows (24 fp32
// accumulators), of near-equal size (16 = 8 + 8, not 12 + 4).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace pdserve_linear {

constexpr int64_t kPanel = 32;       // output columns per panel (two vectors)
constexpr int64_t kMaxRows = 12;     // rows per register tile
constexpr int64_t kBlockRows = 192;  // rows per block: x of a block stays in L2 while the panels pass

// w [N, K] of `dtype`, K even -> [ceil(N/32), K/2, 32, 2], zero-padded to whole panels; 64-byte aligned
// by torch's CPU allocator (the kernels' aligned loads rely on it).
inline torch::Tensor pack_panels(const torch::Tensor& w, c10::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype && w.size(1) % 2 == 0, "w must be [N, K] ",
              c10::toString(dtype), ", K even");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bf16 on the CPU against a packed W of `dtype` for n output columns; returns x with unit
// column stride and an even row stride (one k pair = one int32), copying only where it must.
inline torch::Tensor check_args(torch::Tensor x, const torch::Tensor& packed, int64_t n, c10::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(), "x must be a 2-D bf16 CPU tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == dtype && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.size(1) * 2 == x.size(1) && n > (packed.size(0) - 1) * kPanel && n <= packed.size(0) * kPanel,
              "packed weight does not match x / n");
  if (x.stride(1) != 1 || x.stride(0) % 2 != 0) x = x.contiguous();
  return x;
}

// Work item i of blocks x panels (at::parallel_for's index): the block's rows, the panel, and the masks
// of its valid columns (a partial last panel).
struct PanelJob {
  int64_t first, rows, panel;
  uint16_t keep0, keep1;
};

// The masks of panel p's valid columns of n, per 16-column half (all set but on a partial last panel).
inline std::pair<uint16_t, uint16_t> panel_masks(int64_t p, int64_t n) {
  const int64_t cols = std::min(kPanel, n - p * kPanel);
  return {static_cast<uint16_t>((1u << std::min<int64_t>(cols, 16)) - 1u),
          static_cast<uint16_t>(cols > 16 ? (1u << (cols - 16)) - 1u : 0u)};
}

inline PanelJob panel_job(int64_t i, int64_t M, int64_t n, int64_t panels, int64_t block_rows = kBlockRows) {
  const int64_t b = i / panels, p = i % panels, first = b * block_rows;
  const auto [k0, k1] = panel_masks(p, n);
  return {first, std::min(block_rows, M - first), p, k0, k1};
}

inline int64_t num_blocks(int64_t M, int64_t block_rows = kBlockRows) { return (M + block_rows - 1) / block_rows; }

// Rows per block for M rows in blocks of at most `max_rows`: near-equal blocks, so the threads' even
// shares of blocks x panels are even shares of the work (blocks of 192 + 64 rows would give one of two
// threads three times the other's).
inline int64_t balanced_block_rows(int64_t M, int64_t max_rows = kBlockRows) {
  const int64_t blocks = std::max<int64_t>(1, num_blocks(M, max_rows));
  return (M + blocks - 1) / blocks;
}

inline int64_t num_tiles(int64_t rows, int64_t max_rows = kMaxRows) { return (rows + max_rows - 1) / max_rows; }

// f(m0, r) for each register tile (of at most `max_rows` rows) of a block's rows [first, first + rows):
// near-equal tiles in order.
template <class F>
inline void for_each_tile(int64_t first, int64_t rows, F&& f, int64_t max_rows = kMaxRows) {
  const int64_t tiles = num_tiles(rows, max_rows), base = rows / tiles, extra = rows % tiles;
  for (int64_t t = 0, m0 = first; t < tiles; ++t) {
    const int64_t r = base + (t < extra ? 1 : 0);
    f(m0, r);
    m0 += r;
  }
}

// f(std::integral_constant<int, rows>{}) for 1 <= rows <= R: a tile's row count as a compile-time
// constant, so its accumulators stay in registers.
template <int R, class F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

}  // namespace pdserve_linear

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_HAVE_AVX512BF16 1

namespace pdserve_linear {

// 16 fp32 -> bf16, rounded to nearest even, stored where `keep` says.
inline void store_bf16x16(at::BFloat16* o, __m512 v, __mmask16 keep) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_mask_storeu_epi16(o, keep, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

}  // namespace pdserve_linear
#endif

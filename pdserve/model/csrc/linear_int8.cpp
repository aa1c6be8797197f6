// y = (x Q^T) * scale for bf16 activations x and int8 weights Q quantized per output channel (symmetric:
// W[n, :] ~ scale[n] * Q[n, :]), on CPUs with AVX-512 BF16. Decode steps stream every weight from DRAM,
// so one byte per weight instead of two is the point; the arithmetic stays bf16 x bf16 -> fp32.
//
// Q is packed once into the bf16 kernel's layout (linear_bf16.cpp) at one byte per element:
// 32-column panels of k pairs, [N/32][K/2][32][2] int8, so one k pair of a panel is 64 contiguous bytes.
// Each such slice is widened (int8 -> int32 -> fp32 -> bf16: exact, |q| <= 127 fits bf16's 8 significant
// bits) into the two bf16 vectors that `vdpbf16ps` takes as they are, and shared by up to 12 rows of x
// (24 fp32 accumulators). With one row tile (<= 12 rows: decode) the widening happens in registers as Q
// streams in; with more, each panel is widened once into an L2-resident bf16 scratch that all the
// block's row tiles read (widening per tile would make the kernel compute-bound: 10 ops per 64 bytes).
// The per-channel scale multiplies the fp32 sums once at the end. Q is prefetched 8 KB ahead in the
// panel; rows come in blocks of 192 that stay in L2 (as in the bf16 kernel).
// Accumulation order per output element is fixed, so a row's result does not depend on the other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace {
constexpr int64_t kPanel = 32;       // output columns per panel (two vectors)
constexpr int64_t kMaxRows = 12;     // rows per register tile
constexpr int64_t kPrefetch = 128;   // k pairs ahead that Q is prefetched (8 KB of a panel)
constexpr int64_t kBlockRows = 192;  // rows per block: x of a block stays in L2 while the panels pass
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

// 32 int8 (16 columns x one k pair) -> the bf16 vector vdpbf16ps pairs with a broadcast x pair.
// vcvtne2ps2bf16(a, b) puts b in the low 16 elements, a in the high 16.
inline __m512bh widen(const int8_t* q) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// Where a tile reads its bf16 weight vectors from: the int8 panel itself, widened on the fly (one row
// tile per panel: decode), or a bf16 copy of the panel widened once for all the block's row tiles.
struct FromInt8 {
  const int8_t* q;
  inline void load(int64_t kp, __m512bh& w0, __m512bh& w1) const {
    _mm_prefetch(reinterpret_cast<const char*>(q + 64 * (kp + kPrefetch)), _MM_HINT_T0);
    w0 = widen(q + 64 * kp);
    w1 = widen(q + 64 * kp + 32);
  }
};

struct FromBf16 {
  const __m512i* w;
  inline void load(int64_t kp, __m512bh& w0, __m512bh& w1) const {
    w0 = (__m512bh)_mm512_load_si512(w + 2 * kp);
    w1 = (__m512bh)_mm512_load_si512(w + 2 * kp + 1);
  }
};

// A panel's KP k pairs widened to bf16 into `out` (2 vectors per k pair): K * 64 bytes, in L2.
inline void widen_panel(const int8_t* q, int64_t KP, __m512i* out) {
  for (int64_t kp = 0; kp < KP; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(q + 64 * (kp + kPrefetch)), _MM_HINT_T0);
    _mm512_store_si512(out + 2 * kp, (__m512i)widen(q + 64 * kp));
    _mm512_store_si512(out + 2 * kp + 1, (__m512i)widen(q + 64 * kp + 32));
  }
}

// Rows [0, R) of x (int32 = one bf16 k pair, row stride xs) against one panel (KP k pairs), to o as bf16
// after scaling by s (the panel's 32 scales; columns masked by keep0/keep1 on a partial last panel). The
// same arithmetic whichever `W` supplies the weights, so a row's bits do not depend on the path.
template <int R, class W>
void tile(const int32_t* x, int64_t xs, const W& w, int64_t KP, const float* s, at::BFloat16* o, int64_t os,
          __mmask16 keep0, __mmask16 keep1) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    __m512bh w0, w1;
    w.load(kp, w0, w1);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[r * xs + kp]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
    }
  }
  const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
  for (int r = 0; r < R; ++r) {
    store_bf16x16(o + r * os, _mm512_mul_ps(acc[r][0], s0), keep0);
    store_bf16x16(o + r * os + 16, _mm512_mul_ps(acc[r][1], s1), keep1);
  }
}

template <int R, class W>
void run_tile(const int32_t* x, int64_t xs, const W& w, int64_t KP, const float* s, at::BFloat16* o, int64_t os,
              __mmask16 k0, __mmask16 k1, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return run_tile<R - 1>(x, xs, w, KP, s, o, os, k0, k1, rows);
  }
  tile<R>(x, xs, w, KP, s, o, os, k0, k1);
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

// q [N, K] int8, K even -> [ceil(N/32), K/2, 32, 2] (columns past N are zero). 64-byte aligned by torch's
// CPU allocator, which the 16-byte aligned loads of `widen` rely on.
torch::Tensor pack(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.size(1) % 2 == 0, "q must be [N, K] int8, K even");
  const int64_t N = q.size(0), K = q.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, q.options());
  padded.narrow(0, 0, N).copy_(q);
  return padded.view({panels, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bf16 (rows may be strided) times the packed Q of n output columns, scaled per column by
// `scale` (fp32, padded to the panels' width) -> [M, n] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t n) {
#ifdef PDSERVE_HAVE_AVX512BF16
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(), "x must be a 2-D bf16 CPU tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kChar && packed.size(2) == kPanel &&
                  packed.is_contiguous() && packed.size(1) * 2 == x.size(1) && n > (packed.size(0) - 1) * kPanel &&
                  n <= packed.size(0) * kPanel,
              "packed weight does not match x / n");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == packed.size(0) * kPanel,
              "scale must be fp32, one per padded column");
  if (x.stride(1) != 1 || x.stride(0) % 2 != 0) x = x.contiguous();
  const int64_t M = x.size(0), KP = packed.size(1), panels = packed.size(0);
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0) / 2;
  const int8_t* q = packed.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks * panels, 1, [&](int64_t i0, int64_t i1) {
    // A block of more rows than one tile widens each panel once, into this thread's scratch.
    std::unique_ptr<__m512i[], decltype(&std::free)> scratch(nullptr, &std::free);
    if (M > kMaxRows) scratch.reset(static_cast<__m512i*>(std::aligned_alloc(64, KP * 2 * sizeof(__m512i))));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / panels, p = i % panels, first = b * kBlockRows, rows = std::min(kBlockRows, M - first);
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      const auto k0 = static_cast<__mmask16>((1u << std::min<int64_t>(cols, 16)) - 1u);
      const auto k1 = static_cast<__mmask16>(cols > 16 ? (1u << (cols - 16)) - 1u : 0u);
      const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows, base = rows / tiles, extra = rows % tiles;
      const int8_t* qp = q + p * KP * 64;
      if (tiles == 1) {
        run_tile<kMaxRows>(xp + first * xs, xs, FromInt8{qp}, KP, s + p * kPanel, o + first * n + p * kPanel, n, k0,
                           k1, rows);
        continue;
      }
      widen_panel(qp, KP, scratch.get());
      for (int64_t t = 0, m0 = first; t < tiles; ++t) {
        const int64_t r = base + (t < extra ? 1 : 0);
        run_tile<kMaxRows>(xp + m0 * xs, xs, FromBf16{scratch.get()}, KP, s + p * kPanel, o + m0 * n + p * kPanel, n,
                           k0, k1, r);
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
  m.def("available", &available, "whether this build has the AVX-512 BF16 int8-weight kernel");
  m.def("pack", &pack, "pack [N, K] int8 weights into 32-column panels of k pairs");
  m.def("linear", &linear, "x @ (scale * Q)^T from packed Q, bf16 activations");
}

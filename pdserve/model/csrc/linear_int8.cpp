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
//
// On a CPU with AVX2 and FMA but no AVX-512 BF16, the panels are reordered once ([K/2][4][2][8]: a k pair
// of 8 columns as 8 bytes of even k, then 8 of odd k) and read by the AVX2 bf16 kernel's fp32 tiles
// (linear_avx2.h): each 8 bytes one sign-extending load and one int32 -> fp32 conversion (exact), the
// per-column scale applied to the fp32 sums before the bf16 rounding.
#include "linear_avx2.h"
#include "linear_common.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <memory>
#include <string>

using namespace pdserve_linear;

namespace {
constexpr int64_t kPrefetch = 128;  // k pairs ahead that Q is prefetched (8 KB of a panel)
}  // namespace

#ifdef PDSERVE_HAVE_AVX512BF16
namespace {

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

}  // namespace
#endif

// q [N, K] int8, K even -> [ceil(N/32), K/2, 32, 2] (columns past N are zero; the AVX2 build's
// [ceil(N/32), K/2, 4, 2, 8]). 64-byte aligned by torch's
// CPU allocator, which the 16-byte aligned loads of `widen` rely on.
torch::Tensor pack(torch::Tensor q) {
#ifdef PDSERVE_LINEAR_AVX2
  return avx2::int8_pair_order(pack_panels(q, torch::kChar));
#else
  return pack_panels(q, torch::kChar);
#endif
}

// x [M, K] bf16 (rows may be strided) times the packed Q of n output columns, scaled per column by
// `scale` (fp32, padded to the panels' width) -> [M, n] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t n) {
#ifdef PDSERVE_HAVE_AVX512BF16
  x = check_args(x, packed, n, torch::kChar);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == packed.size(0) * kPanel,
              "scale must be fp32, one per padded column");
  const int64_t M = x.size(0), KP = packed.size(1), panels = packed.size(0);
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0) / 2;
  const int8_t* q = packed.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t block = balanced_block_rows(M);
  at::parallel_for(0, num_blocks(M, block) * panels, 1, [&](int64_t i0, int64_t i1) {
    // A block of more rows than one tile widens each panel once, into this thread's scratch.
    std::unique_ptr<__m512i[], decltype(&std::free)> scratch(nullptr, &std::free);
    if (M > kMaxRows) scratch.reset(static_cast<__m512i*>(std::aligned_alloc(64, KP * 2 * sizeof(__m512i))));
    for (int64_t i = i0; i < i1; ++i) {
      const PanelJob job = panel_job(i, M, n, panels, block);
      const int8_t* qp = q + job.panel * KP * 64;
      const float* sp = s + job.panel * kPanel;
      if (num_tiles(job.rows) == 1) {
        with_rows<kMaxRows>(job.rows, [&](auto R) {
          tile<decltype(R)::value>(xp + job.first * xs, xs, FromInt8{qp}, KP, sp, o + job.first * n + job.panel * kPanel,
                                   n, job.keep0, job.keep1);
        });
        continue;
      }
      widen_panel(qp, KP, scratch.get());
      const FromBf16 wide{scratch.get()};
      for_each_tile(job.first, job.rows, [&](int64_t m0, int64_t r) {
        with_rows<kMaxRows>(r, [&](auto R) {
          tile<decltype(R)::value>(xp + m0 * xs, xs, wide, KP, sp, o + m0 * n + job.panel * kPanel, n, job.keep0,
                                   job.keep1);
        });
      });
    }
  });
  return out;
#elif defined(PDSERVE_LINEAR_AVX2)
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 4 && packed.size(3) == 2 && packed.size(4) == 8,
              "packed weight is not this build's int8 layout");
  x = check_args(x, packed.view({packed.size(0), packed.size(1), kPanel, 2}), n, torch::kChar);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == packed.size(0) * kPanel,
              "scale must be fp32, one per padded column");
  const int64_t M = x.size(0), KP = packed.size(1), panels = packed.size(0);
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  const int8_t* q = packed.data_ptr<int8_t>();
  avx2::linear(x, KP, panels, n, [q, KP](int64_t p) { return avx2::Int8Panel{q + p * KP * 64}; },
               scale.data_ptr<float>(), out);
  return out;
#else
  TORCH_CHECK(false, "built without AVX-512 BF16 or AVX2 + FMA");
  return x;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has a kernel (AVX-512 BF16 or AVX2 + FMA)");
  m.def("isa", &isa, "the instruction set of this build's kernel");
  m.def("pack", &pack, "pack [N, K] int8 weights into 32-column panels of k pairs");
  m.def("linear", &linear, "x @ (scale * Q)^T from packed Q, bf16 activations");
}

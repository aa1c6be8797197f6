// y = (x Q^T) * scale for bf16 activations x and int8 weights Q quantized per output channel (symmetric:
// W[n, :] ~ scale[n] * Q[n, :]), on CPUs with AVX-512 BF16. Decode steps stream every weight from DRAM,
// so one byte per weight instead of two is the point.
//
// Q is packed once into the bf16 kernel's layout (linear_bf16.cpp) at one byte per element:
// 32-column panels of k pairs, [N/32][K/2][32][2] int8, so one k pair of a panel is 64 contiguous bytes.
// The arithmetic is in integers: each row of x is rounded once per call to int16 steps of its largest
// value (max|x| / 32767: 15 bits, finer than bf16's 8 significant bits for every element above 1/128 of
// the row's largest), each 32-byte half of a k pair sign-extends to 16 int16 pairs in one instruction,
// and vpdpwssd adds both products of a pair against the row's broadcast k pair to an int32 sum per
// column: 32 multiply-adds per instruction, as vdpbf16ps does, where widening int8 to bf16 took five
// instructions per 32 weights (the kernel was compute-bound from 8 rows: 0.84-0.92x the bf16 kernel at
// 8-64 rows on host G, now 0.98-1.7x). The int32 sums are exact over runs of kChunk k pairs and join
// fp32 sums run by run; the column scale times the row's step multiplies them once at the end. Tiles of
// up to kTileRows rows (2 x 8 int32 accumulators; GCC kept 12 rows' in registers only in part). Q is
// prefetched 8 KB ahead in the panel; rows come in blocks of 192 that stay in L2 (as in the bf16
// kernel). A row's rounding is its own and the order of the sums fixed, so a row's result does not
// depend on the other rows.
//
// On a CPU with AVX2 and FMA but no AVX-512 BF16, the panels are reordered once ([K/2][4][2][8]: a k pair
// of 8 columns as 8 bytes of even k, then 8 of odd k) and read by the AVX2 bf16 kernel's fp32 tiles
// (linear_avx2.h): each 8 bytes one sign-extending load and one int32 -> fp32 conversion (exact), the
// per-column scale applied to the fp32 sums before the bf16 rounding.
#include "linear_amx.h"
#include "linear_avx2.h"
#include "linear_common.h"

#include <ATen/Parallel.h>

#include <limits>

using namespace pdserve_linear;

namespace {
constexpr int64_t kPrefetch = 128;  // k pairs ahead that Q is prefetched (8 KB of a panel)
}  // namespace

#ifdef PDSERVE_HAVE_AVX512BF16
namespace {

constexpr int kTileRows = 8;
constexpr int64_t kChunk = 256;  // k pairs summed in int32 before joining the fp32 sums: 512 * 32767 * 127 < 2^31

// One k pair of 16 columns (32 int8) widened to the 16 int16 pairs vpdpwssd takes: one instruction.
inline __m512i widen16(const int8_t* q) {
  return _mm512_cvtepi8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(q)));
}

// acc + w.lo * x.lo + w.hi * x.hi per int32 lane (vpdpwssd; AVX512BW's two-instruction form elsewhere).
inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__) && defined(__GNUC__)
  // As an asm statement: GCC 12 compiles the intrinsic with a register copy of the accumulator in and
  // out of every instruction (twice the instructions of the loop, 0.46-0.65x the bf16 kernel's speed).
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
#elif defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// One run of k pairs [k0, k1) of rows [0, R) against panel q, its exact int32 sums added to sums [R][32].
template <int R>
__attribute__((always_inline)) inline void dot_run(const int32_t* __restrict xq, int64_t xs, const int8_t* __restrict q,
                                                   int64_t k0, int64_t k1, float (*__restrict sums)[kPanel]) {
  __m512i lo[R], hi[R];  // columns 0-15, 16-31
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
  for (int64_t kp = k0; kp < k1; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(q + 64 * (kp + kPrefetch)), _MM_HINT_T0);
    const __m512i w0 = widen16(q + 64 * kp), w1 = widen16(q + 64 * kp + 32);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(xq[r * xs + kp]);
      lo[r] = dot_pairs(lo[r], w0, xb);
      hi[r] = dot_pairs(hi[r], w1, xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(sums[r], _mm512_add_ps(_mm512_load_ps(sums[r]), _mm512_cvtepi32_ps(lo[r])));
    _mm512_store_ps(sums[r] + 16, _mm512_add_ps(_mm512_load_ps(sums[r] + 16), _mm512_cvtepi32_ps(hi[r])));
  }
}

// Rows [0, R) of the int16 activations xq (int32 = one k pair, row stride xs; row r's step xstep[r])
// against one panel q (KP k pairs), to o as bf16 after scaling by s (the panel's 32 column scales; columns
// masked by keep0/keep1 on a partial last panel). Exact int32 sums over runs of kChunk k pairs, added to
// fp32 sums (in L1) run by run: the order is fixed, so a row's bits do not depend on the other rows.
template <int R>
void tile(const int32_t* xq, int64_t xs, const float* xstep, const int8_t* q, int64_t KP, const float* s,
          at::BFloat16* o, int64_t os, __mmask16 keep0, __mmask16 keep1) {
  alignas(64) float sums[R][kPanel] = {};
  for (int64_t k0 = 0; k0 < KP; k0 += kChunk) dot_run<R>(xq, xs, q, k0, std::min(KP, k0 + kChunk), sums);
  const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
  for (int r = 0; r < R; ++r) {
    const __m512 step = _mm512_set1_ps(xstep[r]);
    store_bf16x16(o + r * os, _mm512_mul_ps(_mm512_load_ps(sums[r]), _mm512_mul_ps(s0, step)), keep0);
    store_bf16x16(o + r * os + 16, _mm512_mul_ps(_mm512_load_ps(sums[r] + 16), _mm512_mul_ps(s1, step)), keep1);
  }
}

// One row of x (K bf16) -> xq (K int16) in steps of max|x| / 32767 (round to nearest; an all-zero row
// gets step 0), the step into *xstep: 15 bits of the row's largest value, finer than bf16's 8 significant
// bits for every element above 1/128 of it. A row holding inf or NaN gets step NaN, so its outputs are
// NaN as the bf16 kernel's would be (max would drop a NaN, and the int16 values would be finite garbage).
void quantize_row(const at::BFloat16* x, int64_t K, int16_t* xq, float* xstep) {
  const auto load = [&](int64_t k, __mmask16 live) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, x + k)), 16));
  };
  const __mmask16 tail = static_cast<__mmask16>((1u << (K % 16)) - 1u);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 mx = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 a = _mm512_abs_ps(load(k, K - k >= 16 ? 0xFFFF : tail));
    mx = _mm512_max_ps(mx, a);
    bad |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ);  // inf or NaN
  }
  const float amax = _mm512_reduce_max_ps(mx);
  *xstep = bad ? std::numeric_limits<float>::quiet_NaN() : amax / 32767.f;
  const __m512 inv = _mm512_set1_ps(amax > 0.f && !bad ? 32767.f / amax : 0.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 live = K - k >= 16 ? 0xFFFF : tail;
    _mm256_mask_storeu_epi16(xq + k, live, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(load(k, live), inv))));
  }
}

}  // namespace
#endif

namespace {

// The column scales of a packed Q: fp32, one per padded column.
void check_scale(const torch::Tensor& scale, const torch::Tensor& packed) {
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == packed.size(0) * kPanel,
              "scale must be fp32, one per padded column");
}

}  // namespace

// q [N, K] int8, K even -> [ceil(N/32), K/2, 32, 2] (columns past N are zero; the AVX2 build's
// [ceil(N/32), K/2, 4, 2, 8]). 64-byte aligned by torch's CPU allocator, which the 32-byte aligned loads
// of `widen16` rely on.
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
  check_scale(scale, packed);
  const int64_t M = x.size(0), K = x.size(1), KP = packed.size(1), panels = packed.size(0);
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kShort));
  auto xstep = torch::empty({M}, x.options().dtype(torch::kFloat));
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  int16_t* xqp = xq.data_ptr<int16_t>();
  float* xsp = xstep.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * x.stride(0), K, xqp + m * K, xsp + m);
  });
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(xqp);
  const int8_t* q = packed.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t block = balanced_block_rows(M);
  at::parallel_for(0, num_blocks(M, block) * panels, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const PanelJob job = panel_job(i, M, n, panels, block);
      const int8_t* qp = q + job.panel * KP * 64;
      for_each_tile(job.first, job.rows, [&](int64_t m0, int64_t r) {
        with_rows<kTileRows>(r, [&](auto R) {
          tile<decltype(R)::value>(xpairs + m0 * KP, KP, xsp + m0, qp, KP, s + job.panel * kPanel,
                                   o + m0 * n + job.panel * kPanel, n, job.keep0, job.keep1);
        });
      }, kTileRows);
    }
  });
  return out;
#elif defined(PDSERVE_LINEAR_AVX2)
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 4 && packed.size(3) == 2 && packed.size(4) == 8,
              "packed weight is not this build's int8 layout");
  x = check_args(x, packed.view({packed.size(0), packed.size(1), kPanel, 2}), n, torch::kChar);
  check_scale(scale, packed);
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

#ifdef PDSERVE_LINEAR_AMX
namespace {

// An int8 panel (count weights) widened to the bf16 panel of the same layout: exact, |q| <= 127.
void widen_panel(const int8_t* q, at::BFloat16* out, int64_t count) {
  for (int64_t i = 0; i < count; i += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + i))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + i + 16))));
    _mm512_store_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// int8 panels and their column scales for amx::linear: each widened into the thread's scratch.
struct Int8Panels {
  static constexpr bool kWidens = true;
  const int8_t* q;
  const float* s;
  int64_t count, stored_lines;  // weights per panel, its cache lines
  const char* stored(int64_t p) const { return reinterpret_cast<const char*>(q + p * count); }
  const char* bf16(int64_t p, char* scratch) const {
    widen_panel(q + p * count, reinterpret_cast<at::BFloat16*>(scratch), count);
    return scratch;
  }
  const float* scales(int64_t p) const { return s + p * kPanel; }
};

}  // namespace
#endif

// x [M, K] bf16 times the packed Q of n output columns (the layout `linear` reads, so both share one
// copy), scaled per column -> [M, n] bf16 on AMX BF16 tiles (K a multiple of 32; linear_amx.h): each
// panel is widened to bf16 once per call into the thread's L2 (~7 ms a pass over SmolLM2's weights on host
// H, whatever the rows), so prompt chunks and large decode batches run at about the bf16 AMX rate while
// the panels stream from DRAM at one byte per weight. x is used as it is (no int16 rounding as in
// `linear`); a row's result does not depend on the other rows.
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t n) {
#ifdef PDSERVE_LINEAR_AMX
  x = check_args(x, packed, n, torch::kChar);
  check_scale(scale, packed);
  const int64_t K = x.size(1);
  const Int8Panels src{packed.data_ptr<int8_t>(), scale.data_ptr<float>(), K * kPanel, K / 2};
  return amx::linear(x, packed.size(0), n, src);
#else
  TORCH_CHECK(false, "built without AMX BF16");
  return x;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has a kernel (AVX-512 BF16 or AVX2 + FMA)");
  m.def("isa", &isa, "the instruction set of this build's kernel");
  m.def("pack", &pack, "pack [N, K] int8 weights into 32-column panels of k pairs");
  m.def("linear", &linear, "x @ (scale * Q)^T from packed Q, bf16 activations");
  m.def("amx_available", &amx_available, "whether this build and CPU run linear_amx");
  m.def("linear_amx", &linear_amx, "x @ (scale * Q)^T from packed Q on AMX BF16 tiles (K a multiple of 32)");
}

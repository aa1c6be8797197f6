// The sampler's kernels for CPUs (pdserve/runner/kernels.py chooses them against torch's ops by
// measurement), each for AVX-512 (F, BW, VL; 16 tokens a vector) and for AVX2 + FMA (8 tokens; AMD EPYC
// Zen 3 and other CPUs without AVX-512), whichever this build has (-march=native); `isa` picks one, so an
// AVX-512 build tests and times the AVX2 path too. Without either the caller keeps torch's ops.
// - Structured outputs' token masks straight from their packed bits (bit t % 32 of 32-bit word t / 32
//   allows token t), one pass over the logits: the torch sequence (look the bits up, widen the logits, add
//   a 0 / -inf row, argmax) makes four passes over [rows, vocab] float32.
// - A draw from softmax(logits / T) by inverse CDF without a [rows, vocab] tensor: the row's max, the sum
//   of exp((x - max) / T) kept per block of tokens, then the running sum over the blocks and inside the
//   one block where it passes u x that sum (scan_cdf); torch's way writes the widened,
//   divided, softmaxed and cumulated rows (four [rows, vocab] float32 tensors).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_HAVE_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PDSERVE_HAVE_AVX512 1
#endif

namespace {

// The inverse-CDF search both instruction sets share, over chunks of W tokens in blocks of kBlockChunks
// chunks. The sum pass (`block_sums`) keeps each block's total (`sums`, one per block) and returns the
// row's, added block by block in order; the search then runs over the block totals and opens only the
// block where the running sum first passes `target`: its chunks (`chunk_probs(c, e)` writes chunk c's W
// unnormalised probabilities into e and returns their sum) up to the token whose running sum passes it.
// A target the running sum never passes (u near 1, or within rounding of a block's end) gives the last
// token of nonzero probability before it. Every probability is computed once for the total and once more
// for one block only, where a scan of the whole row computed them all twice (1.3-1.8x on a draw of 1 or
// 96 rows of 49k or 152k tokens, host H).
constexpr int64_t kBlockChunks = 16;

template <int W, class ChunkProbs>
int64_t scan_cdf(int64_t chunks, const std::vector<float>& sums, float target, ChunkProbs chunk_probs) {
  float run = 0.f;
  int64_t open = -1, last_block = -1;
  for (int64_t b = 0; b < static_cast<int64_t>(sums.size()); ++b) {
    if (sums[b] <= 0.f) continue;
    last_block = b;
    if (run + sums[b] > target) {
      open = b;
      break;
    }
    run += sums[b];
  }
  if (open < 0) {  // never passed: the last nonzero token of the last nonzero block
    if (last_block < 0) return 0;
    open = last_block;
    target = std::numeric_limits<float>::infinity();
  }
  int64_t last = open * kBlockChunks * W;
  alignas(64) float e[W];
  for (int64_t c = open * kBlockChunks; c < std::min(chunks, (open + 1) * kBlockChunks); ++c) {
    const float s = chunk_probs(c, e);
    if (s <= 0.f) continue;
    if (run + s > target) {
      for (int j = 0; j < W; ++j) {
        run += e[j];
        if (run > target) return c * W + j;
      }
    } else {
      run += s;
    }
    for (int j = W - 1; j >= 0; --j)
      if (e[j] > 0.f) { last = c * W + j; break; }
  }
  return last;
}

// The sum pass: `probs(c)` summed per block of kBlockChunks chunks into `sums` (reduce(v) a vector's
// sum); returns the row's total, the blocks' totals added in order (as scan_cdf runs over them).
template <class Vec, class Probs, class Reduce>
float block_sums(int64_t chunks, std::vector<float>& sums, Vec zero, Probs probs, Reduce reduce) {
  sums.resize((chunks + kBlockChunks - 1) / kBlockChunks);
  float total = 0.f;
  for (int64_t b = 0; b < static_cast<int64_t>(sums.size()); ++b) {
    Vec acc = zero;
    for (int64_t c = b * kBlockChunks; c < std::min(chunks, (b + 1) * kBlockChunks); ++c) acc = acc + probs(c);
    sums[b] = reduce(acc);
    total += sums[b];
  }
  return total;
}

#ifdef PDSERVE_HAVE_AVX512
namespace avx512 {
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_tail(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_tail(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The first allowed token of the row with the largest logit (NaN counts as the largest, as torch's max);
// 0 when the mask allows nothing (the index torch's max gives a row of -inf). kMasked false: every token
// allowed and `bits` never read (greedy without a grammar: torch's max(dim=-1).indices).
template <typename T, bool kMasked = true>
int64_t masked_argmax_row(const T* __restrict__ x, const uint32_t* __restrict__ bits, int64_t V) {
  const auto allowed = [bits](int64_t c) {
    return kMasked ? static_cast<__mmask16>(bits[c >> 1] >> ((c & 1) * 16)) : static_cast<__mmask16>(0xFFFF);
  };
  const float ninf = -std::numeric_limits<float>::infinity();
  __m512 best = _mm512_set1_ps(ninf);
  const int64_t full = V / 16;
  for (int64_t c = 0; c < full; ++c) {
    const __mmask16 m = allowed(c);
    if (!m) continue;
    const __m512 v = load16(x + c * 16);
    if (_mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q)) {  // a NaN: the first allowed one wins
      const __mmask16 nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
      return c * 16 + __builtin_ctz(nan);
    }
    best = _mm512_mask_max_ps(best, m, best, v);
  }
  const int64_t rest = V - full * 16;
  __mmask16 tail_m = 0;
  __m512 tail_v = _mm512_set1_ps(ninf);
  if (rest) {
    tail_m = static_cast<__mmask16>(allowed(full) & ((1u << rest) - 1));
    tail_v = load_tail(x + full * 16, static_cast<__mmask16>((1u << rest) - 1));
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(tail_m, tail_v, tail_v, _CMP_UNORD_Q);
    if (nan) return full * 16 + __builtin_ctz(nan);
    best = _mm512_mask_max_ps(best, tail_m, best, tail_v);
  }
  const float top = _mm512_reduce_max_ps(best);
  const __m512 topv = _mm512_set1_ps(top);
  for (int64_t c = 0; c < full; ++c) {
    const __mmask16 m = allowed(c);
    if (!m) continue;
    const __mmask16 eq = _mm512_mask_cmp_ps_mask(m, load16(x + c * 16), topv, _CMP_EQ_OQ);
    if (eq) return c * 16 + __builtin_ctz(eq);
  }
  if (rest) {
    const __mmask16 eq = _mm512_mask_cmp_ps_mask(tail_m, tail_v, topv, _CMP_EQ_OQ);
    if (eq) return full * 16 + __builtin_ctz(eq);
  }
  return 0;  // nothing allowed
}

void apply_row(float* __restrict__ x, const uint32_t* __restrict__ bits, int64_t V) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t full = V / 16;
  for (int64_t c = 0; c < full; ++c) {
    const __mmask16 m = static_cast<__mmask16>(bits[c >> 1] >> ((c & 1) * 16));
    if (m == 0xFFFF) continue;
    _mm512_mask_storeu_ps(x + c * 16, static_cast<__mmask16>(~m), ninf);
  }
  const int64_t rest = V - full * 16;
  if (rest) {
    const __mmask16 m = static_cast<__mmask16>(bits[full >> 1] >> ((full & 1) * 16));
    _mm512_mask_storeu_ps(x + full * 16, static_cast<__mmask16>(~m & ((1u << rest) - 1)), ninf);
  }
}

// exp(x) for 16 float32 lanes: x = n ln2 + r (Cody-Waite), exp(r) by its degree-7 Taylor polynomial,
// times 2^n by vscalefps (overflow inf, underflow 0); the polynomial of fused_ops.cpp's exp_ps.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9841270e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3888889e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The token t with the first running sum of p_0 .. p_t above u * sum(p), p = exp((x - max) / T) (torch's
// searchsorted(cumsum, u * total, right=True)); the first NaN if the row has one; 0 if the row is all -inf.
template <typename T>
int64_t sample_row(const T* __restrict__ x, int64_t V, float inv_t, float u) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t full = V / 16, rest = V - full * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << rest) - 1);
  auto chunk = [&](int64_t c) { return c < full ? load16(x + c * 16) : load_tail(x + c * 16, tail); };
  const int64_t chunks = full + (rest ? 1 : 0);
  __m512 mx = _mm512_set1_ps(ninf);
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 live = c < full ? static_cast<__mmask16>(0xFFFF) : tail;
    const __m512 v = chunk(c);
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
    if (nan) return c * 16 + __builtin_ctz(nan);
    mx = _mm512_mask_max_ps(mx, live, mx, v);
  }
  const float m = _mm512_reduce_max_ps(mx);
  if (m == ninf) return 0;
  const __m512 mv = _mm512_set1_ps(m), it = _mm512_set1_ps(inv_t);
  // exp((x - m) / T), exactly 0 for -inf (a masked token) and wherever it would be below e^-103 (the
  // polynomial's input is clamped there: exp16(-inf) would be NaN)
  const __m512 lo = _mm512_set1_ps(-103.f);
  auto probs = [&](int64_t c) {
    const __mmask16 live = c < full ? static_cast<__mmask16>(0xFFFF) : tail;
    const __m512 arg = _mm512_mul_ps(_mm512_sub_ps(chunk(c), mv), it);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(live, arg, lo, _CMP_GT_OQ);
    return _mm512_maskz_mov_ps(keep, exp16(_mm512_max_ps(arg, lo)));
  };
  thread_local std::vector<float> sums;
  const float total = block_sums(chunks, sums, _mm512_setzero_ps(), probs, [](__m512 v) { return _mm512_reduce_add_ps(v); });
  return scan_cdf<16>(chunks, sums, u * total, [&](int64_t c, float* e) {
    const __m512 p = probs(c);
    _mm512_store_ps(e, p);
    return _mm512_reduce_add_ps(p);
  });
}
}  // namespace avx512
#endif

#ifdef PDSERVE_HAVE_AVX2
// The same three kernels 8 tokens a vector: a mask byte is a chunk's 8 lanes (set where its bit is), a
// row's last partial chunk is copied into a buffer filled with -inf (no masked 16-bit loads in AVX2).
namespace avx2 {
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <typename T>
inline __m256 load_tail(const T* p, int64_t n) {
  alignas(32) float b[8];
  for (int j = 0; j < 8; ++j) b[j] = j < n ? static_cast<float>(p[j]) : -std::numeric_limits<float>::infinity();
  return _mm256_load_ps(b);
}
// All ones in lane j where bit j of `byte` is set.
inline __m256 lanes(uint32_t byte) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(byte)), sel), sel));
}
inline float hmax(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_shuffle_ps(a, a, 1)));
}
inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}
inline int nan_lanes(__m256 v, __m256 m) { return _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), m)); }

// As avx512::masked_argmax_row; `mb`: the mask's bytes (byte c: tokens 8c .. 8c + 7), never read without
// kMasked.
template <typename T, bool kMasked = true>
int64_t masked_argmax_row(const T* __restrict__ x, const uint8_t* __restrict__ mb_, int64_t V) {
  const auto mb = [mb_](int64_t c) -> uint32_t { return kMasked ? mb_[c] : 0xFFu; };
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t full = V / 8, rest = V - full * 8;
  const uint32_t tail_bits = rest ? mb(full) & ((1u << rest) - 1) : 0;
  const __m256 tail_m = lanes(tail_bits);
  const __m256 tail_v = tail_bits ? load_tail(x + full * 8, rest) : _mm256_setzero_ps();
  for (int64_t c = 0; c < full; ++c) {
    if (!mb(c)) continue;
    const __m256 v = load8(x + c * 8), m = lanes(mb(c));
    if (const int nan = nan_lanes(v, m)) return c * 8 + __builtin_ctz(nan);  // the first allowed NaN wins
    best = _mm256_blendv_ps(best, _mm256_max_ps(best, v), m);
  }
  if (tail_bits) {
    if (const int nan = nan_lanes(tail_v, tail_m)) return full * 8 + __builtin_ctz(nan);
    best = _mm256_blendv_ps(best, _mm256_max_ps(best, tail_v), tail_m);
  }
  const __m256 topv = _mm256_set1_ps(hmax(best));
  for (int64_t c = 0; c < full; ++c) {
    if (!mb(c)) continue;
    const int eq = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(load8(x + c * 8), topv, _CMP_EQ_OQ), lanes(mb(c))));
    if (eq) return c * 8 + __builtin_ctz(eq);
  }
  if (tail_bits) {
    const int eq = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(tail_v, topv, _CMP_EQ_OQ), tail_m));
    if (eq) return full * 8 + __builtin_ctz(eq);
  }
  return 0;  // nothing allowed
}

void apply_row(float* __restrict__ x, const uint8_t* __restrict__ mb, int64_t V) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t full = V / 8, rest = V - full * 8;
  for (int64_t c = 0; c < full; ++c) {
    if (mb[c] == 0xFF) continue;
    _mm256_maskstore_ps(x + c * 8, _mm256_castps_si256(lanes(~mb[c] & 0xFFu)), ninf);
  }
  if (rest) _mm256_maskstore_ps(x + full * 8, _mm256_castps_si256(lanes(~mb[full] & ((1u << rest) - 1))), ninf);
}

// exp(x) for 8 float32 lanes, x in [-87, 0]: the polynomial of avx512::exp16, 2^n built in the exponent
// field (normal down to 2^-126, hence the narrower range).
inline __m256 exp8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9841270e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3888889e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// As avx512::sample_row; probabilities below e^-87 count as 0 (e^-103 there).
template <typename T>
int64_t sample_row(const T* __restrict__ x, int64_t V, float inv_t, float u) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t full = V / 8, rest = V - full * 8, chunks = full + (rest ? 1 : 0);
  const __m256 tail_v = rest ? load_tail(x + full * 8, rest) : _mm256_setzero_ps();
  auto chunk = [&](int64_t c) { return c < full ? load8(x + c * 8) : tail_v; };
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  __m256 mx = _mm256_set1_ps(ninf);
  for (int64_t c = 0; c < chunks; ++c) {
    const __m256 v = chunk(c);
    if (const int nan = nan_lanes(v, all)) return c * 8 + __builtin_ctz(nan);
    mx = _mm256_max_ps(mx, v);
  }
  const float m = hmax(mx);
  if (m == ninf) return 0;
  const __m256 mv = _mm256_set1_ps(m), it = _mm256_set1_ps(inv_t), lo = _mm256_set1_ps(-87.f);
  auto probs = [&](int64_t c) {
    const __m256 arg = _mm256_mul_ps(_mm256_sub_ps(chunk(c), mv), it);  // -inf for a masked or padded token
    return _mm256_and_ps(_mm256_cmp_ps(arg, lo, _CMP_GT_OQ), exp8(_mm256_max_ps(arg, lo)));
  };
  thread_local std::vector<float> sums;
  const float total = block_sums(chunks, sums, _mm256_setzero_ps(), probs, [](__m256 v) { return hsum(v); });
  return scan_cdf<8>(chunks, sums, u * total, [&](int64_t c, float* e) {
    const __m256 p = probs(c);
    _mm256_store_ps(e, p);
    return hsum(p);
  });
}
}  // namespace avx2
#endif

void check(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& masks) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(), "logits: contiguous [N, V] on CPU");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous(), "rows: int64 [R]");
  TORCH_CHECK(masks.dim() == 2 && masks.scalar_type() == torch::kInt32 && masks.is_contiguous(), "masks: int32 [R, W]");
  TORCH_CHECK(masks.size(0) == rows.size(0), "one mask per row");
  TORCH_CHECK(masks.size(1) * 32 >= logits.size(1), "a mask covers the vocabulary");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), "row out of range");
}

// The instruction sets this build has kernels for, widest first ("avx512", "avx2").
std::vector<std::string> isas() {
  std::vector<std::string> out;
#ifdef PDSERVE_HAVE_AVX512
  out.push_back("avx512");
#endif
#ifdef PDSERVE_HAVE_AVX2
  out.push_back("avx2");
#endif
  return out;
}

// Whether `isa` (one of isas()) is AVX-512.
bool wide(const std::string& isa) {
  const auto have = isas();
  TORCH_CHECK(std::find(have.begin(), have.end(), isa) != have.end(), "no ", isa, " sampling kernels in this build");
  return isa == "avx512";
}

// One row of each kernel in the chosen instruction set (an AVX-512 build has AVX2 too).
template <typename T, bool kMasked = true>
int64_t argmax_row(bool w, const T* x, const uint32_t* bits, int64_t V) {
#ifdef PDSERVE_HAVE_AVX512
  if (w) return avx512::masked_argmax_row<T, kMasked>(x, bits, V);
#endif
#ifdef PDSERVE_HAVE_AVX2
  return avx2::masked_argmax_row<T, kMasked>(x, reinterpret_cast<const uint8_t*>(bits), V);
#else
  TORCH_CHECK(false, "no sampling kernels in this build");
  return 0;
#endif
}

void mask_row(bool w, float* x, const uint32_t* bits, int64_t V) {
#ifdef PDSERVE_HAVE_AVX512
  if (w) return avx512::apply_row(x, bits, V);
#endif
#ifdef PDSERVE_HAVE_AVX2
  avx2::apply_row(x, reinterpret_cast<const uint8_t*>(bits), V);
#else
  TORCH_CHECK(false, "no sampling kernels in this build");
#endif
}

template <typename T>
int64_t draw_row(bool w, const T* x, int64_t V, float inv_t, float u) {
#ifdef PDSERVE_HAVE_AVX512
  if (w) return avx512::sample_row(x, V, inv_t, u);
#endif
#ifdef PDSERVE_HAVE_AVX2
  return avx2::sample_row(x, V, inv_t, u);
#else
  TORCH_CHECK(false, "no sampling kernels in this build");
  return 0;
#endif
}

// The argmax of `n` rows of `logits` (row i: logits row r[i], or i without r) in the chosen instruction
// set; row i's mask is bits + i * W when kMasked.
template <bool kMasked>
torch::Tensor argmax_rows(const torch::Tensor& logits, int64_t n, const int64_t* r, const uint32_t* bits, int64_t W,
                          const std::string& isa) {
  const bool w = wide(isa);
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || logits.scalar_type() == torch::kFloat32, "logits: float32 or bfloat16");
  auto out = torch::empty({n}, torch::kInt64);
  const int64_t V = logits.size(1);
  int64_t* o = out.data_ptr<int64_t>();
  const void* base = logits.data_ptr();
  at::parallel_for(0, n, 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t row = r ? r[i] : i;
      const uint32_t* m = kMasked ? bits + i * W : nullptr;
      o[i] = bf16 ? argmax_row<at::BFloat16, kMasked>(w, static_cast<const at::BFloat16*>(base) + row * V, m, V)
                  : argmax_row<float, kMasked>(w, static_cast<const float*>(base) + row * V, m, V);
    }
  });
  return out;
}

}  // namespace

// Per row of `rows`: the allowed token with the largest logit (first on ties), as argmax over the
// logits with -inf at every token its mask does not allow.
torch::Tensor masked_argmax(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& masks,
                            const std::string& isa) {
  check(logits, rows, masks);
  return argmax_rows<true>(logits, rows.size(0), rows.data_ptr<int64_t>(),
                           reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>()), masks.size(1), isa);
}

// Per row: the token with the largest logit, first on ties, the first NaN where the row has one (torch's
// max(dim=-1).indices), in one pass over the logits as they are (bf16 or float32). torch's max over a bf16
// row took 4x as long (96 rows of 151,936 tokens, host H: 8.7 against 2.0 ms).
torch::Tensor argmax(const torch::Tensor& logits, const std::string& isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(), "logits: contiguous [N, V] on CPU");
  return argmax_rows<false>(logits, logits.size(0), nullptr, nullptr, 0, isa);
}

// -inf in place at every token of each row of `rows` that its mask does not allow (float32 logits).
void apply_bitmask_(torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& masks, const std::string& isa) {
  check(logits, rows, masks);
  const bool w = wide(isa);
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32, "logits: float32");
  const int64_t V = logits.size(1), W = masks.size(1);
  const int64_t* r = rows.data_ptr<int64_t>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  float* x = logits.data_ptr<float>();
  at::parallel_for(0, rows.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) mask_row(w, x + r[i] * V, bits + i * W, V);
  });
}

// One draw per row of `logits` from softmax(row / temperature[row]) with the uniform number u[row].
torch::Tensor sample_temperature(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& u,
                                 const std::string& isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(), "logits: contiguous [N, V] on CPU");
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && temperature.numel() == logits.size(0) &&
              temperature.is_contiguous(), "temperature: float32 [N]");
  TORCH_CHECK(u.scalar_type() == torch::kFloat32 && u.numel() == logits.size(0) && u.is_contiguous(), "u: float32 [N]");
  const bool w = wide(isa);
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || logits.scalar_type() == torch::kFloat32, "logits: float32 or bfloat16");
  auto out = torch::empty({logits.size(0)}, torch::kInt64);
  const int64_t V = logits.size(1);
  const float* t = temperature.data_ptr<float>();
  const float* uu = u.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const void* base = logits.data_ptr();
  at::parallel_for(0, logits.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float inv_t = 1.f / t[i];
      o[i] = bf16 ? draw_row(w, static_cast<const at::BFloat16*>(base) + i * V, V, inv_t, uu[i])
                  : draw_row(w, static_cast<const float*>(base) + i * V, V, inv_t, uu[i]);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isas", &isas, "the instruction sets this build has kernels for, widest first");
  m.def("argmax", &argmax, "per row, the largest logit's first token (torch's max(dim=-1).indices)", py::arg("logits"),
        py::arg("isa"));
  m.def("sample_temperature", &sample_temperature, "one inverse-CDF draw per row from softmax(row / T)");
  m.def("masked_argmax", &masked_argmax, "argmax of each listed row over the tokens its packed mask allows");
  m.def("apply_bitmask_", &apply_bitmask_, "-inf in place where each listed row's packed mask is 0");
}

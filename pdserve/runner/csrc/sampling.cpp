// The sampler's kernels for CPUs (pdserve/runner/kernels.py chooses them against torch's ops by
// measurement). AVX-512 (F, BW, VL) only; without it the caller keeps torch's ops.
// - Structured outputs' token masks straight from their packed bits (bit t % 32 of 32-bit word t / 32
//   allows token t), one pass over the logits: the torch sequence (look the bits up, widen the logits, add
//   a 0 / -inf row, argmax) makes four passes over [rows, vocab] float32.
// - A draw from softmax(logits / T) by inverse CDF without a [rows, vocab] tensor: the row's max, the sum
//   of exp((x - max) / T), then the running sum up to u x that sum; torch's way writes the widened,
//   divided, softmaxed and cumulated rows (four [rows, vocab] float32 tensors).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PDSERVE_HAVE_VEC 1
#endif

namespace {

#ifdef PDSERVE_HAVE_VEC
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
// 0 when the mask allows nothing (the index torch's max gives a row of -inf).
template <typename T>
int64_t masked_argmax_row(const T* __restrict__ x, const uint32_t* __restrict__ bits, int64_t V) {
  const float ninf = -std::numeric_limits<float>::infinity();
  __m512 best = _mm512_set1_ps(ninf);
  const int64_t full = V / 16;
  for (int64_t c = 0; c < full; ++c) {
    const __mmask16 m = static_cast<__mmask16>(bits[c >> 1] >> ((c & 1) * 16));
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
    tail_m = static_cast<__mmask16>((bits[full >> 1] >> ((full & 1) * 16)) & ((1u << rest) - 1));
    tail_v = load_tail(x + full * 16, static_cast<__mmask16>((1u << rest) - 1));
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(tail_m, tail_v, tail_v, _CMP_UNORD_Q);
    if (nan) return full * 16 + __builtin_ctz(nan);
    best = _mm512_mask_max_ps(best, tail_m, best, tail_v);
  }
  const float top = _mm512_reduce_max_ps(best);
  const __m512 topv = _mm512_set1_ps(top);
  for (int64_t c = 0; c < full; ++c) {
    const __mmask16 m = static_cast<__mmask16>(bits[c >> 1] >> ((c & 1) * 16));
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
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) acc = _mm512_add_ps(acc, probs(c));
  const float target = u * _mm512_reduce_add_ps(acc);
  float run = 0.f;
  int64_t last = 0;  // the last token of nonzero probability, for a target the running sum never passes
  alignas(64) float e[16];
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512 p = probs(c);
    const float s = _mm512_reduce_add_ps(p);
    if (s > 0.f) {
      _mm512_store_ps(e, p);
      if (run + s > target) {
        for (int j = 0; j < 16; ++j) {
          run += e[j];
          if (run > target) return c * 16 + j;
        }
      } else {
        run += s;
      }
      for (int j = 15; j >= 0; --j)
        if (e[j] > 0.f) { last = c * 16 + j; break; }
    }
  }
  return last;
}
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

}  // namespace

bool has_vec() {
#ifdef PDSERVE_HAVE_VEC
  return true;
#else
  return false;
#endif
}

// Per row of `rows`: the allowed token with the largest logit (first on ties), as argmax over the
// logits with -inf at every token its mask does not allow.
torch::Tensor masked_argmax(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& masks) {
  check(logits, rows, masks);
  TORCH_CHECK(has_vec(), "masked_argmax needs AVX-512");
  auto out = torch::empty({rows.size(0)}, torch::kInt64);
#ifdef PDSERVE_HAVE_VEC
  const int64_t V = logits.size(1), W = masks.size(1);
  const int64_t* r = rows.data_ptr<int64_t>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  int64_t* o = out.data_ptr<int64_t>();
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || logits.scalar_type() == torch::kFloat32, "logits: float32 or bfloat16");
  const void* base = logits.data_ptr();
  at::parallel_for(0, rows.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      o[i] = bf16 ? masked_argmax_row(static_cast<const at::BFloat16*>(base) + r[i] * V, bits + i * W, V)
                  : masked_argmax_row(static_cast<const float*>(base) + r[i] * V, bits + i * W, V);
    }
  });
#endif
  return out;
}

// -inf in place at every token of each row of `rows` that its mask does not allow (float32 logits).
void apply_bitmask_(torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& masks) {
  check(logits, rows, masks);
  TORCH_CHECK(has_vec(), "apply_bitmask_ needs AVX-512");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32, "logits: float32");
#ifdef PDSERVE_HAVE_VEC
  const int64_t V = logits.size(1), W = masks.size(1);
  const int64_t* r = rows.data_ptr<int64_t>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  float* x = logits.data_ptr<float>();
  at::parallel_for(0, rows.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) apply_row(x + r[i] * V, bits + i * W, V);
  });
#endif
}

// One draw per row of `logits` from softmax(row / temperature[row]) with the uniform number u[row].
torch::Tensor sample_temperature(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(), "logits: contiguous [N, V] on CPU");
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && temperature.numel() == logits.size(0) &&
              temperature.is_contiguous(), "temperature: float32 [N]");
  TORCH_CHECK(u.scalar_type() == torch::kFloat32 && u.numel() == logits.size(0) && u.is_contiguous(), "u: float32 [N]");
  TORCH_CHECK(has_vec(), "sample_temperature needs AVX-512");
  auto out = torch::empty({logits.size(0)}, torch::kInt64);
#ifdef PDSERVE_HAVE_VEC
  const int64_t V = logits.size(1);
  const float* t = temperature.data_ptr<float>();
  const float* uu = u.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || logits.scalar_type() == torch::kFloat32, "logits: float32 or bfloat16");
  const void* base = logits.data_ptr();
  at::parallel_for(0, logits.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float inv_t = 1.f / t[i];
      o[i] = bf16 ? sample_row(static_cast<const at::BFloat16*>(base) + i * V, V, inv_t, uu[i])
                  : sample_row(static_cast<const float*>(base) + i * V, V, inv_t, uu[i]);
    }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_temperature", &sample_temperature, "one inverse-CDF draw per row from softmax(row / T)");
  m.def("has_vec", &has_vec, "whether this build has the AVX-512 kernels");
  m.def("masked_argmax", &masked_argmax, "argmax of each listed row over the tokens its packed mask allows");
  m.def("apply_bitmask_", &apply_bitmask_, "-inf in place where each listed row's packed mask is 0");
}

// Structured outputs' token masks applied straight from their packed bits (bit t % 32 of 32-bit word
// t / 32 allows token t), one pass over the logits: the torch sequence (unpack the bits, widen the logits,
// add a 0 / -inf row, argmax) makes four passes over [rows, vocab] float32 (pdserve/runner/sampler.py).
// AVX-512 (F, BW, VL) only: 16 tokens per mask register straight from the bits; without it the caller
// keeps torch's ops.
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_vec", &has_vec, "whether this build has the AVX-512 kernels");
  m.def("masked_argmax", &masked_argmax, "argmax of each listed row over the tokens its packed mask allows");
  m.def("apply_bitmask_", &apply_bitmask_, "-inf in place where each listed row's packed mask is 0");
}

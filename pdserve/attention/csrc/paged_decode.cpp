// Paged decode attention for CPUs: one query token per request, K/V read in place from the block
// table (no gather copy), one pass over K for scores and one over V for the output. Work is split
// over (request, kv head) pairs with ATen's thread pool. Plain loops, vectorised by the compiler
// (-O3 -march=native): memory-bound, so the aim is reading each K/V row once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Softmax of one query head's scores over its L context tokens, in place.
inline void softmax_inplace(float* s, int64_t L) {
  float m = s[0];
#pragma omp simd reduction(max : m)
  for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)  // vectorised expf (glibc libmvec) under -ffast-math
  for (int64_t t = 0; t < L; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < L; ++t) s[t] *= inv;
}

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, const int64_t* ctx,
                   T* out, int64_t B, int64_t H, int64_t D, int64_t KVH, int64_t NB, int64_t BS,
                   int64_t max_blocks, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, rows(BS * D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, h = idx % KVH, L = ctx[b];
      const int64_t* blocks = table + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(q[(b * H + h * G + g) * D + d]) * scale;
      scores.resize(G * L);
      const T* kh = k_cache + h * NB * BS * D;
      const T* vh = v_cache + h * NB * BS * D;
      for (int64_t t0 = 0; t0 < L; t0 += BS) {  // one block at a time: BS contiguous rows
        const int64_t n = std::min(BS, L - t0);
        const T* kb = kh + blocks[t0 / BS] * BS * D;
        for (int64_t i = 0; i < n * D; ++i) rows[i] = to_float(kb[i]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float* sg = scores.data() + g * L + t0;
          for (int64_t t = 0; t < n; ++t) {
            const float* r = rows.data() + t * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * r[d];
            sg[t] = s;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_inplace(scores.data() + g * L, L);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = std::min(BS, L - t0);
        const T* vb = vh + blocks[t0 / BS] * BS * D;
        for (int64_t i = 0; i < n * D; ++i) rows[i] = to_float(vb[i]);
        for (int64_t g = 0; g < G; ++g) {
          float* ag = acc.data() + g * D;
          const float* sg = scores.data() + g * L + t0;
          for (int64_t t = 0; t < n; ++t) {
            const float p = sg[t];
            const float* r = rows.data() + t * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * r[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) out[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}


#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_HAVE_AVX512BF16 1

// bf16 K/V, head_dim 64, G query heads per kv head: AVX-512 BF16 dot products for q.k (32 pairs per
// instruction, no conversion of K) and register-resident accumulators for p.v.
template <int G>
void decode_bf16_d64(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                     const int64_t* table, const int64_t* ctx, at::BFloat16* out, int64_t B, int64_t H,
                     int64_t KVH, int64_t NB, int64_t BS, int64_t max_blocks, float scale) {
  constexpr int64_t D = 64;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, h = idx % KVH, L = ctx[b];
      const int64_t* blocks = table + b * max_blocks;
      __m512bh qv[G][2];
      for (int g = 0; g < G; ++g) {
        const at::BFloat16* qg = q + (b * H + h * G + g) * D;
        qv[g][0] = (__m512bh)_mm512_loadu_si512(qg);
        qv[g][1] = (__m512bh)_mm512_loadu_si512(qg + 32);
      }
      scores.resize(G * L);
      const at::BFloat16* kh = k_cache + h * NB * BS * D;
      const at::BFloat16* vh = v_cache + h * NB * BS * D;
      for (int64_t t = 0; t < L; ++t) {
        const at::BFloat16* k = kh + (blocks[t / BS] * BS + t % BS) * D;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k), k1 = (__m512bh)_mm512_loadu_si512(k + 32);
        for (int g = 0; g < G; ++g) {
          __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k0);
          acc = _mm512_dpbf16_ps(acc, qv[g][1], k1);
          scores[g * L + t] = _mm512_reduce_add_ps(acc) * scale;
        }
      }
      for (int g = 0; g < G; ++g) softmax_inplace(scores.data() + g * L, L);
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        const at::BFloat16* v = vh + (blocks[t / BS] * BS + t % BS) * D;
        __m512 vr[4];
        for (int j = 0; j < 4; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * j));
          vr[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        }
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * L + t]);
          for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(p, vr[j], acc[g][j]);
        }
      }
      for (int g = 0; g < G; ++g) {
        at::BFloat16* o = out + (b * H + h * G + g) * D;
        for (int j = 0; j < 4; ++j) {
          // round to nearest even bf16, as torch does
          __m512i bits = _mm512_castps_si512(acc[g][j]);
          __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
          bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
        }
      }
    }
  });
}
#endif

}  // namespace

// q [B, H, D]; k_cache, v_cache [KVH, NB, BS, D] (contiguous); table [B, max_blocks] int64;
// context_lens [B] int64 (>= 1). Returns [B, H, D] in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                           torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  q = q.contiguous();
  table = table.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D, "head layout mismatch");
  auto out = torch::empty_like(q);
#ifdef PDSERVE_HAVE_AVX512BF16
  if (q.scalar_type() == torch::kBFloat16 && D == 64 && H / KVH <= 4) {
    auto args = std::make_tuple(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), table.data_ptr<int64_t>(),
                                context_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H, KVH, NB, BS,
                                table.size(1), static_cast<float>(scale));
    switch (H / KVH) {
      case 1: std::apply(decode_bf16_d64<1>, args); break;
      case 2: std::apply(decode_bf16_d64<2>, args); break;
      case 3: std::apply(decode_bf16_d64<3>, args); break;
      default: std::apply(decode_bf16_d64<4>, args); break;
    }
    return out;
  }
#endif
  if (q.scalar_type() == torch::kBFloat16) {
    decode_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), table.data_ptr<int64_t>(),
                                context_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H, D, KVH, NB,
                                BS, table.size(1), static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_decode supports bfloat16 and float32");
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         table.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H,
                         D, KVH, NB, BS, table.size(1), static_cast<float>(scale));
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }

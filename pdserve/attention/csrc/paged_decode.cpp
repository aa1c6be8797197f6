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
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
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
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = sg[0];
#pragma omp simd reduction(max : m)
        for (int64_t t = 1; t < L; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)  // vectorised expf (glibc libmvec) under -ffast-math
        for (int64_t t = 0; t < L; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
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

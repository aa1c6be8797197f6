// Fused elementwise ops of the Llama layer for CPUs: each replaces 2-8 small torch ops whose dispatch
// cost dominates a decode step at small batch (30 layers x ~40 ops). SiLU-and-multiply has its own
// vector exp (a plain loop calling expf was 10-16x slower than torch's). Every op reproduces the rounding
// of the torch sequence it replaces (bf16 results of each intermediate torch op are rounded the same
// way here), so the fused and the reference paths agree to the last bit except where a float32 sum is
// reduced in a different order (RMSNorm's mean of squares: rare 1-ulp differences).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
// Round to the storage type the way a torch op producing T would (bf16: round to nearest even).
template <typename T> inline T round_to(float x) { return static_cast<T>(x); }
template <typename T> inline float r(float x) { return to_float(round_to<T>(x)); }

constexpr int64_t kGrain = 8;  // rows per task: small batches run inline, no thread-pool hand-off

// x += delta (when given), then out = weight * rms_norm(x) as `weight * F.rms_norm(x.float()).to(T)`.
// Rows [begin, end). A plain function called from the parallel lambda (see rope_rows).
template <typename T>
__attribute__((noinline)) void add_rms_norm_rows(T* __restrict__ x, const T* __restrict__ delta,
                                                 const T* __restrict__ w, T* __restrict__ out, int64_t begin,
                                                 int64_t end, int64_t D, float eps) {
  for (int64_t i = begin; i < end; ++i) {
    T* xi = x + i * D;
    if (delta != nullptr) {
      const T* di = delta + i * D;
      for (int64_t d = 0; d < D; ++d) xi[d] = round_to<T>(to_float(xi[d]) + to_float(di[d]));
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; ++d) {
      const float v = to_float(xi[d]);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    T* oi = out + i * D;
    for (int64_t d = 0; d < D; ++d) oi[d] = round_to<T>(to_float(w[d]) * r<T>(to_float(xi[d]) * inv));
  }
}

// Vector loops for bf16 (below): the scalar loops above do not vectorise, as c10's float -> bf16
// conversion (NaN check, then round to nearest even) stays a scalar call. AVX-512 (16 lanes) or AVX2 + FMA
// (8 lanes: CPUs without AVX-512, AMD EPYC Zen 3 among this machine kind's hosts).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PDSERVE_HAVE_VEC 1
#if defined(__AVX512F__)
constexpr int kVecLanes = 16;
#else
constexpr int kVecLanes = 8;
#endif
void add_rms_norm_rows_bf16(at::BFloat16* x, const at::BFloat16* delta, const at::BFloat16* w, at::BFloat16* out,
                            int64_t begin, int64_t end, int64_t D, float eps);
void rope_rows_bf16(at::BFloat16* qkv, const at::BFloat16* cos, const at::BFloat16* sin, int64_t begin, int64_t end,
                    int64_t row_stride, int64_t heads, int64_t D);
#endif

template <typename T>
void add_rms_norm_kernel(T* x, const T* delta, const T* w, T* out, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
#ifdef PDSERVE_HAVE_VEC
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      add_rms_norm_rows_bf16(x, delta, w, out, begin, end, D, eps);
      return;
    }
#endif
    add_rms_norm_rows(x, delta, w, out, begin, end, D, eps);
  });
}

// In place on the first `heads` heads of each row of qkv: x * cos + cat(-x2, x1) * sin, rounding each
// product and the sum as the three torch ops do.
// One row's heads. A plain function, not inlined into the parallel lambda: GCC does not vectorise the
// loop once it is outlined into an OpenMP region (measured 10x slower).
template <typename T>
__attribute__((noinline)) void rope_rows(T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
                                         int64_t begin, int64_t end, int64_t row_stride, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = begin; i < end; ++i) {
    const T* c = cos + i * D;
    const T* s = sin + i * D;
    for (int64_t h = 0; h < heads; ++h) {
      T* x = qkv + i * row_stride + h * D;
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = to_float(x[d]), x2 = to_float(x[d + half]);
        const float lo = r<T>(x1 * to_float(c[d])) + r<T>(-x2 * to_float(s[d]));
        const float hi = r<T>(x2 * to_float(c[d + half])) + r<T>(x1 * to_float(s[d + half]));
        x[d] = round_to<T>(lo);
        x[d + half] = round_to<T>(hi);
      }
    }
  }
}

template <typename T>
void rope_kernel(T* qkv, const T* cos, const T* sin, int64_t rows, int64_t row_stride, int64_t heads,
                 int64_t D) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
#ifdef PDSERVE_HAVE_VEC
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (D % (2 * kVecLanes) == 0) {  // halves of whole vectors
        rope_rows_bf16(qkv, cos, sin, begin, end, row_stride, heads, D);
        return;
      }
    }
#endif
    rope_rows(qkv, cos, sin, begin, end, row_stride, heads, D);
  });
}

#ifdef PDSERVE_HAVE_VEC
#include <immintrin.h>

// Vec: the lanes of one vector register as float, with what the loops below need beyond GCC's vector
// operators (+ - * / on __m512 / __m256; -ffp-contract=off keeps a * b + c two roundings, as torch's).
#if defined(__AVX512F__)
struct Vec {
  using F = __m512;
  static constexpr int kLanes = kVecLanes;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const at::BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  // Rounded to bf16 (nearest even), as 16-bit patterns in the low halves of 32-bit lanes; NaN becomes
  // 0x7FC0 as c10's conversion makes it.
  static __m512i round_bits(F v) {
    __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_mask_mov_epi32(_mm512_srli_epi32(bits, 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  }
  static F rb(F v) { return _mm512_castsi512_ps(_mm512_slli_epi32(round_bits(v), 16)); }  // r<bf16> per lane
  static void store(at::BFloat16* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bits(v)));
  }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static F round_nearest(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2(F p, F n) { return _mm512_scalef_ps(p, n); }  // p 2^n; overflow inf, underflow 0
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c, one rounding
};
#else
struct Vec {
  using F = __m256;
  static constexpr int kLanes = kVecLanes;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const at::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static __m256i round_bits(F v) {
    __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    return _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  static F rb(F v) { return _mm256_castsi256_ps(_mm256_slli_epi32(round_bits(v), 16)); }
  static void store(at::BFloat16* p, F v) {
    const __m256i b = round_bits(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
  static float sum(F v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static F round_nearest(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a b + c, one rounding
  // p 2^n through the exponent field, n clamped to [-127, 128]: 2^128 reads as inf, 2^-127 as 0 (flushed
  // where vscalefps would give a denormal: exp below e^-87, where 1 + exp(x) is 1 either way).
  static F scale2(F p, F n) {
    n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-127.f)), _mm256_set1_ps(128.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return p * _mm256_castsi256_ps(e);
  }
};
#endif
using F = Vec::F;

// exp(x) for float32 lanes, within ~1 ulp: x = n ln2 + r (Cody-Waite, |r| <= ln2/2), exp(r) by its
// degree-7 Taylor polynomial, times 2^n (overflow gives inf, underflow 0). Written as explicit fused
// multiply-adds (-ffp-contract=off keeps torch's two roundings in the other ops; exp matches no torch
// rounding, and one rounding per step is no less exact): silu_mul 1.3x faster than with separate
// multiplies and adds on host H (96 x 4864, 2 threads, 209 -> 159 us).
inline F exp_ps(F x) {
  const F n = Vec::round_nearest(x * Vec::set1(1.44269504088896341f));
  F r = Vec::fma(n, Vec::set1(-0.693359375f), x);  // ln2 split: exact product n*hi
  r = Vec::fma(n, Vec::set1(2.12194440e-4f), r);
  F p = Vec::set1(1.9841270e-4f);                      // 1/7!
  p = Vec::fma(p, r, Vec::set1(1.3888889e-3f));        // 1/6!
  p = Vec::fma(p, r, Vec::set1(8.3333333e-3f));        // 1/5!
  p = Vec::fma(p, r, Vec::set1(4.1666667e-2f));        // 1/4!
  p = Vec::fma(p, r, Vec::set1(1.6666667e-1f));        // 1/3!
  p = Vec::fma(p, r, Vec::set1(0.5f));
  p = Vec::fma(p, r, Vec::set1(1.0f));
  p = Vec::fma(p, r, Vec::set1(1.0f));
  return Vec::scale2(p, n);
}

// add_rms_norm_rows for bf16, the same roundings (the sum of squares in another order, as before).
void add_rms_norm_rows_bf16(at::BFloat16* x, const at::BFloat16* delta, const at::BFloat16* w, at::BFloat16* out,
                            int64_t begin, int64_t end, int64_t D, float eps) {
  constexpr int N = Vec::kLanes;
  const int64_t full = D & ~int64_t{N - 1};
  for (int64_t i = begin; i < end; ++i) {
    at::BFloat16* xi = x + i * D;
    if (delta != nullptr) {
      const at::BFloat16* di = delta + i * D;
      for (int64_t d = 0; d < full; d += N) Vec::store(xi + d, Vec::load(xi + d) + Vec::load(di + d));
      for (int64_t d = full; d < D; ++d) xi[d] = round_to<at::BFloat16>(to_float(xi[d]) + to_float(di[d]));
    }
    F acc = Vec::set1(0.f);
    for (int64_t d = 0; d < full; d += N) {
      const F v = Vec::load(xi + d);
      acc = acc + v * v;
    }
    float ss = Vec::sum(acc);
    for (int64_t d = full; d < D; ++d) ss += to_float(xi[d]) * to_float(xi[d]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    const F vinv = Vec::set1(inv);
    at::BFloat16* oi = out + i * D;
    for (int64_t d = 0; d < full; d += N) Vec::store(oi + d, Vec::load(w + d) * Vec::rb(Vec::load(xi + d) * vinv));
    for (int64_t d = full; d < D; ++d)
      oi[d] = round_to<at::BFloat16>(to_float(w[d]) * r<at::BFloat16>(to_float(xi[d]) * inv));
  }
}

// rope_rows for bf16 with D a multiple of 2 kVecLanes, the same roundings: each product, then the sum.
void rope_rows_bf16(at::BFloat16* qkv, const at::BFloat16* cos, const at::BFloat16* sin, int64_t begin, int64_t end,
                    int64_t row_stride, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = begin; i < end; ++i) {
    const at::BFloat16* c = cos + i * D;
    const at::BFloat16* s = sin + i * D;
    for (int64_t h = 0; h < heads; ++h) {
      at::BFloat16* x = qkv + i * row_stride + h * D;
      for (int64_t d = 0; d < half; d += Vec::kLanes) {
        const F x1 = Vec::load(x + d), x2 = Vec::load(x + d + half);
        const F lo = Vec::rb(x1 * Vec::load(c + d)) - Vec::rb(x2 * Vec::load(s + d));
        const F hi = Vec::rb(x2 * Vec::load(c + d + half)) + Vec::rb(x1 * Vec::load(s + d + half));
        Vec::store(x + d, lo);
        Vec::store(x + d + half, hi);
      }
    }
  }
}

// out[t, i] = bf16(bf16(silu(gate)) * up) with gate = gate_up[t, i], up = gate_up[t, I + i], as
// `F.silu(gate) * up` rounds: silu in float32 as x / (1 + exp(-x)), rounded to bf16, then the product.
__attribute__((noinline)) void silu_mul_rows(const at::BFloat16* __restrict__ gu, at::BFloat16* __restrict__ out,
                                             int64_t begin, int64_t end, int64_t I) {
  constexpr int N = Vec::kLanes;
  const F one = Vec::set1(1.f), zero = Vec::set1(0.f);
  for (int64_t t = begin; t < end; ++t) {
    const at::BFloat16* g = gu + t * 2 * I;
    const at::BFloat16* u = g + I;
    at::BFloat16* o = out + t * I;
    int64_t i = 0;
    for (; i + N <= I; i += N) {
      const F x = Vec::load(g + i);
      Vec::store(o + i, Vec::rb(x / (one + exp_ps(zero - x))) * Vec::load(u + i));
    }
    for (; i < I; ++i) {
      const float x = to_float(g[i]);
      const float s = r<at::BFloat16>(x / (1.f + std::exp(-x)));
      o[i] = round_to<at::BFloat16>(s * to_float(u[i]));
    }
  }
}
#endif

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), name, " must be a contiguous 2-D CPU tensor");
}

}  // namespace

// Returns rms_norm(x + delta) * weight and leaves x + delta in x (the residual stream).
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must match x's last dimension and dtype");
  if (delta) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "delta must match x");
  }
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), delta ? delta->data_ptr<scalar_t>() : nullptr,
                                  weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                                  static_cast<float>(eps));
  });
  return out;
}

void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == qkv.size(0) * head_dim &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == qkv.scalar_type(),
              "cos/sin must be contiguous [T, 1, head_dim] in qkv's dtype");
  TORCH_CHECK(heads * head_dim <= qkv.size(1) && head_dim % 2 == 0, "bad heads / head_dim");
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, qkv.scalar_type(), "rope_", [&] {
    rope_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                          qkv.size(0), qkv.size(1), heads, head_dim);
  });
}

// rope_ on the q and k heads, then q, k, v as [T, heads, head_dim] views of qkv (made here: three
// slices and views from Python cost ~19 us a layer on a slow host, the rotation itself ~1 us at one row).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_qkv_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && qkv.dim() == 2 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be [T, (heads + 2 kv_heads) * head_dim]");
  rope_(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
  const int64_t T = qkv.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  return {qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim}),
          qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim}),
          qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim})};
}

bool has_silu_mul() {
#ifdef PDSERVE_HAVE_VEC
  return true;
#else
  return false;
#endif
}

// gate_up [T, 2I] bf16 -> F.silu(gate) * up [T, I] (builds with AVX-512 or AVX2 only: see has_silu_mul).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16 && gate_up.size(1) % 2 == 0, "gate_up must be bf16 [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
#ifdef PDSERVE_HAVE_VEC
  const at::BFloat16* gu = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, kGrain, [&](int64_t begin, int64_t end) { silu_mul_rows(gu, o, begin, end, I); });
#else
  TORCH_CHECK(false, "built without AVX-512 or AVX2");
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "x += delta; return weight * rms_norm(x)");
  m.def("rope_", &rope_, "rotary embedding in place on the first heads of each row");
  m.def("rope_qkv_", &rope_qkv_, "rope_ on the q and k heads of qkv, then its q, k, v views");
  m.def("has_silu_mul", &has_silu_mul, "whether silu_mul has its vector path (AVX-512 or AVX2) in this build");
  m.def("silu_mul", &silu_mul, "F.silu(gate) * up from the fused gate/up projection (bf16)");
}

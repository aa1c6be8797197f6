// Paged decode attention for CPUs: one query token per request, K/V read in place from the block
// table (no gather copy), one pass over K for scores and one over V for the output. Work is split
// over (request, kv head) pairs, in contiguous ranges of equal context length per thread (the runner
// sorts decodes by context, so equal item counts would give one thread all the long ones).
//
// The cache is bf16 (or float32), or quantized (kv/quant.py) with 4 bytes of parameters per (kv head,
// token) row: fp8 e4m3 values with a float32 scale s, the value being stored * s; int8 values with a
// float16 scale s and zero z (asymmetric over the row's [min, max]), the stored byte c being q - 128 and
// the value (c + 128) s + z = c s + m with m = z + 128 s. The kernels read quantized rows in place and
// dequantize in registers; the parameters are applied once per row (q.k: the dot product times the K
// scale, plus int8's m times the sum of the query's dims; p.v: the V scale folded into p, and int8's
// sum_t p_t m_t one scalar per head added to every output dim), so a decode step reads D + 4 bytes per
// row instead of 2D.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <unistd.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#include "../../csrc/amx.h"  // PDSERVE_HAVE_AMX, the tile state and config (prefill_amx, the AMX decode)

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(int8_t x) { return static_cast<float>(x); }

// fp8 e4m3fn (sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities) by a 256-entry table,
// one load per value in the portable loops. The vector kernels convert by bit manipulation instead
// (Fp8Rows below), which needs no gather.
inline float fp8_e4m3_value(uint8_t bits) {
  const int e = (bits >> 3) & 15, m = bits & 7;
  const float mag = e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(static_cast<float>(m), -9);
  return (bits & 0x80) ? -mag : mag;  // code 0x7f/0xff (NaN) reads as 480: quantize never writes it
}
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = fp8_e4m3_value(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}
inline float to_float(at::Float8_e4m3fn x) { return fp8_table()[x.x]; }

// Weights below e^-69 (~1e-30, relative to the largest) are flushed to zero: left to exp they underflow
// into float denormals for far-away keys of a long context, and every multiply that then touches one
// (p.v, the V-scale fold) takes a microcode assist: ~3x on a whole decode step, bf16 included. A weight
// of 1e-30 changes no output by more than 1e-30 of a V row, far below bf16's half ulp. A flush in the
// kernel rather than FTZ/DAZ in MXCSR: the latter is per thread, would have to be set and restored on
// each of ATen's pool threads around every call, and would change the rest of torch's float math there.
constexpr float kSoftmaxFlush = -69.f;       // natural-log units: e^-69 = 1.0e-30
constexpr float kSoftmaxFlushLog2 = -100.f;  // the same in log2 units (prefill's exp2): 2^-100 = 7.9e-31

// Softmax of one query head's scores over its L context tokens, in place.
inline void softmax_inplace(float* s, int64_t L) {
  float m = s[0];
#pragma omp simd reduction(max : m)
  for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)  // vectorised expf (glibc libmvec) under -ffast-math
  for (int64_t t = 0; t < L; ++t) {
    // exp of the clamped argument: a vector exp computes both sides of the select, and libmvec's expf
    // takes a scalar slow path for arguments that underflow.
    const float x = s[t] - m;
    const float e = std::exp(std::max(x, kSoftmaxFlush));
    s[t] = x < kSoftmaxFlush ? 0.f : e;
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < L; ++t) s[t] *= inv;
}

// Runs fn(item, first, last) for items 0..costs.size()-1, split into contiguous per-thread ranges of
// about equal cost; first / last: the item opens / closes its thread's range. for_each_costed: fn(item).
template <typename F>
void for_each_costed_ranged(const std::vector<int64_t>& costs, const F& fn) {
  const int64_t n = static_cast<int64_t>(costs.size());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  int64_t acc = 0, part = 1;
  for (int64_t i = 0; i < n && part < parts; ++i) {
    acc += costs[i];
    while (part < parts && acc * parts >= total * part) bounds[part++] = i + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = bounds[p]; i < bounds[p + 1]; ++i) fn(i, i == bounds[p], i + 1 == bounds[p + 1]);
  });
}
template <typename F>
void for_each_costed(const std::vector<int64_t>& costs, const F& fn) {
  for_each_costed_ranged(costs, [&](int64_t i, bool, bool) { fn(i); });
}

// Runs fn(item, first, last) for every (request, kv head) item (item = request * KVH + head), the cost of
// an item being its context length plus a fixed overhead; first / last: the item opens / closes its
// thread's range. for_each_item: fn(item) alone.
template <typename F>
void for_each_item_ranged(const int64_t* ctx, int64_t B, int64_t KVH, const F& fn) {
  std::vector<int64_t> costs(B * KVH);
  for (int64_t i = 0; i < B * KVH; ++i) costs[i] = ctx[i / KVH] + 32;
  for_each_costed_ranged(costs, fn);
}
template <typename F>
void for_each_item(const int64_t* ctx, int64_t B, int64_t KVH, const F& fn) {
  for_each_item_ranged(ctx, B, KVH, [&](int64_t i, bool, bool) { fn(i); });
}

// Shared by the prefill flash kernels (bf16/int8/fp8 and int4; AVX-512, AMX, AVX2). The work items:
// (sequence, kv head, tile of `tile` query rows), each costed by the keys it reads.
// A unit of prefill work: `rows` query rows from row r0 of sequence p (at positions first_pos, first_pos + 1,
// ... of the sequence) against kv head h.
struct PrefillTile { int64_t p, h, r0, rows, first_pos; };
constexpr int64_t kQueryTile = 16;
inline void prefill_tiles(int64_t P, int64_t KVH, const int64_t* q_len, const int64_t* ctx,
                          std::vector<PrefillTile>& items, std::vector<int64_t>& costs, int64_t tile = kQueryTile) {
  for (int64_t p = 0; p < P; ++p)
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t r0 = 0; r0 < q_len[p]; r0 += tile) {
        items.push_back({p, h, r0, std::min(tile, q_len[p] - r0), ctx[p] - q_len[p] + r0});
        costs.push_back(ctx[p] - q_len[p] + std::min(r0 + tile, q_len[p]) + 64);  // keys the tile reads
      }
}

// One kv head's planes of the cache (K and V [NB * BS][D] each from the head's first row) and, for a quantized
// cache, its per-row parameters (nullptr otherwise). R: one of the row formats below.
template <typename R>
struct HeadPlanes { const typename R::T *k, *v; const float *ks, *vs; };
template <typename R>
HeadPlanes<R> head_planes(const typename R::T* k_cache, const typename R::T* v_cache, const float* k_scale,
                          const float* v_scale, int64_t h, int64_t rows_per_head, int64_t D) {
  const int64_t row0 = h * rows_per_head;
  return {k_cache + row0 * D, v_cache + row0 * D, R::kQuantized ? k_scale + row0 : nullptr,
          R::kQuantized ? v_scale + row0 : nullptr};
}

// decode_avx512's sides (an item's K or V) of up to kWholeSideLines (128 KB) arrive in L2 whole under the
// compute of the side before; of a longer one the first kLeadLines (64 KB) so, the rest that far ahead of
// its own compute (DecodeStreams). decode_avx2 takes sides up to a quarter of the core's L2 whole, 128 KB
// at least (avx2_whole_side_lines).
constexpr int64_t kWholeSideLines = 2048, kLeadLines = 1024;

// The AVX2 kernel computes ~1.5x longer per byte than the AVX-512 one, so a whole side has more time to
// arrive: on host H (2 MB L2) sides of 256 KB (bf16, 2k tokens) ran 2-7% slower streamed with the lead
// than whole, 1 MB ones (8k) 3-8% faster; a quarter of L2 keeps both (128 KB on an EPYC's 512 KB).
inline int64_t avx2_whole_side_lines() {
  static const int64_t lines = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // glibc's reading of CPUID; 0 or -1 if unknown
    return std::max<int64_t>(kWholeSideLines, l2 > 0 ? l2 / 4 / 64 : 0);
  }();
  return lines;
}

// The lines of a list of cache blocks, prefetched into L2 a few at a time while the kernel computes on
// other rows: pace(done, total) issues prefetches until the share issued reaches done / total, so the
// reads are spread evenly over the compute they hide under (a burst of a block's worth stalls on the
// core's fill buffers).
struct L2Stream {
  const char* base = nullptr;
  const int64_t* blocks = nullptr;
  int64_t block_bytes = 0, last_bytes = 0, nblocks = 0, lines = 0, issued = 0, j = 0, off = 0;
  void start(const void* b, const int64_t* blk, int64_t nb, int64_t bytes_per_block, int64_t bytes_of_last) {
    base = static_cast<const char*>(b), blocks = blk, nblocks = nb, block_bytes = bytes_per_block;
    // Each block's lines counted apart: blocks lie anywhere, so two 32-byte blocks (an int4 cache's V scales
    // of 16 tokens) are two lines, not one.
    last_bytes = bytes_of_last, lines = nb == 0 ? 0 : (nb - 1) * ((bytes_per_block + 63) / 64) + (bytes_of_last + 63) / 64;
    issued = j = off = 0;
  }
  void pace(int64_t done, int64_t total) { upto(total <= 0 ? lines : (lines * done + total - 1) / total); }
  // Issues the stream's lines up to the target-th (all of them at most); issue = false only moves past
  // them (lines something else brought in).
  void upto(int64_t target, bool issue = true) {
    target = std::min(lines, target);
    while (issued < target) {  // a run of lines within one block at a time: a plain loop of prefetches
      const int64_t end = j + 1 == nblocks ? last_bytes : block_bytes;
      const char* p = base + blocks[j] * block_bytes + off;
      const int64_t n = std::min(target - issued, (end - off + 63) / 64);
      if (issue)
        for (int64_t i = 0; i < n; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T1);
      issued += n, off += 64 * n;
      if (off >= end) off = 0, ++j;
    }
  }
};

// What arrives in L2 when, for one decode item (a sequence's kv head) of decode_avx512 and decode_avx2: a
// side (its K or V: the rows, and a quantized cache's row parameters in step with them) of up to
// `whole_lines` arrives whole under the compute of the side before it (V under K's, the thread's next
// item's K under V's), paced to end as that compute ends. Of a longer side (at 8k tokens one side is
// 1-2 MB, an AMX core's whole L2 and twice an EPYC core's; a V arriving whole under K's compute evicted
// K's lines before they were read) the first kLeadLines arrive so and the rest kLeadLines ahead of its
// own compute; a quantized V's row parameters still arrive whole under K's compute. The kernel calls
// k_pass / v_pass with the share of K / V it has computed on, k_done between the passes, and v_pass(1, 1)
// at the end; most calls return after one comparison. Those four are inlined: out of line, each call
// spilled the kernel's vector registers (2-4% of a bf16 AMX call on host H).
template <bool kQuantized>
struct DecodeStreams {
  struct Side {
    L2Stream rows, params;
    void start(const void* r, const float* slots, const int64_t* blk, int64_t L, int64_t BS, int64_t row_bytes) {
      const int64_t nb = (L + BS - 1) / BS, last_rows = L - (nb - 1) * BS;
      rows.start(r, blk, nb, BS * row_bytes, last_rows * row_bytes);
      if (kQuantized) params.start(slots, blk, nb, BS * 4, last_rows * 4);
    }
    __attribute__((always_inline)) void upto(int64_t target, bool issue = true) {
      target = std::min(target, rows.lines);
      if (target <= rows.issued) return;  // (most calls: no division below)
      rows.upto(target, issue);
      if (kQuantized) params.upto((params.lines * target + rows.lines - 1) / rows.lines, issue);
    }
  };
  Side k, v, next;  // this item's K and V, the thread's next item's K
  const int64_t whole_lines;
  int64_t side_lines = 0, k_ahead = 0, next_ahead = 0;

  explicit DecodeStreams(int64_t whole) : whole_lines(whole) {}
  int64_t ahead(int64_t lines) const { return lines <= whole_lines ? lines : kLeadLines; }
  static int64_t share(int64_t lines, int64_t done, int64_t total) { return (lines * done + total - 1) / total; }

  // The item's K and V (k_ahead of K's lines counted as already there: they arrived under the item
  // before, or come from touch_k_head).
  void start(const void* k_rows, const float* k_slots, const void* v_rows, const float* v_slots,
             const int64_t* blocks, int64_t L, int64_t BS, int64_t row_bytes) {
    k.start(k_rows, k_slots, blocks, L, BS, row_bytes);
    v.start(v_rows, v_slots, blocks, L, BS, row_bytes);
    side_lines = k.rows.lines, k_ahead = ahead(side_lines);
    k.upto(k_ahead, /*issue=*/false);
  }
  void start_next(const void* k_rows, const float* k_slots, const int64_t* blocks, int64_t L, int64_t BS,
                  int64_t row_bytes) {
    next.start(k_rows, k_slots, blocks, L, BS, row_bytes);
    next_ahead = ahead(next.rows.lines);
  }
  // A thread's first item reads the head of its K (k_ahead lines) in a pure-load pass first: one load per
  // line and nothing else, as many misses in flight as the core allows, the L2 streamer running ahead in
  // each page. A later item's arrived under the item before it.
  void touch_k_head(const void* k_rows, const int64_t* blocks, int64_t L, int64_t BS, int64_t row_bytes) const {
    for (int64_t j = 0, left = 64 * k_ahead; j * BS < L && left > 0; ++j) {
      const char* p = static_cast<const char*>(k_rows) + blocks[j] * BS * row_bytes;
      const int64_t bytes = std::min(left, std::min(BS, L - j * BS) * row_bytes);
      for (int64_t off = 0; off < bytes; off += 64) (void)*reinterpret_cast<const volatile uint64_t*>(p + off);
      left -= bytes;
    }
  }
  __attribute__((always_inline)) void k_pass(int64_t done, int64_t total) {  // done / total of K computed on
    const int64_t f = share(side_lines, done, total);
    if (k_ahead < side_lines) k.upto(f + kLeadLines);
    v.upto(f - (side_lines - k_ahead));
    // V's row parameters whole, whatever the side's length: the pass between K and V reads them all
    // (p times the rows' scales), 8 lines of a 128-token block at a time, scattered.
    if (kQuantized && v.params.issued < v.params.lines) v.params.upto(share(v.params.lines, done, total));
  }
  __attribute__((always_inline)) void k_done() { v.upto(k_ahead); }  // V's share due by the end of the K pass
  __attribute__((always_inline)) void v_pass(int64_t done, int64_t total) {  // done / total of V computed on
    if (v.rows.issued < side_lines) v.upto(share(side_lines, done, total) + kLeadLines);
    if (next.rows.issued < next_ahead) next.upto(share(next_ahead, done, total));
  }
};

// The passes of an int4 prefill tile over its keys (prefill_int4_avx512 and prefill_int4_avx2 share this
// reading of torch_ref._prefill_int4): keys 16 at a time (j0, nk); a sealed block's chunk once for every row
// (sealed(blk, off, nk) loads it dequantized); an open block's chunk once from its sealed version
// (`sealed_k`, `sealed_v` at `sealed_index[blk]`) for the rows past the block and once unquantized for the
// rows inside it (rows(k, v, nk) loads bf16 rows). attend(j0, nk, lo, hi) runs a pass for the rows whose
// position lies in [max(lo, key), hi).
template <int D, typename Sealed, typename Rows, typename Attend>
inline void int4_prefill_passes(int64_t first_pos, int64_t last_pos, const int64_t* blocks, int64_t BS, int64_t h,
                                const int32_t* res_slot, const at::BFloat16* res_k, const at::BFloat16* res_v, int64_t R,
                                const at::BFloat16* sealed_k, const at::BFloat16* sealed_v, const int32_t* sealed_index,
                                int64_t num_sealed, const Sealed& sealed, const Rows& rows, const Attend& attend) {
  for (int64_t j0 = 0; j0 <= last_pos; j0 += 16) {
    const int64_t kb = j0 / BS, blk = blocks[kb], off = j0 % BS, block_end = (kb + 1) * BS;
    const int64_t nk = std::min<int64_t>(16, last_pos + 1 - j0);
    const int32_t slot = res_slot[blk];
    if (slot < 0) {  // sealed: one pass under the causal mask
      sealed(blk, off, nk);
      attend(j0, nk, 0, INT64_MAX);
      continue;
    }
    if (last_pos >= block_end) {  // rows past this block read it as sealed
      const int64_t row0 = (h * num_sealed + sealed_index[blk]) * BS + off;
      rows(sealed_k + row0 * D, sealed_v + row0 * D, nk);
      attend(j0, nk, block_end, INT64_MAX);
    }
    if (first_pos < block_end) {  // rows in this block read it unquantized
      const int64_t row0 = (h * R + slot) * BS + off;
      rows(res_k + row0 * D, res_v + row0 * D, nk);
      attend(j0, nk, 0, block_end);
    }
  }
}

// Where an int4 (KIVI) cache's bytes lie for kv head h (paged_decode_int4's layout): spans(k_side, blk, n,
// fn) calls fn(pointer, bytes) for each run block blk's first n rows occupy on one side: an open block
// (res_slot >= 0) its residual bf16 rows; a sealed one its packed rows, then the K side's channel scales and
// zeros (whole block) or the V side's token scales and zeros. The int4 decode kernels' prefetch and
// pure-load passes walk these.
struct Int4Spans {
  const uint8_t* k_cache;
  const uint8_t* v_cache;
  const at::Half *k_scale, *k_zero, *v_scale, *v_zero;
  const at::BFloat16 *res_k, *res_v;
  const int32_t* res_slot;
  int64_t h, NB, BS, R, D;
  template <typename F>
  void spans(bool k_side, int64_t blk, int64_t n, const F& fn) const {
    const int32_t slot = res_slot[blk];
    if (slot >= 0) return fn((k_side ? res_k : res_v) + (h * R + slot) * BS * D, n * D * 2);
    const int64_t plane = h * NB + blk;
    fn((k_side ? k_cache : v_cache) + plane * BS * (D / 2), n * (D / 2));
    if (k_side) fn(k_scale + plane * D, 2 * D), fn(k_zero + plane * D, 2 * D);
    else fn(v_scale + plane * BS, 2 * n), fn(v_zero + plane * BS, 2 * n);
  }
};

// Row loaders of the portable loop: load(rows, is_v, h, blk, n) writes the first n rows of block blk of
// kv head h (is_v: the V side, else K) as float into rows [n, D]. A policy per cache layout keeps one
// skeleton (decode_kernel) for every dtype.
//
// int8's parameters: the float16 pair (scale, zero) in the row's 4-byte slot (kv/quant.py).
inline void int8_params(const float* slot, float& s, float& z) {
  uint16_t h[2];
  std::memcpy(h, slot, sizeof(h));
  s = static_cast<float>(at::Half(h[0], at::Half::from_bits()));
  z = static_cast<float>(at::Half(h[1], at::Half::from_bits()));
}

// ScaledRows: bf16 / float32 rows as they are, or int8 / fp8 with their rows' 4-byte parameter slots
// k_scale, v_scale [KVH, NB, BS] (nullptr for an unquantized cache): fp8 each value times its row's
// scale, int8 (c + 128) * scale + zero as kv/quant.py dequantizes.
template <typename C>
struct ScaledRows {
  const C* k;
  const C* v;
  const float* k_scale;
  const float* v_scale;
  int64_t NB, BS, D;
  void load(float* rows, bool is_v, int64_t h, int64_t blk, int64_t n) const {
    const int64_t row0 = (h * NB + blk) * BS;
    const C* src = (is_v ? v : k) + row0 * D;
    const float* row_scale = is_v ? v_scale : k_scale;
    for (int64_t t = 0; t < n; ++t) {
      if constexpr (std::is_same_v<C, int8_t>) {
        float s, z;
        int8_params(row_scale + row0 + t, s, z);
        for (int64_t d = 0; d < D; ++d) rows[t * D + d] = (to_float(src[t * D + d]) + 128.f) * s + z;
      } else {
        const float s = row_scale ? row_scale[row0 + t] : 1.f;
        for (int64_t d = 0; d < D; ++d) rows[t * D + d] = to_float(src[t * D + d]) * s;
      }
    }
  }
};

// Int4Rows: int4 in the KIVI layout (pdserve/kv/int4.py, kv/cache.py). A sealed block holds packed 4-bit
// rows [BS, D / 2] (element 2i in the low nibble), keys with a float16 scale and zero per channel over
// the block [D], values per token [BS]; an open block (res_slot[block] >= 0) is read unquantized from
// the residual pool [KVH, R, BS, D] in the query dtype T.
template <typename T>
struct Int4Rows {
  const uint8_t* k;
  const uint8_t* v;
  const at::Half* k_scale;
  const at::Half* k_zero;
  const at::Half* v_scale;
  const at::Half* v_zero;
  const T* res_k;
  const T* res_v;
  const int32_t* res_slot;
  int64_t NB, BS, R, D;
  void load(float* rows, bool is_v, int64_t h, int64_t blk, int64_t n) const {
    const int32_t slot = res_slot[blk];
    if (slot >= 0) {
      const T* src = (is_v ? res_v : res_k) + (h * R + slot) * BS * D;
      for (int64_t i = 0; i < n * D; ++i) rows[i] = to_float(src[i]);
      return;
    }
    const int64_t D2 = D / 2;
    const uint8_t* src = (is_v ? v : k) + (h * NB + blk) * BS * D2;
    const at::Half* sc = is_v ? v_scale : k_scale;
    const at::Half* ze = is_v ? v_zero : k_zero;
    const int64_t group = (h * NB + blk) * (is_v ? BS : D);  // keys: one scale/zero per dim; values: per token
    for (int64_t t = 0; t < n; ++t) {
      float* r = rows + t * D;
      const uint8_t* b = src + t * D2;
      if (!is_v) {
        for (int64_t i = 0; i < D2; ++i) {
          r[2 * i] = static_cast<float>(b[i] & 15) * static_cast<float>(sc[group + 2 * i]) +
                     static_cast<float>(ze[group + 2 * i]);
          r[2 * i + 1] = static_cast<float>(b[i] >> 4) * static_cast<float>(sc[group + 2 * i + 1]) +
                         static_cast<float>(ze[group + 2 * i + 1]);
        }
      } else {
        const float s = static_cast<float>(sc[group + t]), z = static_cast<float>(ze[group + t]);
        for (int64_t i = 0; i < D2; ++i) {
          r[2 * i] = static_cast<float>(b[i] & 15) * s + z;
          r[2 * i + 1] = static_cast<float>(b[i] >> 4) * s + z;
        }
      }
    }
  }
};

// The portable loop: queries T (bf16 or float), cache rows read through a loader (above). Each block's
// rows are converted to float once per (request, kv head), then dotted with every query head of the group.
template <typename T, typename Rows>
void decode_kernel(const T* q, const Rows& rows_of, const int64_t* table, const int64_t* ctx, T* out, int64_t B,
                   int64_t H, int64_t D, int64_t KVH, int64_t BS, int64_t max_blocks, float scale) {
  const int64_t G = H / KVH;
  for_each_item(ctx, B, KVH, [&](int64_t idx) {
    thread_local std::vector<float> qf, acc, scores, rows;
    qf.resize(G * D), acc.resize(G * D), rows.resize(BS * D);
    const int64_t b = idx / KVH, h = idx % KVH, L = ctx[b];
    const int64_t* blocks = table + b * max_blocks;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(q[(b * H + h * G + g) * D + d]) * scale;
    scores.resize(G * L);
    for (int64_t t0 = 0; t0 < L; t0 += BS) {  // one block at a time: BS contiguous rows
      const int64_t n = std::min(BS, L - t0);
      rows_of.load(rows.data(), false, h, blocks[t0 / BS], n);
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
      rows_of.load(rows.data(), true, h, blocks[t0 / BS], n);
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
  });
}


// The shapes with a fast path: query heads per kv head G = 1..8 (SmolLM2 3, Llama-3 4, Qwen2.5 0.5B 7 and
// 1.5B 6) and head_dim 64 or 128. The kernels are templates on both, so per-head state stays in registers
// and loops over dims unroll. Each call returns false (nothing run) for any other value.
constexpr int kMaxGroup = 8;
inline bool is_fast_shape(int64_t G, int64_t D) { return G >= 1 && G <= kMaxGroup && (D == 64 || D == 128); }

template <typename F>
void with_shape(int64_t G, int64_t D, const F& f) {
  const auto with_g = [&](auto d) {
    switch (G) {
      case 1: f(d, std::integral_constant<int, 1>{}); break;
      case 2: f(d, std::integral_constant<int, 2>{}); break;
      case 3: f(d, std::integral_constant<int, 3>{}); break;
      case 4: f(d, std::integral_constant<int, 4>{}); break;
      case 5: f(d, std::integral_constant<int, 5>{}); break;
      case 6: f(d, std::integral_constant<int, 6>{}); break;
      case 7: f(d, std::integral_constant<int, 7>{}); break;
      case 8: f(d, std::integral_constant<int, 8>{}); break;
      default: TORCH_CHECK(false, "no fast path for group size ", G);
    }
  };
  if (D == 64) with_g(std::integral_constant<int, 64>{});
  else if (D == 128) with_g(std::integral_constant<int, 128>{});
  else TORCH_CHECK(false, "no fast path for head_dim ", D);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_HAVE_AVX2 1

constexpr int64_t kPrefetch = 6;  // blocks the int4 kernels prefetch ahead into L1

// A span of memory into L1 (the next chunk of a prefill tile's keys).
inline void prefetch_rows(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}


// Decode for CPUs with AVX2 + FMA and no AVX-512 (AMD EPYC Zen 2/3 among the hosts of this machine kind),
// bf16 queries and a bf16, int8 or fp8 e4m3 cache, the fast shapes above. No bf16 dot product here, so a
// bf16 row is read 16 values (32 bytes) at a time and split into two float vectors without a shuffle: the
// low half of each 32-bit lane shifted up (the even dims), the lane with its low half cleared (the odd
// dims); a quantized row's 16 bytes are put in the same order by one byte shuffle, then widened. The
// query is split the same way once per item, so q.k never reorders K, and p.v accumulates even and odd
// dims apart, interleaved once per output.
namespace avx2 {

inline void split_bf16x16(const void* p, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The horizontal sums of 8 vectors, lane r holding v[r]'s.
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// How the kernel reads each cache dtype's rows: split16(p, e, o) gives 16 values of a row as float, the 8
// even dims and the 8 odd ones. A quantized row (int8 or fp8 e4m3, kv/quant.py) reads as stored * s + m
// with its parameters from the row's 4-byte slot, 8 rows at a time (params8) or one (params1); they are
// applied once per row as in decode_avx512 (q.k times s plus m sum(q); p times s before p.v, and
// sum_t p_t m_t added to every output dim).
struct Bf16Rows2 {
  using T = at::BFloat16;
  static constexpr bool kQuantized = false, kZero = false, kIntDot = false;
  static void split16(const T* p, __m256& e, __m256& o) { split_bf16x16(p, e, o); }
  static void params8(const float*, __m256& s, __m256& m) { s = _mm256_set1_ps(1.f), m = _mm256_setzero_ps(); }
  static void params1(const float*, float& s, float& m) { s = 1.f, m = 0.f; }
};

// 16 bytes, the even ones first, then the odd ones.
inline __m128i deinterleave16(const void* p) {
  return _mm_shuffle_epi8(_mm_loadu_si128(static_cast<const __m128i*>(p)),
                          _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
}

struct Int8Rows2 {
  using T = int8_t;
  static constexpr bool kQuantized = true, kZero = true, kIntDot = true;  // integer q.k and p.v
  static void split16(const T* p, __m256& e, __m256& o) {
    const __m128i d = deinterleave16(p);
    e = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(d));
    o = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(d, 8)));
  }
  // The float16 pairs (scale, zero) of 8 rows (scale in each slot's low half): s, and m = zero + 128 s.
  static void params8(const float* slot, __m256& s, __m256& m) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(slot));
    const auto halves = [](__m256i x) {  // the low 16 bits of 8 lanes as float16 -> float
      return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
    };
    s = halves(_mm256_and_si256(w, _mm256_set1_epi32(0xFFFF)));
    m = _mm256_fmadd_ps(s, _mm256_set1_ps(128.f), halves(_mm256_srli_epi32(w, 16)));
  }
  static void params1(const float* slot, float& s, float& m) {
    float z;
    int8_params(slot, s, z);
    m = z + 128.f * s;
  }
};

struct Fp8Rows2 {
  using T = uint8_t;  // at::Float8_e4m3fn's bits
  static constexpr bool kQuantized = true, kZero = false, kIntDot = false;
  // 8 e4m3 codes (the low 8 bytes of b) as float: a normal code's exponent rebiased (bias 7 -> 127) in
  // place with its 3 mantissa bits on top of float's 23, a subnormal (exponent 0) as m 2^-9, then the sign.
  static __m256 f32x8(__m128i b) {
    const __m256i w = _mm256_cvtepu8_epi32(b);
    const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi32(0x7F));
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512.f));
    const __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
    return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24)));
  }
  static void split16(const T* p, __m256& e, __m256& o) {
    const __m128i d = deinterleave16(p);
    e = f32x8(d), o = f32x8(_mm_srli_si128(d, 8));
  }
  static void params8(const float* slot, __m256& s, __m256& m) { s = _mm256_loadu_ps(slot), m = _mm256_setzero_ps(); }
  static void params1(const float* slot, float& s, float& m) { s = *slot, m = 0.f; }
};

// f(rows) with the row reader (above) of a cache dtype: what the AVX2 kernels are templated on, as
// with_rows picks the AVX-512 kernels' readers.
template <typename F>
void with_rows2(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case torch::kChar: f(Int8Rows2{}); break;
    case torch::kFloat8_e4m3fn: f(Fp8Rows2{}); break;
    default: f(Bf16Rows2{});
  }
}

// 8 consecutive rows (k: the first, rows D apart) as float into kf [8][D], each 16-dim slice as its 8
// even dims then its 8 odd ones: split once, then dotted with every query head of the group.
template <int D, typename R>
inline void split_rows8(const typename R::T* k, float* kf) {
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < D / 16; ++c) {
      __m256 e, o;
      R::split16(k + r * D + 16 * c, e, o);
      _mm256_store_ps(kf + r * D + 16 * c, e), _mm256_store_ps(kf + r * D + 16 * c + 8, o);
    }
}

// q.k of the 8 rows in kf for one query head qs (split the same way): lane r holds row r's.
template <int D>
inline __m256 dots8(const float* qs, const float* kf) {
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int i = 0; i < D / 8; ++i) {
    const __m256 a = _mm256_load_ps(qs + 8 * i);
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(a, _mm256_load_ps(kf + r * D + 8 * i), acc[r]);
  }
  return hsum8(acc);
}

template <int D, typename R>
inline float dot1(const float* qs, const typename R::T* k) {
  __m256 acc = _mm256_setzero_ps();
  for (int c = 0; c < D / 16; ++c) {
    __m256 e, o;
    R::split16(k + 16 * c, e, o);
    acc = _mm256_fmadd_ps(_mm256_load_ps(qs + 16 * c), e, acc);
    acc = _mm256_fmadd_ps(_mm256_load_ps(qs + 16 * c + 8), o, acc);
  }
  return hsum(acc);
}

// int8 K's q.k in integers, as decode_avx512 does it with VNNI: the scaled query heads qs rounded to int16
// steps of max|q| / 32767 (unit[g] is one step; 15 bits, finer than the bf16 query's 8), each K row's
// stored bytes widened to int16 once (one instruction per 16 values) and the exact products summed in
// pairs by vpmaddwd: 16 multiply-adds per instruction where the float path's FMA does 8 and first needs
// the row widened to float (two conversions per 8 values). No overflow: |q| <= 32767 and |c| <= 128
// over at most 256 dims stay below 2^31. Where this runs, q.k is what bounds the kernel (each K row is
// dotted with the G heads of its group), not the bytes.
template <int D, int G>
inline void queries_to_int16(const float (*qs)[D], int16_t (*q16)[D], float* unit) {  // qs: split as split_rows8
  for (int g = 0; g < G; ++g) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_load_ps(qs[g] + d)));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    const float m = _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
    unit[g] = m / 32767.f;
    const __m256 inv = _mm256_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    for (int d = 0; d < D; d += 16) {  // qs's slices hold 8 even dims, then 8 odd: back to dim order
      const __m256 e = _mm256_load_ps(qs[g] + d), o = _mm256_load_ps(qs[g] + d + 8);
      // unpack gives dims 0-3 | 8-11 and 4-7 | 12-15; packs takes 4 of each per 128-bit half: 0-7 | 8-15
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_unpacklo_ps(e, o), inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_unpackhi_ps(e, o), inv));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q16[g] + d), _mm256_packs_epi32(lo, hi));
    }
  }
}

// 8 consecutive int8 rows (k: the first, rows D apart) widened to int16 into kw [8][D], dims in order.
template <int D>
inline void widen_rows8(const int8_t* k, int16_t* kw) {
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < D / 16; ++c)
      _mm256_store_si256(reinterpret_cast<__m256i*>(kw + r * D + 16 * c),
                         _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + r * D + 16 * c))));
}

// The integer q.k of the 8 rows in kw for one int16 query head: lane r holds row r's, as float (exact
// below 2^24, rounded to float's 24 bits above: as fine as the float path's sums).
template <int D>
inline __m256 int_dots8(const int16_t* q16, const int16_t* kw) {
  __m256i qv[D / 16], acc[8];
  for (int c = 0; c < D / 16; ++c) qv[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(q16 + 16 * c));
  for (int r = 0; r < 8; ++r) {
    acc[r] = _mm256_madd_epi16(qv[0], _mm256_load_si256(reinterpret_cast<const __m256i*>(kw + r * D)));
    for (int c = 1; c < D / 16; ++c)
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(qv[c], _mm256_load_si256(reinterpret_cast<const __m256i*>(kw + r * D + 16 * c))));
  }
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[4], acc[5]), _mm256_hadd_epi32(acc[6], acc[7]));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31)));
}

// 2^x for x <= ~0 as exp2_ps (AVX-512) does it, 2^n built in the exponent field; 0 below 2^-100.
inline __m256 exp2_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kSoftmaxFlushLog2);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), keep);
}

// Softmax of L scores in place, 8 lanes at a time; s has room for L rounded up to 8 (the pad is written).
inline void softmax(float* s, int64_t L) {
  const int64_t L8 = (L + 7) & ~int64_t{7};
  for (int64_t t = L; t < L8; ++t) s[t] = -FLT_MAX;
  __m256 m0 = _mm256_set1_ps(-FLT_MAX), m1 = m0;
  int64_t t = 0;
  for (; t + 16 <= L8; t += 16)
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + t)), m1 = _mm256_max_ps(m1, _mm256_loadu_ps(s + t + 8));
  if (t < L8) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + t));
  m0 = _mm256_max_ps(m0, m1);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  const float m = _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  const __m256 log2e = _mm256_set1_ps(1.4426950408889634f), shift = _mm256_set1_ps(m * 1.4426950408889634f);
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t < L8; t += 8) {
    const __m256 e = exp2_ps(_mm256_fmsub_ps(_mm256_loadu_ps(s + t), log2e, shift));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.f / hsum(sum));
  for (t = 0; t < L8; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
}

// p.v over one block's n rows for heads G0 .. G0 + GC - 1: accm[g] holds a head's sums as 16-dim slices of
// 8 even then 8 odd dims; p + g * stride + t head g's weight of row t; row(t, c, e, o) gives slice c of row
// t split that way (a cache dtype's split16, or an int4 row's nibbles). GC <= 4 heads at a time keep 2 GC
// accumulators and the row's two halves in the 16 vector registers.
template <int D, int G0, int GC, typename Row>
inline void pv_heads(float (*accm)[D], const float* p, int64_t stride, int64_t n, const Row& row) {
  for (int c = 0; c < D / 16; ++c) {
    __m256 ae[GC], ao[GC];
    for (int g = 0; g < GC; ++g) ae[g] = _mm256_load_ps(accm[G0 + g] + 16 * c), ao[g] = _mm256_load_ps(accm[G0 + g] + 16 * c + 8);
    for (int64_t t = 0; t < n; ++t) {
      __m256 e, o;
      row(t, c, e, o);
      for (int g = 0; g < GC; ++g) {
        const __m256 w = _mm256_broadcast_ss(p + (G0 + g) * stride + t);
        ae[g] = _mm256_fmadd_ps(w, e, ae[g]);
        ao[g] = _mm256_fmadd_ps(w, o, ao[g]);
      }
    }
    for (int g = 0; g < GC; ++g) _mm256_store_ps(accm[G0 + g] + 16 * c, ae[g]), _mm256_store_ps(accm[G0 + g] + 16 * c + 8, ao[g]);
  }
}
template <int D, int G, int G0 = 0, typename Row>
inline void pv_rows(float (*accm)[D], const float* p, int64_t stride, int64_t n, const Row& row) {
  constexpr int kChunks = (G - G0 + 3) / 4, GC = (G - G0 + kChunks - 1) / kChunks;  // 7 heads: 4 + 3
  pv_heads<D, G0, GC>(accm, p, stride, n, row);
  if constexpr (G0 + GC < G) pv_rows<D, G, G0 + GC>(accm, p, stride, n, row);
}
// p.v over n rows of a cache dtype (R above; v: the first row, rows D apart).
template <int D, int G, typename R>
inline void pv_block(float (*accm)[D], const float* p, int64_t stride, int64_t n, const typename R::T* v) {
  pv_rows<D, G>(accm, p, stride, n, [v](int64_t t, int c, __m256& e, __m256& o) { R::split16(v + t * D + 16 * c, e, o); });
}

// 16 floats (dims 0-7 in a, 8-15 in b) as 16 bf16, rounded to nearest even.
inline void store_bf16x16_ordered(at::BFloat16* out, __m256 a, __m256 b) {
  const auto round = [](__m256 x) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  };
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round(a), round(b)), _MM_SHUFFLE(3, 1, 2, 0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
}

// 16 floats (8 even dims e, 8 odd dims o of one slice) as 16 bf16 in dim order, rounded to nearest even.
inline void store_bf16x16(at::BFloat16* out, __m256 e, __m256 o) {
  const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
  store_bf16x16_ordered(out, _mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// int8 V's p.v in integers too: per block (at most kPvRows rows at a time), each head's weights p_t
// (already times the rows' V scales) rounded to int16 steps of a power of two (the largest weight at
// 2^14 .. 2^15 steps: an exact step, so a one-token context reproduces its row exactly), two rows'
// bytes interleaved and widened to int16 (dim d of row t, then of row t + 1), and vpmaddwd sums each
// pair of products against the two weights broadcast as one int32: 16 multiply-adds per instruction
// into int32 sums per dim, added to the float accumulators once per block. The weights' rounding
// (at most 2^-15 of the block's largest) is finer than the int8 V it multiplies.
constexpr int64_t kPvRows = 256;  // |w| <= 32767 times |c| <= 128, 256 rows: below 2^31
// (w16 rows hold kPvRows + 16: 32-byte aligned, and room for an odd block's zero weight)

template <int D, int G0, int GC>
inline void int_pv_heads(float (*accm)[D], const int16_t (*w16)[kPvRows + 16], const float* unit, int64_t n, const int8_t* v) {
  const int64_t pairs = (n + 1) / 2;
  for (int c = 0; c < D / 16; ++c) {
    __m256i lo[GC], hi[GC];  // dims 0-7 and 8-15 of the slice
    for (int g = 0; g < GC; ++g) lo[g] = hi[g] = _mm256_setzero_si256();
    for (int64_t i = 0; i < pairs; ++i) {
      const int8_t* r0 = v + 2 * i * D + 16 * c;
      const int8_t* r1 = 2 * i + 1 < n ? r0 + D : r0;  // an odd last row pairs with itself, weight 0
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1));
      const __m256i x = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)), y = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b));
      for (int g = 0; g < GC; ++g) {
        int32_t pair;
        std::memcpy(&pair, w16[G0 + g] + 2 * i, sizeof(pair));
        const __m256i w = _mm256_set1_epi32(pair);
        lo[g] = _mm256_add_epi32(lo[g], _mm256_madd_epi16(w, x));
        hi[g] = _mm256_add_epi32(hi[g], _mm256_madd_epi16(w, y));
      }
    }
    for (int g = 0; g < GC; ++g) {
      const __m256 u = _mm256_set1_ps(unit[G0 + g]);
      float* a = accm[G0 + g] + 16 * c;
      _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[g]), u, _mm256_load_ps(a)));
      _mm256_store_ps(a + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[g]), u, _mm256_load_ps(a + 8)));
    }
  }
}
template <int D, int G, int G0 = 0>
inline void int_pv_chunks(float (*accm)[D], const int16_t (*w16)[kPvRows + 16], const float* unit, int64_t n, const int8_t* v) {
  constexpr int kChunks = (G - G0 + 3) / 4, GC = (G - G0 + kChunks - 1) / kChunks;  // as pv_block
  int_pv_heads<D, G0, GC>(accm, w16, unit, n, v);
  if constexpr (G0 + GC < G) int_pv_chunks<D, G, G0 + GC>(accm, w16, unit, n, v);
}

// The G heads' weights of m <= kPvRows rows (head g's from p + g * stride; >= 0) in int16 steps of a power
// of two, as above: unit[g] is head g's step; w16[g][m] = 0 (an odd block's last pair). Shared with the
// AVX512-VNNI p.v (int_pv_block_vnni).
template <int G>
inline void int16_weights(const float* p, int64_t stride, int64_t m, int16_t (*w16)[kPvRows + 16], float* unit) {
  for (int g = 0; g < G; ++g) {
    const float* pg = p + g * stride;
    float mx = 0.f;  // weights are >= 0
    for (int64_t t = 0; t < m; ++t) mx = std::max(mx, pg[t]);
    int e;
    std::frexp(mx, &e);  // mx in [2^(e-1), 2^e): mx / 2^(e-15) in [2^14, 2^15)
    const bool live = mx > 0.f && e > -100;  // a block of weights below 2^-100 adds nothing
    unit[g] = live ? std::ldexp(1.f, e - 15) : 0.f;
    const float step_inv = live ? std::ldexp(1.f, 15 - e) : 0.f;
    const __m256 inv = _mm256_set1_ps(step_inv);
    int64_t t = 0;
    for (; t + 16 <= m; t += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(pg + t), inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(pg + t + 8), inv));
      _mm256_store_si256(reinterpret_cast<__m256i*>(w16[g] + t),
                         _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), _MM_SHUFFLE(3, 1, 2, 0)));
    }
    for (; t < m; ++t) w16[g][t] = static_cast<int16_t>(std::min(32767.f, std::nearbyint(pg[t] * step_inv)));
    w16[g][m] = 0;  // an odd block's last pair
  }
}

// p.v over one block's n int8 rows (v: the first) for the G heads, accm [G][D] in dim order; p + g *
// stride + t head g's weight of row t (with the row's V scale).
template <int D, int G>
inline void int_pv_block(float (*accm)[D], const float* p, int64_t stride, int64_t n, const int8_t* v) {
  alignas(32) int16_t w16[G][kPvRows + 16];
  float unit[G];
  for (int64_t t0 = 0; t0 < n; t0 += kPvRows) {
    const int64_t m = std::min(kPvRows, n - t0);
    int16_weights<G>(p + t0, stride, m, w16, unit);
    int_pv_chunks<D, G>(accm, w16, unit, m, v + t0 * D);
  }
}

// An 8 x 8 block of floats transposed in registers: lane j of r[i] becomes lane i of r[j].
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

}  // namespace avx2

// head_dim D, G query heads per kv head, on AVX2 + FMA, a bf16, int8 or fp8 e4m3 cache (R above): scores
// 8 rows at a time (one vector of 8 sums per head), the softmax 8 lanes at a time, p.v by 16-dim slices of
// V (avx2::pv_block). An int8 cache (R::kIntDot) does both sides in integers: q.k by int_dots8, p.v by
// int_pv_block (its accumulators in dim order). Memory as decode_avx512: DecodeStreams (V into L2 under
// the K pass, the thread's next item's K under p.v; long sides a fixed lead ahead).
template <int D, int G, typename R>
void decode_avx2(const at::BFloat16* q, const typename R::T* k_cache, const typename R::T* v_cache, const float* k_scale,
                 const float* v_scale, const int64_t* table, const int64_t* ctx, at::BFloat16* out, int64_t B, int64_t H,
                 int64_t KVH, int64_t NB, int64_t BS, int64_t max_blocks, float scale) {
  using T = typename R::T;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  for_each_item_ranged(ctx, B, KVH, [&](int64_t idx, bool first, bool last) {
    thread_local std::vector<float> scores;
    const int64_t b = idx / KVH, h = idx % KVH, L = ctx[b];
    const int64_t* blocks = table + b * max_blocks;
    const int64_t nblocks = (L + BS - 1) / BS;
    const int64_t stride = nblocks * BS + 8;  // room for 8-row groups past L
    scores.resize(G * stride);
    const auto [kh, vh, ksh, vsh] = head_planes<R>(k_cache, v_cache, k_scale, v_scale, h, NB * BS, D);
    DecodeStreams<R::kQuantized> st(avx2_whole_side_lines());
    st.start(kh, ksh, vh, vsh, blocks, L, BS, row_bytes);
    if (!last) {
      const int64_t b1 = (idx + 1) / KVH, h1 = (idx + 1) % KVH;
      st.start_next(k_cache + h1 * NB * BS * D, R::kQuantized ? k_scale + h1 * NB * BS : nullptr,
                    table + b1 * max_blocks, ctx[b1], BS, row_bytes);
    }
    if (first) st.touch_k_head(kh, blocks, L, BS, row_bytes);
    alignas(32) float qs[G][D], kf[R::kIntDot ? 1 : 8 * D];  // the query heads times scale; 8 K rows, split (split_rows8)
    alignas(32) int16_t q16[R::kIntDot ? G : 1][D], kw[R::kIntDot ? 8 * D : 1];  // int8: qs in int16 steps, 8 K rows
    float q_unit[G];
    float q_sum[G] = {};  // int8: each scaled head's sum of its dims (the share of the rows' offsets m in q.k)
    for (int g = 0; g < G; ++g) {
      const at::BFloat16* qg = q + (b * H + h * G + g) * D;
      const __m256 s = _mm256_set1_ps(scale);
      __m256 sum = _mm256_setzero_ps();
      for (int c = 0; c < D / 16; ++c) {
        __m256 e, o;
        avx2::split_bf16x16(qg + 16 * c, e, o);
        e = _mm256_mul_ps(e, s), o = _mm256_mul_ps(o, s);
        _mm256_store_ps(qs[g] + 16 * c, e), _mm256_store_ps(qs[g] + 16 * c + 8, o);
        sum = _mm256_add_ps(sum, _mm256_add_ps(e, o));
      }
      if constexpr (R::kZero) q_sum[g] = avx2::hsum(sum);
    }
    if constexpr (R::kIntDot) avx2::queries_to_int16<D, G>(qs, q16, q_unit);
    for (int64_t j = 0; j < nblocks; ++j) {
      const T* kb = kh + blocks[j] * BS * D;
      const float* ksb = R::kQuantized ? ksh + blocks[j] * BS : nullptr;
      const int64_t t0 = j * BS, n = std::min(BS, L - t0);
      int64_t t = 0;
      for (; t + 8 <= BS && t < n; t += 8) {  // 8 rows at a time (rows past n are read, never used)
        st.k_pass(t0 + t + 8, L);
        if constexpr (R::kIntDot) avx2::widen_rows8<D>(kb + t * D, kw);
        else avx2::split_rows8<D, R>(kb + t * D, kf);
        __m256 rs, rm;
        R::params8(R::kQuantized ? ksb + t : nullptr, rs, rm);
        for (int g = 0; g < G; ++g) {
          __m256 sc;
          if constexpr (R::kIntDot) sc = _mm256_mul_ps(avx2::int_dots8<D>(q16[g], kw), _mm256_mul_ps(rs, _mm256_set1_ps(q_unit[g])));
          else sc = avx2::dots8<D>(qs[g], kf);
          if constexpr (R::kQuantized && !R::kIntDot) sc = _mm256_mul_ps(sc, rs);
          if constexpr (R::kZero) sc = _mm256_fmadd_ps(rm, _mm256_set1_ps(q_sum[g]), sc);
          _mm256_storeu_ps(scores.data() + g * stride + t0 + t, sc);
        }
      }
      for (; t < n; ++t) {  // blocks of other than a multiple of 8 tokens
        float rs, rm;
        R::params1(R::kQuantized ? ksb + t : nullptr, rs, rm);
        for (int g = 0; g < G; ++g) scores[g * stride + t0 + t] = avx2::dot1<D, R>(qs[g], kb + t * D) * rs + rm * q_sum[g];
      }
    }
    for (int g = 0; g < G; ++g) avx2::softmax(scores.data() + g * stride, L);
    float z_sum[G] = {};  // int8: sum_t p_t m_t per head, added to every output dim
    if constexpr (R::kQuantized) {  // p * v_scale over the whole context: V rows then enter p.v unscaled
      __m256 zacc[G];
      for (int g = 0; g < G; ++g) zacc[g] = _mm256_setzero_ps();
      for (int64_t j = 0; j < nblocks; ++j) {
        const float* vsb = vsh + blocks[j] * BS;
        const int64_t t0 = j * BS, n = std::min(BS, L - t0);
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
          __m256 vs, vm;
          R::params8(vsb + t, vs, vm);
          for (int g = 0; g < G; ++g) {
            float* p = scores.data() + g * stride + t0 + t;
            const __m256 pv = _mm256_loadu_ps(p);
            if constexpr (R::kZero) zacc[g] = _mm256_fmadd_ps(pv, vm, zacc[g]);
            _mm256_storeu_ps(p, _mm256_mul_ps(pv, vs));
          }
        }
        for (; t < n; ++t) {
          float vs, vm;
          R::params1(vsb + t, vs, vm);
          for (int g = 0; g < G; ++g) {
            float& p = scores[g * stride + t0 + t];
            z_sum[g] += p * vm;
            p *= vs;
          }
        }
      }
      if constexpr (R::kZero)
        for (int g = 0; g < G; ++g) z_sum[g] += avx2::hsum(zacc[g]);
    }
    st.k_done();
    alignas(32) float accm[G][D];
    std::memset(accm, 0, sizeof(accm));
    for (int64_t j = 0; j < nblocks; ++j) {
      const int64_t t0 = j * BS, n = std::min(BS, L - t0);
      st.v_pass(t0 + n, L);
      if constexpr (R::kIntDot) avx2::int_pv_block<D, G>(accm, scores.data() + t0, stride, n, vh + blocks[j] * BS * D);
      else avx2::pv_block<D, G, R>(accm, scores.data() + t0, stride, n, vh + blocks[j] * BS * D);
    }
    st.v_pass(1, 1);
    for (int g = 0; g < G; ++g) {
      const __m256 z = _mm256_set1_ps(z_sum[g]);
      for (int c = 0; c < D / 16; ++c) {
        const __m256 x0 = _mm256_add_ps(_mm256_load_ps(accm[g] + 16 * c), z);
        const __m256 x1 = _mm256_add_ps(_mm256_load_ps(accm[g] + 16 * c + 8), z);
        at::BFloat16* o = out + (b * H + h * G + g) * D + 16 * c;
        if constexpr (R::kIntDot) avx2::store_bf16x16_ordered(o, x0, x1);  // int_pv_block's accm: dims in order
        else avx2::store_bf16x16(o, x0, x1);
      }
    }
  });
}
namespace avx2 {
// 16 elements of an int4 row (8 packed bytes: byte i holds element 2i low, 2i + 1 high) as float, split as
// split16 splits a bf16 slice: the 8 even elements (the low nibbles), then the 8 odd ones (the high).
inline void int4_split16(const uint8_t* p, __m256& e, __m256& o) {
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  e = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
  o = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
}
// 16 float16 values (p: the first) as float, split the same way: 8 even, then 8 odd.
inline void half_split16(const at::Half* p, __m256& e, __m256& o) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const auto halves = [](__m256i x) {  // the low 16 bits of 8 lanes as float16 -> float
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
  };
  e = halves(_mm256_and_si256(w, _mm256_set1_epi32(0xFFFF)));
  o = halves(_mm256_srli_epi32(w, 16));
}
}  // namespace avx2

// Decode over an int4 (KIVI) cache on AVX2 + FMA (no AVX-512), paged_decode_int4's layout, bf16 queries
// and residual pool, blocks of a multiple of 16 tokens; the maths of decode_int4_avx512 in float32
// throughout (no bf16 dot product here, so q_c s_c is not rounded):
// - keys, per channel within a sealed block: q.k = sum_c (q_c s_c) n_c + sum_c q_c z_c; once per block
//   the G heads take the channel scales (G x D multiplies) and one constant per head (the zeros' share);
//   8 rows' nibbles become float into L1 and go through dots8 as a bf16 block's split rows do.
// - values, per token: the scale folded into p, sum_t p_t z_t one scalar per head added at the end.
// Every slice is read split (8 even elements, 8 odd: what unpacking nibbles gives without a shuffle), as
// decode_avx2 reads bf16 rows; open blocks (res_slot >= 0) read their bf16 rows exactly as it does.
// Memory: a pure-load pass over the item's K side before the K pass and its V side before p.v, and the
// next kPrefetch blocks prefetched into L1 (decode_int4_avx512 now streams each side into L2 under the
// compute of the side before instead, 0.96-1.21x on an AVX-512 host; not yet measured here on an AVX2 one).
template <int D, int G>
void decode_int4_avx2(const at::BFloat16* q, const uint8_t* k_cache, const uint8_t* v_cache, const at::Half* k_scale,
                      const at::Half* k_zero, const at::Half* v_scale, const at::Half* v_zero,
                      const at::BFloat16* res_k, const at::BFloat16* res_v, const int32_t* res_slot,
                      const int64_t* table, const int64_t* ctx, at::BFloat16* out, int64_t B, int64_t H, int64_t KVH,
                      int64_t NB, int64_t BS, int64_t R, int64_t max_blocks, float scale) {
  constexpr int D2 = D / 2;
  const int64_t packed_bytes = BS * D2;
  for_each_item(ctx, B, KVH, [&](int64_t idx) {
    thread_local std::vector<float> scores;
    const int64_t b = idx / KVH, h = idx % KVH, L = ctx[b];
    const int64_t* blocks = table + b * max_blocks;
    const int64_t nblocks = (L + BS - 1) / BS;
    const int64_t stride = nblocks * BS + 8;  // room for 8-row groups past L
    scores.resize(G * stride);
    const auto open_rows = [&](const at::BFloat16* pool, int32_t slot) { return pool + (h * R + slot) * BS * D; };
    const auto packed = [&](const uint8_t* cache, int64_t blk) { return cache + (h * NB + blk) * packed_bytes; };
    const Int4Spans where{k_cache, v_cache, k_scale, k_zero, v_scale, v_zero, res_k, res_v, res_slot, h, NB, BS, R, D};
    const auto prefetch_block = [&](int64_t a) {  // block a's K side (or, past the last, V block a - nblocks)
      where.spans(a < nblocks, blocks[a < nblocks ? a : a - nblocks], BS, prefetch_rows);
    };
    const auto warm = [&](bool k_side) {  // one load per cache line of the item's K (or V) side
      __m256i x = _mm256_setzero_si256();
      const auto lines = [&](const void* p, int64_t bytes) {
        for (int64_t off = 0; off < bytes; off += 64)
          x = _mm256_or_si256(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const char*>(p) + off)));
      };
      for (int64_t j = 0; j < nblocks; ++j) where.spans(k_side, blocks[j], std::min(BS, L - j * BS), lines);
      asm volatile("" : : "x"(x));  // keeps the loads
    };
    alignas(32) float qs[G][D], qsc[G][D], kf[8 * D];  // queries x softmax scale; x a block's channel scales; 8 rows
    for (int g = 0; g < G; ++g) {
      const at::BFloat16* qg = q + (b * H + h * G + g) * D;
      for (int c = 0; c < D / 16; ++c) {
        __m256 e, o;
        avx2::split_bf16x16(qg + 16 * c, e, o);
        _mm256_store_ps(qs[g] + 16 * c, _mm256_mul_ps(e, _mm256_set1_ps(scale)));
        _mm256_store_ps(qs[g] + 16 * c + 8, _mm256_mul_ps(o, _mm256_set1_ps(scale)));
      }
    }
    warm(true);
    for (int64_t a = 0; a < kPrefetch && a < 2 * nblocks; ++a) prefetch_block(a);
    for (int64_t j = 0; j < nblocks; ++j) {
      if (j + kPrefetch < 2 * nblocks) prefetch_block(j + kPrefetch);
      const int64_t blk = blocks[j], t0 = j * BS, n = std::min(BS, L - t0);
      const int32_t slot = res_slot[blk];
      float kconst[G] = {};
      if (slot < 0) {  // sealed: the block's channel scales into the queries, the zeros into a constant per head
        const at::Half* ksb = k_scale + (h * NB + blk) * D;
        const at::Half* kzb = k_zero + (h * NB + blk) * D;
        __m256 zsum[G];
        for (int g = 0; g < G; ++g) zsum[g] = _mm256_setzero_ps();
        for (int c = 0; c < D / 16; ++c) {
          __m256 se, so, ze, zo;
          avx2::half_split16(ksb + 16 * c, se, so);
          avx2::half_split16(kzb + 16 * c, ze, zo);
          for (int g = 0; g < G; ++g) {
            const __m256 e = _mm256_load_ps(qs[g] + 16 * c), o = _mm256_load_ps(qs[g] + 16 * c + 8);
            _mm256_store_ps(qsc[g] + 16 * c, _mm256_mul_ps(e, se)), _mm256_store_ps(qsc[g] + 16 * c + 8, _mm256_mul_ps(o, so));
            zsum[g] = _mm256_fmadd_ps(e, ze, _mm256_fmadd_ps(o, zo, zsum[g]));
          }
        }
        for (int g = 0; g < G; ++g) kconst[g] = avx2::hsum(zsum[g]);
      }
      const uint8_t* kb = packed(k_cache, blk);
      const at::BFloat16* kr = slot >= 0 ? open_rows(res_k, slot) : nullptr;
      for (int64_t t = 0; t < n; t += 8) {  // rows past n are read (the block has BS rows), never used
        for (int r = 0; r < 8; ++r)
          for (int c = 0; c < D / 16; ++c) {
            __m256 e, o;
            if (kr) avx2::split_bf16x16(kr + (t + r) * D + 16 * c, e, o);
            else avx2::int4_split16(kb + (t + r) * D2 + 8 * c, e, o);
            _mm256_store_ps(kf + r * D + 16 * c, e), _mm256_store_ps(kf + r * D + 16 * c + 8, o);
          }
        for (int g = 0; g < G; ++g)
          _mm256_storeu_ps(scores.data() + g * stride + t0 + t,
                           _mm256_add_ps(avx2::dots8<D>(kr ? qs[g] : qsc[g], kf), _mm256_set1_ps(kconst[g])));
      }
    }
    for (int g = 0; g < G; ++g) avx2::softmax(scores.data() + g * stride, L);
    warm(false);
    alignas(32) float accm[G][D];  // split as the rows: per 16-dim slice 8 even, 8 odd
    std::memset(accm, 0, sizeof(accm));
    __m256 zacc[G];  // sum_t p_t z_t, per lane (and the rows of blocks not a multiple of 8 long in z_tail)
    float z_tail[G] = {};
    for (int g = 0; g < G; ++g) zacc[g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nblocks; ++j) {
      if (j + kPrefetch < nblocks) prefetch_block(nblocks + j + kPrefetch);
      const int64_t blk = blocks[j], t0 = j * BS, n = std::min(BS, L - t0);
      const int32_t slot = res_slot[blk];
      if (slot >= 0) {
        const at::BFloat16* vr = open_rows(res_v, slot);
        avx2::pv_rows<D, G>(accm, scores.data() + t0, stride, n, [vr](int64_t t, int c, __m256& e, __m256& o) {
          avx2::split_bf16x16(vr + t * D + 16 * c, e, o);
        });
        continue;
      }
      const at::Half* vsb = v_scale + (h * NB + blk) * BS;
      const at::Half* vzb = v_zero + (h * NB + blk) * BS;
      int64_t t = 0;  // p_t s_t in place of p_t, and p_t z_t into zacc
      for (; t + 8 <= n; t += 8) {
        const __m256 vs = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vsb + t)));
        const __m256 vz = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vzb + t)));
        for (int g = 0; g < G; ++g) {
          float* p = scores.data() + g * stride + t0 + t;
          const __m256 pv = _mm256_loadu_ps(p);
          zacc[g] = _mm256_fmadd_ps(pv, vz, zacc[g]);
          _mm256_storeu_ps(p, _mm256_mul_ps(pv, vs));
        }
      }
      for (; t < n; ++t) {
        const float vs = static_cast<float>(vsb[t]), vz = static_cast<float>(vzb[t]);
        for (int g = 0; g < G; ++g) {
          float& p = scores[g * stride + t0 + t];
          z_tail[g] += p * vz;
          p *= vs;
        }
      }
      const uint8_t* vb = packed(v_cache, blk);
      avx2::pv_rows<D, G>(accm, scores.data() + t0, stride, n, [vb](int64_t t, int c, __m256& e, __m256& o) {
        avx2::int4_split16(vb + t * (D / 2) + 8 * c, e, o);
      });
    }
    for (int g = 0; g < G; ++g) {
      const __m256 z = _mm256_set1_ps(avx2::hsum(zacc[g]) + z_tail[g]);
      at::BFloat16* o = out + (b * H + h * G + g) * D;
      for (int c = 0; c < D / 16; ++c)
        avx2::store_bf16x16(o + 16 * c, _mm256_add_ps(_mm256_load_ps(accm[g] + 16 * c), z),
                            _mm256_add_ps(_mm256_load_ps(accm[g] + 16 * c + 8), z));
    }
  });
}

// The AVX2 flash prefill's pieces, shared by prefill_avx2 (a bf16, int8 or fp8 cache) and prefill_int4_avx2:
// a tile of 8 query rows in the lanes of a vector, keys 16 at a time (a chunk). Queries and p.v sums are
// stored dims x rows, each 16-dim slice split as decode_avx2 splits rows (8 even dims, then 8 odd: q.k does
// not care, and the output is interleaved back once per tile); the chunk's K and V rows are float in L1,
// split the same way; the online softmax is lane-wise (no horizontal max or sum).
namespace avx2 {
constexpr int64_t kTileRows = 8, kChunkKeys = 16;

template <int D, int G>
struct FlashTile {
  alignas(32) float qt[G][D][kTileRows];   // the tile's queries, split dims x rows
  alignas(32) float acc[G][D][kTileRows];  // p.v sums, split dims x rows
  __m256 m[G], l[G], qsum[G], zacc[G];     // per row: running max, sum; int8: sum_d q_d, sum_t p_t m_t

  // The tile's rows (q0: the first, rows q_row apart; rows past `rows` zero) split and transposed.
  void start(const at::BFloat16* q0, int64_t q_row, int64_t rows) {
    const __m256 neg_big = _mm256_set1_ps(-1e30f);  // finite: -ffast-math assumes no infinities
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < D / 16; ++c) {
        __m256 e[kTileRows], o[kTileRows];
        for (int i = 0; i < kTileRows; ++i) {
          if (i < rows) split_bf16x16(q0 + i * q_row + g * D + 16 * c, e[i], o[i]);
          else e[i] = o[i] = _mm256_setzero_ps();
        }
        transpose8(e), transpose8(o);
        for (int j = 0; j < 8; ++j) _mm256_store_ps(qt[g][16 * c + j], e[j]), _mm256_store_ps(qt[g][16 * c + 8 + j], o[j]);
      }
      __m256 sum = _mm256_setzero_ps();
      for (int d = 0; d < D; ++d) _mm256_store_ps(acc[g][d], _mm256_setzero_ps()), sum = _mm256_add_ps(sum, _mm256_load_ps(qt[g][d]));
      m[g] = neg_big, l[g] = zacc[g] = _mm256_setzero_ps(), qsum[g] = sum;
    }
  }

  // One chunk: kf, vf its keys' rows as float (split; rows past nk zero); scores times `scale2` (the
  // softmax scale in log2 units) or, with a quantized cache (R::kQuantized), times kmul[t] (plus kzero[t]
  // sum(q) with R::kZero), probabilities times vmul[t] before p.v (and vzero[t] into zacc). hide[t], where
  // given, has the lanes of the rows that do not read key t set: their scores are dropped and their
  // probabilities zeroed (a row may read no key of a chunk).
  template <typename R>
  void attend(const float (*kf)[D], const float (*vf)[D], int64_t nk, __m256 scale2, const float* kmul,
              const float* kzero, const float* vmul, const float* vzero, const __m256* hide) {
    const __m256 neg_big = _mm256_set1_ps(-1e30f);
    alignas(32) float pt[kChunkKeys][kTileRows];  // one head's scores, then probabilities, keys x rows
    for (int g = 0; g < G; ++g) {
      for (int64_t t0 = 0; t0 < kChunkKeys; t0 += 8) {  // scores of 8 keys: 8 chains over the dims
        __m256 a[8];
        for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
        for (int d = 0; d < D; ++d) {
          const __m256 qv = _mm256_load_ps(qt[g][d]);
          for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(kf[t0 + t] + d), a[t]);
        }
        for (int t = 0; t < 8; ++t) _mm256_store_ps(pt[t0 + t], a[t]);
      }
      __m256 mx = neg_big;
      for (int64_t t = 0; t < kChunkKeys; ++t) {
        __m256 s = _mm256_load_ps(pt[t]);
        if constexpr (R::kZero)
          s = _mm256_fmadd_ps(s, _mm256_set1_ps(kmul[t]), _mm256_mul_ps(qsum[g], _mm256_set1_ps(kzero[t])));
        else
          s = _mm256_mul_ps(s, R::kQuantized ? _mm256_set1_ps(kmul[t]) : scale2);
        if (hide) s = _mm256_blendv_ps(s, neg_big, hide[t]);
        _mm256_store_ps(pt[t], s);
        mx = _mm256_max_ps(mx, s);
      }
      const __m256 m_new = _mm256_max_ps(m[g], mx);
      const __m256 alpha = exp2_ps(_mm256_sub_ps(m[g], m_new));
      m[g] = m_new;
      __m256 sum = _mm256_setzero_ps(), z = _mm256_mul_ps(zacc[g], alpha);
      for (int64_t t = 0; t < kChunkKeys; ++t) {
        __m256 e = exp2_ps(_mm256_sub_ps(_mm256_load_ps(pt[t]), m_new));
        if (hide) e = _mm256_andnot_ps(hide[t], e);
        sum = _mm256_add_ps(sum, e);
        if constexpr (R::kZero) z = _mm256_fmadd_ps(e, _mm256_set1_ps(vzero[t]), z);
        if constexpr (R::kQuantized) e = _mm256_mul_ps(e, _mm256_set1_ps(vmul[t]));
        _mm256_store_ps(pt[t], e);
      }
      l[g] = _mm256_fmadd_ps(l[g], alpha, sum);
      zacc[g] = z;
      for (int dc = 0; dc < D; dc += 8) {  // p.v, 8 dims at a time
        __m256 a[8];
        for (int k = 0; k < 8; ++k) a[k] = _mm256_mul_ps(_mm256_load_ps(acc[g][dc + k]), alpha);
        for (int64_t t = 0; t < nk; ++t) {
          const __m256 pv = _mm256_load_ps(pt[t]);
          for (int k = 0; k < 8; ++k) a[k] = _mm256_fmadd_ps(pv, _mm256_broadcast_ss(vf[t] + dc + k), a[k]);
        }
        for (int k = 0; k < 8; ++k) _mm256_store_ps(acc[g][dc + k], a[k]);
      }
    }
  }

  // Each row's (acc + zacc with kZero) / l, transposed back to rows, as bf16 into o0 (rows out_row apart).
  template <bool kZero>
  void finish(int64_t rows, at::BFloat16* o0, int64_t out_row) {
    for (int g = 0; g < G; ++g) {
      const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), l[g]);
      const __m256 z = kZero ? zacc[g] : _mm256_setzero_ps();
      for (int c = 0; c < D / 16; ++c) {
        __m256 e[8], o[8];
        for (int j = 0; j < 8; ++j) {
          e[j] = _mm256_mul_ps(_mm256_add_ps(_mm256_load_ps(acc[g][16 * c + j]), z), inv);
          o[j] = _mm256_mul_ps(_mm256_add_ps(_mm256_load_ps(acc[g][16 * c + 8 + j]), z), inv);
        }
        transpose8(e), transpose8(o);
        for (int64_t i = 0; i < rows; ++i) store_bf16x16(o0 + i * out_row + g * D + 16 * c, e[i], o[i]);
      }
    }
  }
};

// hide[t] for key j0 + t of a chunk: the lanes whose row position `pos` is outside [max(lo, j0 + t), hi).
inline void hidden_keys(__m256i pos, int64_t j0, int64_t lo, int64_t hi, __m256* hide) {
  const __m256i last = _mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(hi, INT32_MAX) - 1));
  const __m256i past_hi = _mm256_cmpgt_epi32(pos, last);
  for (int64_t t = 0; t < kChunkKeys; ++t) {
    const __m256i from = _mm256_set1_epi32(static_cast<int32_t>(std::max(lo, j0 + t)));
    hide[t] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(from, pos), past_hi));
  }
}

// Lane i: the position of the tile's row i (lanes past the last row repeat it: computed, never stored).
inline __m256i row_positions(int64_t first_pos, int64_t rows) {
  return _mm256_min_epi32(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first_pos)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                          _mm256_set1_epi32(static_cast<int32_t>(first_pos + rows - 1)));
}
}  // namespace avx2

// Causal prefill attention on AVX2 + FMA: prefill_avx512's inputs, outputs, causal positions and work
// items, in tiles of 8 query rows, for a bf16, int8 or fp8 e4m3 cache (R above), head_dim 64 or 128, G
// heads per kv head, blocks of a multiple of 16 tokens, by avx2::FlashTile: the chunk's K and V rows are
// widened to float once into L1 for the tile's G heads; a key's scores for the 8 rows are one chain of FMAs
// over the dims, each K element broadcast against the tile's queries; p.v broadcasts each V element against
// its key's 8 probabilities into the accumulators in L1. Everything stays fp32 (p is not rounded to bf16 as
// prefill_avx512 rounds it). A quantized cache as prefill_avx512: scores times the K scales (plus int8's
// m_t sum(q)), probabilities times the V scales, int8's sum_t p_t m_t kept beside the accumulators and
// added to every dim before the division by l.
template <int D, int G, typename R>
void prefill_avx2(const at::BFloat16* q, const typename R::T* k_cache, const typename R::T* v_cache,
                  const float* k_scale, const float* v_scale, const int64_t* tables, int64_t max_blocks,
                  const int64_t* q_start, const int64_t* q_len, const int64_t* ctx, int64_t P, at::BFloat16* out,
                  int64_t H, int64_t KVH, int64_t NB, int64_t BS, float scale, int64_t q_row, int64_t out_row) {
  using T = typename R::T;
  constexpr int64_t QT = avx2::kTileRows, KC = avx2::kChunkKeys;
  constexpr int64_t chunk_bytes = KC * D * static_cast<int64_t>(sizeof(T));
  constexpr float kLog2e = 1.44269504088896341f;
  std::vector<PrefillTile> items;
  std::vector<int64_t> costs;
  prefill_tiles(P, KVH, q_len, ctx, items, costs, QT);
  const __m256 scale2 = _mm256_set1_ps(scale * kLog2e);  // scores in log2 units: exp2 below
  for_each_costed(costs, [&](int64_t it) {
    const PrefillTile& item = items[it];
    const int64_t p = item.p, h = item.h, r0 = item.r0, rows = item.rows, first_pos = item.first_pos;
    const int64_t* blocks = tables + p * max_blocks;
    const auto [kh, vh, ksh, vsh] = head_planes<R>(k_cache, v_cache, k_scale, v_scale, h, NB * BS, D);
    avx2::FlashTile<D, G> tile;
    alignas(32) float kf[KC][D], vf[KC][D];  // the chunk's K and V rows as float, split
    float kmul[KC], kzero[KC], vmul[KC], vzero[KC];  // per key: K scale x softmax scale (log2 units), m x the same; V's
    __m256 hide[KC];
    tile.start(q + (q_start[p] + r0) * q_row + h * G * D, q_row, rows);
    const __m256i pos = avx2::row_positions(first_pos, rows);
    const int64_t num_keys = first_pos + rows;  // the last row attends this many keys
    for (int64_t j0 = 0; j0 < num_keys; j0 += KC) {
      const int64_t row0 = blocks[j0 / BS] * BS + j0 % BS;  // the chunk's first row (one block: BS % 16 == 0)
      const int64_t nk = std::min<int64_t>(KC, num_keys - j0);
      if (j0 + KC < num_keys) {
        const int64_t next = blocks[(j0 + KC) / BS] * BS + (j0 + KC) % BS;
        prefetch_rows(kh + next * D, chunk_bytes);
        prefetch_rows(vh + next * D, chunk_bytes);
        if constexpr (R::kQuantized) prefetch_rows(ksh + next, 64), prefetch_rows(vsh + next, 64);
      }
      for (int64_t t = 0; t < KC; ++t)  // keys past nk: zero rows (theirs may hold anything)
        for (int c = 0; c < D / 16; ++c) {
          __m256 ke = _mm256_setzero_ps(), ko = ke, ve = ke, vo = ke;
          if (t < nk) R::split16(kh + (row0 + t) * D + 16 * c, ke, ko), R::split16(vh + (row0 + t) * D + 16 * c, ve, vo);
          _mm256_store_ps(kf[t] + 16 * c, ke), _mm256_store_ps(kf[t] + 16 * c + 8, ko);
          _mm256_store_ps(vf[t] + 16 * c, ve), _mm256_store_ps(vf[t] + 16 * c + 8, vo);
        }
      if constexpr (R::kQuantized)
        for (int64_t t = 0; t < KC; ++t) {
          float ks = 0.f, km = 0.f, vs = 0.f, vm = 0.f;
          if (t < nk) R::params1(ksh + row0 + t, ks, km), R::params1(vsh + row0 + t, vs, vm);
          kmul[t] = ks * scale * kLog2e, kzero[t] = km * scale * kLog2e, vmul[t] = vs, vzero[t] = vm;
        }
      const bool causal = j0 + KC - 1 > first_pos;  // some key of this chunk lies past some row's position
      if (causal) avx2::hidden_keys(pos, j0, 0, INT64_MAX, hide);
      tile.template attend<R>(kf, vf, nk, scale2, kmul, kzero, vmul, vzero, causal ? hide : nullptr);
    }
    tile.template finish<R::kZero>(rows, out + (q_start[p] + r0) * out_row + h * G * D, out_row);
  });
}

// Causal prefill over an int4 (KIVI) cache on AVX2 + FMA: prefill_int4_avx512's reading (the blocks before
// each query's own as sealed, its own block unquantized; a chunk of an open block that some rows of the tile
// read as sealed and others as their own runs once per version, each lane hidden from the version it does not
// read; open blocks' sealed version made once per call into `sealed_k`, `sealed_v`) on prefill_avx2's tiles.
// Sealed rows are dequantized to float (n * s + z: keys per channel, values per token), not rounded to bf16.
template <int D, int G>
void prefill_int4_avx2(const at::BFloat16* q, const uint8_t* k_cache, const uint8_t* v_cache, const at::Half* k_scale,
                       const at::Half* k_zero, const at::Half* v_scale, const at::Half* v_zero,
                       const at::BFloat16* res_k, const at::BFloat16* res_v, const int32_t* res_slot,
                       const at::BFloat16* sealed_k, const at::BFloat16* sealed_v, const int32_t* sealed_index,
                       int64_t num_sealed, const int64_t* tables, int64_t max_blocks, const int64_t* q_start,
                       const int64_t* q_len, const int64_t* ctx, int64_t P, at::BFloat16* out, int64_t H, int64_t KVH,
                       int64_t NB, int64_t BS, int64_t R, float scale, int64_t q_row, int64_t out_row) {
  constexpr int64_t QT = avx2::kTileRows, KC = avx2::kChunkKeys, D2 = D / 2;
  std::vector<PrefillTile> items;
  std::vector<int64_t> costs;
  prefill_tiles(P, KVH, q_len, ctx, items, costs, QT);
  const __m256 scale2 = _mm256_set1_ps(scale * 1.44269504088896341f);
  for_each_costed(costs, [&](int64_t it) {
    const PrefillTile& item = items[it];
    const int64_t p = item.p, h = item.h, r0 = item.r0, rows = item.rows, first_pos = item.first_pos;
    const int64_t last_pos = first_pos + rows - 1;
    const int64_t* blocks = tables + p * max_blocks;
    avx2::FlashTile<D, G> tile;
    alignas(32) float kf[KC][D], vf[KC][D];
    __m256 hide[KC];
    tile.start(q + (q_start[p] + r0) * q_row + h * G * D, q_row, rows);
    const __m256i pos = avx2::row_positions(first_pos, rows);
    // One pass over the chunk in kf / vf for the rows whose position lies in [max(lo, key), hi).
    const auto attend = [&](int64_t j0, int64_t nk, int64_t lo, int64_t hi) {
      const bool all = lo <= first_pos && hi > last_pos && j0 + KC - 1 <= first_pos;
      if (!all) avx2::hidden_keys(pos, j0, lo, hi, hide);
      tile.template attend<avx2::Bf16Rows2>(kf, vf, nk, scale2, nullptr, nullptr, nullptr, nullptr, all ? nullptr : hide);
    };
    const auto load_bf16 = [&](const at::BFloat16* kr, const at::BFloat16* vr, int64_t nk) {
      for (int64_t t = 0; t < KC; ++t)
        for (int c = 0; c < D / 16; ++c) {
          __m256 ke = _mm256_setzero_ps(), ko = ke, ve = ke, vo = ke;
          if (t < nk) avx2::split_bf16x16(kr + t * D + 16 * c, ke, ko), avx2::split_bf16x16(vr + t * D + 16 * c, ve, vo);
          _mm256_store_ps(kf[t] + 16 * c, ke), _mm256_store_ps(kf[t] + 16 * c + 8, ko);
          _mm256_store_ps(vf[t] + 16 * c, ve), _mm256_store_ps(vf[t] + 16 * c + 8, vo);
        }
    };
    const auto sealed = [&](int64_t blk, int64_t off, int64_t nk) {  // dequantized into kf / vf
      const uint8_t* kp = k_cache + ((h * NB + blk) * BS + off) * D2;
      const uint8_t* vp = v_cache + ((h * NB + blk) * BS + off) * D2;
      const at::Half* ksb = k_scale + (h * NB + blk) * D;
      const at::Half* kzb = k_zero + (h * NB + blk) * D;
      const at::Half* vsb = v_scale + (h * NB + blk) * BS + off;
      const at::Half* vzb = v_zero + (h * NB + blk) * BS + off;
      for (int c = 0; c < D / 16; ++c) {
        __m256 se, so, ze, zo;
        avx2::half_split16(ksb + 16 * c, se, so);
        avx2::half_split16(kzb + 16 * c, ze, zo);
        for (int64_t t = 0; t < KC; ++t) {
          __m256 ke = _mm256_setzero_ps(), ko = ke, ve = ke, vo = ke;
          if (t < nk) {
            avx2::int4_split16(kp + t * D2 + 8 * c, ke, ko);
            ke = _mm256_fmadd_ps(ke, se, ze), ko = _mm256_fmadd_ps(ko, so, zo);
            const __m256 vs = _mm256_set1_ps(static_cast<float>(vsb[t])), vz = _mm256_set1_ps(static_cast<float>(vzb[t]));
            avx2::int4_split16(vp + t * D2 + 8 * c, ve, vo);
            ve = _mm256_fmadd_ps(ve, vs, vz), vo = _mm256_fmadd_ps(vo, vs, vz);
          }
          _mm256_store_ps(kf[t] + 16 * c, ke), _mm256_store_ps(kf[t] + 16 * c + 8, ko);
          _mm256_store_ps(vf[t] + 16 * c, ve), _mm256_store_ps(vf[t] + 16 * c + 8, vo);
        }
      }
    };
    int4_prefill_passes<D>(first_pos, last_pos, blocks, BS, h, res_slot, res_k, res_v, R, sealed_k, sealed_v,
                           sealed_index, num_sealed, sealed, load_bf16, attend);
    tile.template finish<false>(rows, out + (q_start[p] + r0) * out_row + h * G * D, out_row);
  });
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_HAVE_AVX512BF16 1

// The horizontal sums of 16 vectors, in order, as one vector: a transpose that adds as it goes
// (30 shuffles and 15 adds instead of 16 separate reductions).
template <bool kInt = false>
inline __m512 hsum16(const __m512* v) {
  const auto add = [](__m512 a, __m512 b) {  // int32 lanes (VNNI sums) travel as float bits
    return kInt ? _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b))) : _mm512_add_ps(a, b);
  };
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: partial sums of vectors 2i, 2i+1
    t[i] = add(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the lane's sums of vectors 4j .. 4j+3
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Add the four 128-bit lanes: lane k of the result holds vectors 4k .. 4k+3.
  const __m512 x0 = add(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x1 = add(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return add(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 2^x for finite x <= ~0 (x = -1e30 gives 0): x = n + f with n an integer and |f| <= 1/2, 2^f by its
// degree-6 Taylor polynomial (relative error < 2e-7), times 2^n in one instruction (vscalefps). Below
// 2^-100 it returns 0, not a denormal (see kSoftmaxFlush: the online softmax's sums and rescales would
// otherwise multiply denormals).
inline __m512 exp2_ps(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kSoftmaxFlushLog2), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// Softmax of one query head's L scores in place, as softmax_inplace but 16 lanes at a time: the max
// (two accumulators), 2^((s - max) log2 e) through exp2_ps (flushed below 2^-100 as the scalar loop
// flushes below e^-69), the sum, and the scale by its inverse. GCC left softmax_inplace's max a scalar
// chain (one vmaxss per score, 4 cycles each: ~16% of a cache-resident decode call).
inline void softmax_avx512(float* s, int64_t L) {
  const int64_t full = L & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (L - full)) - 1u);
  __m512 m0 = _mm512_set1_ps(-FLT_MAX), m1 = m0;
  int64_t t = 0;
  for (; t + 32 <= full; t += 32)
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + t)), m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + t + 16));
  if (t < full) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + t));
  if (tail) m1 = _mm512_mask_max_ps(m1, tail, m1, _mm512_maskz_loadu_ps(tail, s + full));
  const float m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f), shift = _mm512_set1_ps(m * 1.4426950408889634f);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t < full; t += 16) {
    const __m512 e = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), log2e, shift));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp2_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, s + full), log2e, shift)));
    _mm512_mask_storeu_ps(s + full, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (t = 0; t < full; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
  if (tail) _mm512_mask_storeu_ps(s + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + full), inv));
}

// Stores 16 floats as bf16, rounding to nearest even as torch does.
inline void store_bf16x16(at::BFloat16* o, __m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

inline __m512 bf16x16_to_float(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// How the fast kernels read each cache dtype's rows: `bf16x32` gives 32 values as bf16 (the q.k dot
// products, and prefill's p.v, are bf16 pairs), `f32x32` the same 32 as two float vectors (decode's p.v).
// int8 and fp8 e4m3 values are exact in bf16 (8 and 4 significant bits against bf16's 8), so a quantized
// row costs a conversion and no rounding; its parameters are applied by the kernel, once per row:
// params16 gives 16 rows' scales s and offsets m (a stored value reads as stored * s + m; m = 0 but for
// int8, kZero) from their slots, lanes off `live` zero.
struct Bf16Rows {
  using T = at::BFloat16;
  static constexpr bool kQuantized = false;
  static constexpr bool kZero = false;
  static constexpr bool kIntDot = false;  // see Int8Rows
  static __m512i bf16x32(const T* p) { return _mm512_loadu_si512(p); }
  static void f32x32(const T* p, __m512& lo, __m512& hi) { lo = bf16x16_to_float(p), hi = bf16x16_to_float(p + 16); }
};

// int8 K in decode goes another way where the CPU has AVX512-VNNI (every AVX512-BF16 CPU so far): the
// query heads are rounded to int16 (15 bits of their largest value: finer than bf16's 8 significant
// bits), K's stored bytes c (q - 128, signed) widen to int16 in one instruction per 32 values, and
// vpdpwssd sums the exact products, 32 per instruction, as vdpbf16ps does for bf16: one widening per 32
// values where converting to bf16 takes three conversions (on cache-resident blocks of a busy host it ran
// clearly faster; to be measured). The zero's share of q.k, m_t sum(q), is added in float: sum(q) of the
// bf16 query, once per head and step. (Signed bytes keep the widening and the bf16 conversions as they
// were for the symmetric format; vpdpbusd's u8 x s8 would need the query in 8 bits.)
#if defined(__AVX512VNNI__)
constexpr bool kHaveVnni = true;
#else
constexpr bool kHaveVnni = false;
#endif

// acc + a.lo * b.lo + a.hi * b.hi per int32 lane (vpdpwssd; called only where kHaveVnni). As an asm
// statement under GCC: GCC 12 compiles the intrinsic with a register copy of the accumulator in and out
// of every instruction (two extra moves per pair of vpdpwssd in int4's p.v; linear_int8.cpp measured the
// same pattern at 0.46-0.65x its loop's speed). int4's p.v (int4_pv_run_vnni) uses it: 1.02-1.07x its
// decode on host G, outputs bit for bit. int8's loops keep the intrinsic: with this they measured 0.6x at
// 64 x 2k and 16 x 8k (equal at 16 x 2k), for a reason not found yet.
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
#if defined(__GNUC__)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#else
  return _mm512_dpwssd_epi32(acc, a, b);
#endif
}

struct Int8Rows {
  using T = int8_t;
  static constexpr bool kQuantized = true;
  static constexpr bool kZero = true;
  static constexpr bool kIntDot = kHaveVnni;
  // The float16 pair (scale, zero) of each slot: scale in the low half, zero in the high (little-endian).
  static void params16(const float* slot, __mmask16 live, __m512& s, __m512& m) {
    const __m512i w = _mm512_maskz_loadu_epi32(live, slot);
    s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
    m = _mm512_fmadd_ps(s, _mm512_set1_ps(128.f), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16))));
  }
  static void params1(const float* slot, float& s, float& m) {
    float z;
    int8_params(slot, s, z);
    m = z + 128.f * s;
  }
  static __m512 f32x16(const T* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static __m512i bf16x32(const T* p) { return (__m512i)_mm512_cvtne2ps_pbh(f32x16(p + 16), f32x16(p)); }
  static void f32x32(const T* p, __m512& lo, __m512& hi) { lo = f32x16(p), hi = f32x16(p + 16); }
};

// bf16 bit patterns of the e4m3 subnormals m * 2^-9 (m = 0..7), indexed by the fp8 code's low bits.
alignas(64) constexpr uint16_t kFp8SubnormalBf16[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};

struct Fp8Rows {
  using T = uint8_t;  // at::Float8_e4m3fn's bits
  static constexpr bool kQuantized = true;
  static constexpr bool kZero = false;
  static constexpr bool kIntDot = false;
  static void params16(const float* slot, __mmask16 live, __m512& s, __m512& m) {
    s = _mm512_maskz_loadu_ps(live, slot), m = _mm512_setzero_ps();
  }
  static void params1(const float* slot, float& s, float& m) { s = *slot, m = 0.f; }
  // Normal codes: bf16 takes e4m3's exponent rebiased (+120: bias 7 -> 127) and its 3 mantissa bits as
  // the top of its 7; the subnormals (exponent field 0) come from an 8-entry table in one permute (bf16
  // subnormals would be flushed to zero by the BF16 dot products).
  static __m512i bf16x32(const T* p) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i mag = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x7F)), 4),
                                         _mm512_set1_epi16(120 << 7));
    const __mmask32 sub = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));
    const __m512i fixed = _mm512_mask_permutexvar_epi16(mag, sub, w, _mm512_load_si512(kFp8SubnormalBf16));
    return _mm512_or_si512(fixed, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
  }
  static void f32x32(const T* p, __m512& lo, __m512& hi) {
    const __m512i w = bf16x32(p);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
  }
};


// The VNNI path's queries (Int8Rows): each of the G heads rounded to int16 steps of max|q| / 32767;
// unit[g] is the value of one step.
template <int D, int G>
inline void queries_to_int16(const at::BFloat16* q, int16_t* q16, float* unit) {
  for (int g = 0; g < G; ++g) {
    __m512 amax = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(bf16x16_to_float(q + g * D + d)));
    const float m = _mm512_reduce_max_ps(amax);
    unit[g] = m / 32767.f;
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    for (int d = 0; d < D; d += 16)
      _mm256_store_si256(reinterpret_cast<__m256i*>(q16 + g * D + d),
                         _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_float(q + g * D + d), inv))));
  }
}

// The scores of 16 int8 K rows for the G int16 query heads: the integer dot products times row_scale
// (softmax scale x K scales) and each head's step, plus row_zero (softmax scale x the rows' m) times each
// head's q_sum. K widened to int16 once into `kw` (L1), then exact integer dot products.
template <int D, int G>
inline void int8_scores16(const int8_t* k, const int16_t* q16, const float* unit, const float* q_sum, __m512 row_scale,
                          __m512 row_zero, int16_t* kw, float* scores, int64_t stride) {
  constexpr int NC = D / 32;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < NC; ++c)
      _mm512_store_si512(kw + r * D + 32 * c,
                         _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + r * D + 32 * c))));
  for (int g = 0; g < G; ++g) {
    __m512i qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm512_load_si512(q16 + g * D + 32 * c);
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) {
      __m512i a = _mm512_setzero_si512();
      for (int c = 0; c < NC; ++c) a = _mm512_dpwssd_epi32(a, qv[c], _mm512_load_si512(kw + r * D + 32 * c));
      acc[r] = _mm512_castsi512_ps(a);
    }
    const __m512 dots = _mm512_cvtepi32_ps(_mm512_castps_si512(hsum16<true>(acc)));
    _mm512_storeu_ps(scores + g * stride, _mm512_fmadd_ps(dots, _mm512_mul_ps(row_scale, _mm512_set1_ps(unit[g])),
                                                          _mm512_mul_ps(row_zero, _mm512_set1_ps(q_sum[g]))));
  }
}

struct NoTick { void operator()(int, int64_t) const {} };

// The inner step of the integer p.v loops (int8's int_pv_block_vnni, int4's int4_pv_run_vnni): for each of
// the G heads, its weights of rows 2i and 2i + 1 (w16[g][2i], w16[g][2i + 1]) broadcast as one int32, and
// a[g] += that pair . x, b[g] += that pair . y by dot (vpdpwssd: the intrinsic, or the asm `dpwssd`).
template <int G, typename Dot>
__attribute__((always_inline)) inline void weight_pair_step(__m512i* a, __m512i* b,
                                                            const int16_t (*w16)[avx2::kPvRows + 16], int64_t i,
                                                            __m512i x, __m512i y, const Dot& dot) {
  for (int g = 0; g < G; ++g) {
    int32_t pair;
    std::memcpy(&pair, w16[g] + 2 * i, sizeof(pair));
    const __m512i w = _mm512_set1_epi32(pair);
    a[g] = dot(a[g], w, x);
    b[g] = dot(b[g], w, y);
  }
}

// int8 V's p.v in integers where the CPU has AVX512-VNNI (Int8Rows::kIntDot), as avx2::int_pv_block: per
// run of at most avx2::kPvRows rows, each head's weights in int16 power-of-two steps (avx2::int16_weights), two
// rows' bytes interleaved and widened to int16, and vpdpwssd adds each pair of products against the two
// weights (one int32 broadcast) to int32 sums per dim: 32 multiply-adds per instruction where the float
// path converts every value and does 16. The G heads' 2G sums of a 32-dim slice stay in registers (G <= 8);
// they join the float accumulators accm [G][D] (dims in order) once per run.
template <int D, int G, typename Tick = NoTick>
inline void int_pv_block_vnni(float (*accm)[D], const float* p, int64_t stride, int64_t n, const int8_t* v,
                              const Tick& tick = Tick()) {
  alignas(64) int16_t w16[G][avx2::kPvRows + 16];
  float unit[G];
  for (int64_t t0 = 0; t0 < n; t0 += avx2::kPvRows) {
    const int64_t m = std::min(avx2::kPvRows, n - t0);
    avx2::int16_weights<G>(p + t0, stride, m, w16, unit);
    const int8_t* vb = v + t0 * D;
    for (int c = 0; c < D / 32; ++c) {
      __m512i lo[G], hi[G];  // int32 sums of the slice's dims 0-7 and 16-23 (lo), 8-15 and 24-31 (hi)
      for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_si512();
      const auto rows = [&](const int8_t* r0, const int8_t* r1, int64_t i) __attribute__((always_inline)) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1));
        const __m512i x = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b));  // per 128-bit lane: 8 dims' pairs
        const __m512i y = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
        weight_pair_step<G>(lo, hi, w16, i, x, y,
                            [](__m512i acc, __m512i w, __m512i v) { return _mm512_dpwssd_epi32(acc, w, v); });
      };
      // Whole pairs 8 at a time, the pacing call between runs (inside the loop it cost the loop its
      // registers), then an odd last row paired with itself (weight 0: w16[g][m]).
      const int64_t full = m / 2;
      for (int64_t i0 = 0; i0 < full; i0 += 8) {
        const int64_t i1 = std::min(full, i0 + 8);
        for (int64_t i = i0; i < i1; ++i) rows(vb + 2 * i * D + 32 * c, vb + (2 * i + 1) * D + 32 * c, i);
        tick(c, t0 + 2 * i1);
      }
      if (m & 1) {
        const int8_t* r = vb + (m - 1) * D + 32 * c;
        rows(r, r, full);
        tick(c, t0 + m);
      }
      for (int g = 0; g < G; ++g) {
        const __m512 u = _mm512_set1_ps(unit[g]);
        float* acc = accm[g] + 32 * c;
        const __m512i d0 = _mm512_shuffle_i64x2(lo[g], hi[g], 0x44);  // dims 0-15
        const __m512i d1 = _mm512_shuffle_i64x2(lo[g], hi[g], 0xEE);  // dims 16-31
        _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), u, _mm512_load_ps(acc)));
        _mm512_store_ps(acc + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), u, _mm512_load_ps(acc + 16)));
      }
    }
  }
}

// int4 V's p.v in integers (AVX512-VNNI), as int_pv_block_vnni: over a run of m rows in whole blocks of BS
// rows (block(k) gives the k-th block's packed rows; its rows past m unused), each head's weights already in
// int16 steps (w16, unit: avx2::int16_weights of p_t s_t), two rows' packed bytes interleaved and widened
// to int16: the low nibbles are the 32-dim slice's 16 even dims, the high ones its 16 odd dims (the
// values' order accm [G][D] keeps), and vpdpwssd adds each pair of products against the two weights to
// int32 sums, 32 multiply-adds per instruction where the float path converts every value and does 16.
// The 2G sums of a slice stay in registers over the whole run (|w| <= 32767 times n <= 15 over at most
// 256 rows: below 2^31) and join accm once per run. block(k) is called in the first slice's pass, just
// before block k is read (the caller prefetches and paces there).
template <int D, int G, typename Block>
inline void int4_pv_run_vnni(float (*accm)[D], const int16_t (*w16)[avx2::kPvRows + 16], const float* unit, int64_t m,
                             int64_t BS, const Block& block) {
  constexpr int D2 = D / 2;
  const uint8_t* rows_at[avx2::kPvRows / 16];
  const __m512i low = _mm512_set1_epi16(15);
  for (int c = 0; c < D / 32; ++c) {
    __m512i ev[G], od[G];
    for (int g = 0; g < G; ++g) ev[g] = od[g] = _mm512_setzero_si512();
    const auto rows = [&](const uint8_t* r0, const uint8_t* r1, int64_t i) __attribute__((always_inline)) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1));
      const __m512i x = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
      const __m512i e = _mm512_and_si512(x, low), o = _mm512_srli_epi16(x, 4);  // dword j: (row 0, row 1) of dim 2j / 2j + 1
      weight_pair_step<G>(ev, od, w16, i, e, o, dpwssd);
    };
    for (int64_t t0 = 0, k = 0; t0 < m; t0 += BS, ++k) {
      if (c == 0) rows_at[k] = block(k);
      const uint8_t* vb = rows_at[k] + 16 * c;
      const int64_t n = std::min(BS, m - t0), full = n / 2;
      for (int64_t i = 0; i < full; ++i) rows(vb + 2 * i * D2, vb + (2 * i + 1) * D2, t0 / 2 + i);
      if (n & 1) rows(vb + (n - 1) * D2, vb + (n - 1) * D2, t0 / 2 + full);  // paired with itself, weight w16[g][m] = 0
    }
    for (int g = 0; g < G; ++g) {
      const __m512 u = _mm512_set1_ps(unit[g]);
      float* acc = accm[g] + 32 * c;
      _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ev[g]), u, _mm512_load_ps(acc)));
      _mm512_store_ps(acc + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(od[g]), u, _mm512_load_ps(acc + 16)));
    }
  }
}

// q.k for 16 bf16 K rows (k: the first, rows D apart) and the G query heads q (bf16, heads D apart), 32
// dim pairs per vdpbf16ps and the 16 rows' sums reduced together: done(g, dots) takes head g's 16 scores.
// Shared by every decode kernel's K pass (bf16 blocks, quantized rows converted to bf16 in L1, int4 open
// and sealed blocks).
template <int D, int G, typename Done>
__attribute__((always_inline)) inline void bf16_scores16(const void* q, const void* k, const Done& done) {
  const uint16_t* qb = static_cast<const uint16_t*>(q);
  const uint16_t* kb = static_cast<const uint16_t*>(k);
  for (int g = 0; g < G; ++g) {
    __m512bh qv[D / 32];
    for (int c = 0; c < D / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qb + g * D + 32 * c);
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) {
      acc[r] = _mm512_setzero_ps();
      for (int c = 0; c < D / 32; ++c)
        acc[r] = _mm512_dpbf16_ps(acc[r], qv[c], (__m512bh)_mm512_loadu_si512(kb + r * D + 32 * c));
    }
    done(g, hsum16(acc));
  }
}

// p.v over one block's n rows for the G heads of an item, one 32-dim slice of V at a time (one cache
// line of a bf16 row), the slice's accumulators (2G vectors: 16 at G = 8) in registers and kept in
// accm [G][D] in L1 between blocks: all G heads' accumulators for a whole row (G x D / 16 vectors, 48 for
// the 1.5B's 6 x 128) would not fit in the 32 vector registers. row(t, c, v0, v1) gives row t's 32
// values of slice c as two float vectors (in whatever order accm keeps), p + g * stride + t head g's
// weight of row t. Shared by every decode kernel's V pass (decode_avx512, decode_int4_avx512).
template <int D, int G, typename Row, typename Tick = NoTick>
__attribute__((always_inline)) inline void pv_block(float (*accm)[D], const float* p, int64_t stride, int64_t n,
                                                    const Row& row, const Tick& tick = Tick()) {
  for (int c = 0; c < D / 32; ++c) {
    __m512 acc[G][2];
    for (int g = 0; g < G; ++g)
      acc[g][0] = _mm512_load_ps(accm[g] + 32 * c), acc[g][1] = _mm512_load_ps(accm[g] + 32 * c + 16);
    for (int64_t t = 0; t < n; ++t) {
      __m512 v0, v1;
      row(t, c, v0, v1);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * stride + t]);
        acc[g][0] = _mm512_fmadd_ps(w, v0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(w, v1, acc[g][1]);
      }
      if ((t & 15) == 15 || t + 1 == n) tick(c, t + 1);
    }
    for (int g = 0; g < G; ++g)
      _mm512_store_ps(accm[g] + 32 * c, acc[g][0]), _mm512_store_ps(accm[g] + 32 * c + 16, acc[g][1]);
  }
}

#ifdef PDSERVE_HAVE_AMX
using pdserve_amx::TileConfig;
inline bool amx_ready() { return pdserve_amx::ready(); }

// q.k of one decode item on the AMX tile unit (decode_avx512 with kAmx, bf16 cache): 16 K rows straight
// from the cache are the A tile (one per 32 dims), the item's G query heads in dim pairs x heads the B
// tiles (loaded once per item: tiles 1 .. D/32, heads past G zero), so C = K Q^T holds one key per row and
// one head per lane. Stored to L1 and transposed in registers (only the G columns the heads use are
// formed), each head's 16 scores come out as bf16_scores16's do, without its 16-row horizontal sums:
// those, G per 16 keys, were half of a cache-resident call at G = 7 (Qwen2.5-0.5B). Products bf16 x bf16
// summed in fp32 by the tile unit (its order; bf16 denormal inputs read as zero), as prefill_amx.
template <int D, int G>
struct AmxScores {
  static_assert(D == 64 || D == 128, "the B tiles 1 .. D/32 and A tiles 5, 6 assume D <= 128");
  static_assert(G >= 1 && G <= 16, "one C lane per query head");
  alignas(64) int32_t qt[D / 32][16][16];  // B tiles: [32-dim slice][dim pair][head]
  alignas(64) float c[16][16];             // the C tile: [key][head]

  void start(const at::BFloat16* qh) {  // qh: the G heads, D apart
    std::memset(qt, 0, sizeof(qt));
    const int32_t* pairs = reinterpret_cast<const int32_t*>(qh);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < D / 2; ++i) qt[i / 16][i % 16][g] = pairs[g * (D / 2) + i];
    _tile_loadd(1, qt[0], 64);
    _tile_loadd(2, qt[1], 64);
    if constexpr (D == 128) {
      _tile_loadd(3, qt[2], 64);
      _tile_loadd(4, qt[3], 64);
    }
  }

  // The scores of the 16 bf16 rows at k (D apart) with the G heads: done(g, dots) takes head g's 16.
  template <typename Done>
  __attribute__((always_inline)) void scores16(const at::BFloat16* k, const Done& done) {
    _tile_zero(0);
    _tile_loadd(5, k, D * 2);
    _tile_dpbf16ps(0, 5, 1);
    _tile_loadd(6, k + 32, D * 2);
    _tile_dpbf16ps(0, 6, 2);
    if constexpr (D == 128) {
      _tile_loadd(5, k + 64, D * 2);
      _tile_dpbf16ps(0, 5, 3);
      _tile_loadd(6, k + 96, D * 2);
      _tile_dpbf16ps(0, 6, 4);
    }
    _tile_stored(0, c, 64);
    // The 16 x 16 transpose's first two steps: u[4j + i]'s 128-bit lane L holds keys 4j .. 4j+3 of head
    // 4L + i; a head's vector is then lane L of u[i], u[4 + i], u[8 + i], u[12 + i] (three shuffles).
    __m512 t[16], u[16];
    for (int r = 0; r < 16; r += 2) {
      const __m512 a = _mm512_load_ps(c[r]), b = _mm512_load_ps(c[r + 1]);
      t[r] = _mm512_unpacklo_ps(a, b), t[r + 1] = _mm512_unpackhi_ps(a, b);
    }
    for (int j = 0; j < 16; j += 4) {
      const auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
      u[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[j]), pd(t[j + 2])));
      u[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[j]), pd(t[j + 2])));
      u[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[j + 1]), pd(t[j + 3])));
      u[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[j + 1]), pd(t[j + 3])));
    }
    for (int g = 0; g < G; ++g) {
      const int i = g % 4;
      __m512 x, y;
      switch (g / 4) {  // the lane as an immediate
        case 0: x = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x00), y = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x00); break;
        case 1: x = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x55), y = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x55); break;
        case 2: x = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xAA), y = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xAA); break;
        default: x = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xFF), y = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xFF); break;
      }
      done(g, _mm512_shuffle_f32x4(x, y, 0x88));  // lanes 0, 2 of x, then of y
    }
  }
};

// p.v of one decode item on the AMX tile unit (decode_avx512 with kAmx): O = P V, 32 keys a step. The
// probabilities of the G heads (rounded to bf16, as prefill_amx's are; keys past the context zero) are the
// A tile, one head per row; V's rows, two keys interleaved per dim (vpunpck{l,h}wd of the two rows, which
// the tile unit wants as key pairs: dims come out in the order of the unpacks' 128-bit lanes), are four B
// tiles of 16 dims; four C tiles of G x 16 hold 64 dims of the output. A head_dim of 128 takes its two
// halves in turn over windows of kPvWindow keys (the window's V read from DRAM once, again from L2),
// the C tiles parked in L1 between windows (head_dim 64: one window). Where pv_block spends 2G FMAs and
// a conversion per row and 32 dims (the V pass was most of the kernel's arithmetic at G = 7), this
// spends two unpacks. Rows past the context (whatever the cache holds there, NaN in the tests) are never
// loaded. tick(done, total) paces the caller's prefetch streams. Writes accm[g][d] in dim order.
constexpr int64_t kPvWindow = 512;
template <int D, int G, typename Tick>
__attribute__((always_inline)) inline void amx_pv(float (*accm)[D], const float* p, int64_t stride, int64_t L,
                                                  const at::BFloat16* vh, const int64_t* blocks, int64_t BS,
                                                  const Tick& tick) {
  alignas(64) uint16_t a[16][32];    // the A tile: head g's 32 probabilities (bf16) in row g, rows >= G zero
  alignas(64) int32_t b[4][16][16];  // the B tiles: [16 dims][key pair][dim]
  alignas(64) float c[D / 16][16][16];  // the C tiles between windows: [16 dims][head][dim]
  std::memset(a, 0, sizeof(a));
  const __m512i zero = _mm512_setzero_si512();
  const int64_t window = D == 64 ? L : kPvWindow;  // one half: no windows
  for (int64_t w0 = 0; w0 < L; w0 += window) {
    const int64_t w1 = std::min(L, w0 + window);
    for (int half = 0; half < D / 64; ++half) {
      if (w0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, c[4 * half], 64);
        _tile_loadd(1, c[4 * half + 1], 64);
        _tile_loadd(2, c[4 * half + 2], 64);
        _tile_loadd(3, c[4 * half + 3], 64);
      }
      for (int64_t t0 = w0; t0 < w1; t0 += 32) {
        const int64_t nk = std::min<int64_t>(32, L - t0);
        const __mmask16 m0 = nk >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << nk) - 1u);
        const __mmask16 m1 = nk >= 32 ? static_cast<__mmask16>(0xFFFF)
                                      : static_cast<__mmask16>(nk <= 16 ? 0u : (1u << (nk - 16)) - 1u);
        for (int g = 0; g < G; ++g) {
          const float* pg = p + g * stride + t0;
          const __m512bh two = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, pg + 16), _mm512_maskz_loadu_ps(m0, pg));
          _mm512_store_si512(a[g], (__m512i)two);
        }
        // Keys t0 .. t0 + 15 and t0 + 16 .. t0 + 31 each lie in one block (BS a multiple of 16).
        const auto first_row = [&](int64_t key) { return vh + (blocks[key / BS] * BS + key % BS) * D + 64 * half; };
        const at::BFloat16* base[2] = {first_row(t0), first_row(nk > 16 ? t0 + 16 : t0)};
        for (int r = 0; r < 16; ++r) {
          const int i = 2 * r;
          const at::BFloat16* row = base[i >> 4] + (i & 15) * D;
          for (int s = 0; s < 2; ++s) {  // 32 dims: unpacks into B tiles 2s (dims 8L + 0..3) and 2s + 1 (8L + 4..7)
            const __m512i x = i < nk ? _mm512_loadu_si512(row + 32 * s) : zero;
            const __m512i y = i + 1 < nk ? _mm512_loadu_si512(row + D + 32 * s) : zero;
            _mm512_store_si512(b[2 * s][r], _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(b[2 * s + 1][r], _mm512_unpackhi_epi16(x, y));
          }
        }
        _tile_loadd(4, a, 64);
        _tile_loadd(5, b[0], 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b[1], 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, b[2], 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, b[3], 64);
        _tile_dpbf16ps(3, 4, 6);
        tick(w0 * (D / 64) + half * (w1 - w0) + t0 + nk - w0, (D / 64) * L);
      }
      _tile_stored(0, c[4 * half], 64);
      _tile_stored(1, c[4 * half + 1], 64);
      _tile_stored(2, c[4 * half + 2], 64);
      _tile_stored(3, c[4 * half + 3], 64);
    }
  }
  // C tile 4h + 2s + u, lane l = 4L + j, is dim 64h + 32s + 8L + 4u + j.
  const __m512i lo_dims = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_dims = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < D / 32; ++s) {
      const __m512 x0 = _mm512_load_ps(c[2 * s][g]), x1 = _mm512_load_ps(c[2 * s + 1][g]);
      _mm512_store_ps(accm[g] + 32 * s, _mm512_permutex2var_ps(x0, lo_dims, x1));
      _mm512_store_ps(accm[g] + 32 * s + 16, _mm512_permutex2var_ps(x0, hi_dims, x1));
    }
}
#endif  // AMX

// bf16 K/V, head_dim D (64 or 128), G query heads per kv head: AVX-512 BF16 dot products for q.k (32
// pairs per instruction, no conversion of K), 16 tokens' scores reduced together; softmax_avx512; p.v:
// pv_block, one 32-dim slice of V at a time. Memory: while one side (an item's K, then its V) is
// computed on, the next (its V, then the thread's next item's K) is prefetched into L2 at the pace of
// the compute (DecodeStreams; long sides a fixed lead ahead). On host E (2 cores, DRAM ~17 GB/s) that
// read 11-12 GB/s at 16-64 sequences where a pure-load pass before each side's compute read 9-10
// (benchmarks/attention_kernels.py, 128-token blocks scattered at random, session 18).
// A quantized cache (R = Int8Rows, Fp8Rows) takes the same path: 16 K rows are converted to bf16 once
// into an L1 buffer that the G heads then read as they read a bf16 block (int8 with VNNI: widened to
// int16 for integer dot products instead, see Int8Rows), the 16 scores are multiplied by their rows' K
// scales with the softmax scale, and before p.v the probabilities by their rows' V scales (int8 with
// VNNI: then p.v in integers, int_pv_block_vnni, paced as the float path). int8's
// offsets m: q.k_t = s_t (q . c_t) + m_t sum(q), each head's sum(q) once per step; p.v = sum_t (p_t s_t)
// c_t + sum_t p_t m_t, the second one scalar per head added to every dim at the end (the int4 kernel's
// values take the same fold).
// kAmx (a bf16 cache, where the CPU has AMX BF16): q.k (AmxScores) and p.v (amx_pv) on the tile unit, the
// softmax and the streams as above.
template <int D, int G, typename R, bool kAmx = false>
void decode_avx512(const at::BFloat16* q, const typename R::T* k_cache, const typename R::T* v_cache,
                   const float* k_scale, const float* v_scale, const int64_t* table, const int64_t* ctx,
                   at::BFloat16* out, int64_t B, int64_t H, int64_t KVH, int64_t NB, int64_t BS, int64_t max_blocks,
                   float scale) {
  using T = typename R::T;
  constexpr int NC = D / 32;  // 32-dim slices of a row: bf16 vectors of q and k, cache lines of bf16 v
  const __m512 vscale = _mm512_set1_ps(scale);
  for_each_item_ranged(ctx, B, KVH, [&](int64_t idx, bool first, bool last) {
    thread_local std::vector<float> scores;
    const int64_t b = idx / KVH, h = idx % KVH, L = ctx[b];
    const int64_t* blocks = table + b * max_blocks;
    const int64_t nblocks = (L + BS - 1) / BS;
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
    const at::BFloat16* qh = q + (b * H + h * G) * D;  // the group's G query heads, contiguous
    const int64_t stride = nblocks * BS + 16;  // room to store whole 16-token groups past L
    scores.resize(G * stride);
    const auto [kh, vh, ksh, vsh] = head_planes<R>(k_cache, v_cache, k_scale, v_scale, h, NB * BS, D);
    DecodeStreams<R::kQuantized> st(kWholeSideLines);
    st.start(kh, ksh, vh, vsh, blocks, L, BS, row_bytes);
    if (!last) {
      const int64_t b1 = (idx + 1) / KVH, h1 = (idx + 1) % KVH;
      st.start_next(k_cache + h1 * NB * BS * D, R::kQuantized ? k_scale + h1 * NB * BS : nullptr,
                    table + b1 * max_blocks, ctx[b1], BS, row_bytes);
    }
    if (first) st.touch_k_head(kh, blocks, L, BS, row_bytes);
    const auto v_pass = [&](int64_t done, int64_t total) { st.v_pass(done, total); };
#ifdef PDSERVE_HAVE_AMX
    static_assert(!kAmx || !R::kQuantized, "the AMX decode reads bf16 rows");
    [[maybe_unused]] AmxScores<D, G> amx;  // on the stack (trivial; unused without kAmx)
    if constexpr (kAmx) {
      if (first) {
        static const TileConfig config;  // a const local here made ldtilecfg fault (#GP), as if never stored
        _tile_loadconfig(&config);
      }
      amx.start(qh);
    }
#else
    static_assert(!kAmx, "an AMX decode in a build without AMX");
#endif
    alignas(64) uint16_t kconv[R::kQuantized ? 16 * D : 1];  // 16 quantized K rows as bf16 (int16 for VNNI)
    alignas(64) int16_t q16[R::kIntDot ? G * D : 1];
    float q_unit[G];
    if constexpr (R::kIntDot) queries_to_int16<D, G>(qh, q16, q_unit);
    float q_sum[G] = {};  // int8: each head's sum of its dims (the share of the rows' offsets m in q.k)
    if constexpr (R::kZero)
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16) a = _mm512_add_ps(a, bf16x16_to_float(qh + g * D + d));
        q_sum[g] = _mm512_reduce_add_ps(a);
      }
    for (int64_t j = 0; j < nblocks; ++j) {
      const T* kb = kh + blocks[j] * BS * D;
      const float* ksb = R::kQuantized ? ksh + blocks[j] * BS : nullptr;
      const int64_t t0 = j * BS, n = std::min(BS, L - t0);
      int64_t t = 0;
      for (; t + 16 <= BS && t < n; t += 16) {  // 16 rows at a time (rows past n are read, never used)
        st.k_pass(t0 + t + 16, L);
        __m512 row_scale = vscale, row_zero = _mm512_setzero_ps();  // softmax scale x the rows' s, m
        if constexpr (R::kQuantized) {
          __m512 s, m;
          R::params16(ksb + t, static_cast<__mmask16>(0xFFFF), s, m);
          row_scale = _mm512_mul_ps(vscale, s), row_zero = _mm512_mul_ps(vscale, m);
        }
        if constexpr (R::kIntDot) {
          int8_scores16<D, G>(kb + t * D, q16, q_unit, q_sum, row_scale, row_zero, reinterpret_cast<int16_t*>(kconv),
                              scores.data() + t0 + t, stride);
          continue;
        }
#ifdef PDSERVE_HAVE_AMX
        if constexpr (kAmx) {
          amx.scores16(kb + t * D, [&](int g, __m512 dots) {
            _mm512_storeu_ps(scores.data() + g * stride + t0 + t, _mm512_mul_ps(dots, row_scale));
          });
          continue;
        }
#endif
        const at::BFloat16* k;
        if constexpr (R::kQuantized) {
          for (int r = 0; r < 16; ++r)
            for (int c = 0; c < NC; ++c) _mm512_store_si512(kconv + r * D + 32 * c, R::bf16x32(kb + (t + r) * D + 32 * c));
          k = reinterpret_cast<const at::BFloat16*>(kconv);
        } else {
          k = kb + t * D;
        }
        bf16_scores16<D, G>(qh, k, [&](int g, __m512 dots) {
          __m512 sc = _mm512_mul_ps(dots, row_scale);
          if constexpr (R::kZero) sc = _mm512_fmadd_ps(row_zero, _mm512_set1_ps(q_sum[g]), sc);
          _mm512_storeu_ps(scores.data() + g * stride + t0 + t, sc);
        });
      }
      for (; t < n; ++t) {  // blocks smaller than 16 tokens
        float row_scale = scale, row_zero = 0.f;
        if constexpr (R::kQuantized) {
          float s, m;
          R::params1(ksb + t, s, m);
          row_scale = scale * s, row_zero = scale * m;
        }
        if constexpr (R::kIntDot) {
          for (int g = 0; g < G; ++g) {
            __m512i acc = _mm512_setzero_si512();
            for (int c = 0; c < NC; ++c)
              acc = _mm512_dpwssd_epi32(acc, _mm512_load_si512(q16 + g * D + 32 * c),
                                        _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + t * D + 32 * c))));
            scores[g * stride + t0 + t] =
                static_cast<float>(_mm512_reduce_add_epi32(acc)) * q_unit[g] * row_scale + row_zero * q_sum[g];
          }
          continue;
        }
        for (int g = 0; g < G; ++g) {
          __m512 acc = _mm512_setzero_ps();
          for (int c = 0; c < NC; ++c)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + g * D + 32 * c),
                                   (__m512bh)R::bf16x32(kb + t * D + 32 * c));
          float sc = _mm512_reduce_add_ps(acc) * row_scale;
          if constexpr (R::kZero) sc += row_zero * q_sum[g];
          scores[g * stride + t0 + t] = sc;
        }
      }
    }
    for (int g = 0; g < G; ++g) softmax_avx512(scores.data() + g * stride, L);
    float z_sum[G] = {};  // int8: sum_t p_t m_t per head, added to every output dim
    if constexpr (R::kQuantized) {  // p * v_scale over the whole context: V rows then enter p.v unscaled
      __m512 zacc[G];
      for (int g = 0; g < G; ++g) zacc[g] = _mm512_setzero_ps();
      for (int64_t j = 0; j < nblocks; ++j) {
        const float* vsb = vsh + blocks[j] * BS;
        const int64_t t0 = j * BS, n = std::min(BS, L - t0);
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 live = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1u);
          __m512 vs, vm;
          R::params16(vsb + t, live, vs, vm);
          for (int g = 0; g < G; ++g) {
            float* p = scores.data() + g * stride + t0 + t;
            const __m512 pv = _mm512_maskz_loadu_ps(live, p);
            if constexpr (R::kZero) zacc[g] = _mm512_fmadd_ps(pv, vm, zacc[g]);
            _mm512_mask_storeu_ps(p, live, _mm512_mul_ps(pv, vs));
          }
        }
      }
      if constexpr (R::kZero)
        for (int g = 0; g < G; ++g) z_sum[g] = _mm512_reduce_add_ps(zacc[g]);
    }
    st.k_done();
    alignas(64) float accm[G][D];
    if constexpr (kAmx) {
#ifdef PDSERVE_HAVE_AMX
      amx_pv<D, G>(accm, scores.data(), stride, L, vh, blocks, BS, v_pass);
#endif
    } else {
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; d += 16) _mm512_store_ps(accm[g] + d, _mm512_setzero_ps());
      for (int64_t j = 0; j < nblocks; ++j) {
        const T* vb = vh + blocks[j] * BS * D;
        const int64_t t0 = j * BS, n = std::min(BS, L - t0);
        if constexpr (R::kIntDot) {
          int_pv_block_vnni<D, G>(accm, scores.data() + t0, stride, n, vb,
                                  [&](int c, int64_t t) { v_pass(t0 * NC + c * n + t, L * NC); });
          continue;
        }
        pv_block<D, G>(accm, scores.data() + t0, stride, n,
                       [&](int64_t t, int c, __m512& v0, __m512& v1) { R::f32x32(vb + t * D + 32 * c, v0, v1); },
                       [&](int c, int64_t t) { v_pass(t0 * NC + c * n + t, L * NC); });
      }
    }
    v_pass(1, 1);
    for (int g = 0; g < G; ++g) {
      at::BFloat16* o = out + (b * H + h * G + g) * D;
      const __m512 z = _mm512_set1_ps(z_sum[g]);
      for (int d = 0; d < D; d += 16) {
        __m512 x = _mm512_load_ps(accm[g] + d);
        if constexpr (R::kZero) x = _mm512_add_ps(x, z);
        store_bf16x16(o + d, x);
      }
    }
#ifdef PDSERVE_HAVE_AMX
    if constexpr (kAmx)
      if (last) _tile_release();
#endif
  });
}

// Lane indices, and the permutes that interleave two keys' V rows by dim (vlo: dims 0..15, vhi: 16..31)
// and pairs of keys' probabilities per row (pil) for the bf16 pair dot products of p.v.
struct FlashPermutes { __m512i lane, vlo, vhi, pil; };
inline FlashPermutes flash_permutes() {
  alignas(64) int16_t il_lo[32], il_hi[32], p_il[32];
  for (int i = 0; i < 16; ++i) {
    il_lo[2 * i] = i, il_lo[2 * i + 1] = 32 + i;       // (a[i], b[i]): dims 0..15 of two keys
    il_hi[2 * i] = 16 + i, il_hi[2 * i + 1] = 48 + i;  // dims 16..31
    p_il[2 * i] = i, p_il[2 * i + 1] = 16 + i;         // (p[key 2t][row i], p[key 2t+1][row i])
  }
  return {_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_load_si512(il_lo),
          _mm512_load_si512(il_hi), _mm512_load_si512(p_il)};
}

// A tile's start: its rows' query dim pairs gathered into qt [G][D/2][lanes = rows] (q0: the tile's first
// row at its kv head's first query head, rows q_row apart), accumulators zeroed, softmax state reset.
template <int D, int G>
inline void start_tile(const at::BFloat16* q0, int64_t q_row, __mmask16 row_mask, __m512i lane, int32_t (*qt)[D / 2][16],
                       float (*acc)[D][16], __m512* m, __m512* l) {
  const __m512i q_rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(q_row / 2)));
  for (int g = 0; g < G; ++g) {
    const int32_t* qg = reinterpret_cast<const int32_t*>(q0 + g * D);
    for (int pr = 0; pr < D / 2; ++pr)
      _mm512_store_si512(qt[g][pr], _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), row_mask,
                                                                 _mm512_add_epi32(q_rows, _mm512_set1_epi32(pr)), qg, 4));
    for (int d = 0; d < D; ++d) _mm512_store_ps(acc[g][d], _mm512_setzero_ps());
    m[g] = _mm512_set1_ps(-1e30f), l[g] = _mm512_setzero_ps();
  }
}

// A tile's end: each row's output acc / l as bf16 (o0: the tile's first row at its kv head's first query
// head, rows out_row apart).
template <int D, int G>
inline void finish_tile(float (*acc)[D][16], const __m512* l, int64_t rows, __m512i lane, at::BFloat16* o0,
                        int64_t out_row) {
  const __m512i dim_rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32(16));  // acc[g][16c + lane][i]
  for (int g = 0; g < G; ++g) {
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l[g]));
    for (int64_t i = 0; i < rows; ++i) {
      at::BFloat16* o = o0 + i * out_row + g * D;
      const __m512 vinv = _mm512_set1_ps(inv[i]);
      for (int c = 0; c < D / 16; ++c) {
        const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(dim_rows, _mm512_set1_epi32(static_cast<int32_t>(16 * c * 16 + i))), &acc[g][0][0], 4);
        store_bf16x16(o + 16 * c, _mm512_mul_ps(v, vinv));
      }
    }
  }
}

// Causal prefill attention over the paged cache (bf16, head_dim 64 or 128, block size a multiple of 16): the
// queries of sequence p sit at positions [ctx[p] - q_len[p], ctx[p]) and attend keys up to their own
// position, read through the block table (this step's K/V are already in the cache). Flash-style, per
// (sequence, kv head, tile of 16 query rows) and 16 keys at a time, with the tile's rows in the 16 lanes
// of a vector: a key's scores for all rows are one chain of dot products against the row-major K read
// in place (a broadcast per pair of dims, no transpose of K), the online softmax is lane-wise (no
// horizontal max or sum), and p.v is AVX-512 BF16 dot products over pairs of keys, with p rounded to
// bf16 as torch's CPU flash attention does and V interleaved by key pairs once per 16 keys for the
// tile's G heads. The accumulators stay fp32, [head][dim][row], in L1.
// A quantized cache: the 16 keys are converted to bf16 once per chunk (exact), their scores multiplied by
// their K scales, and the probabilities by their V scales before they are rounded to bf16 for p.v (the
// row sums l stay unscaled). int8's offsets m (see decode_avx512): each score gains m_t times its row's
// sum(q) (per lane, once per tile), and sum_t p_t m_t runs beside the accumulators in float (rescaled
// with them) and is added to every dim before the division by l.
template <int D, int G, typename R>
void prefill_avx512(const at::BFloat16* q, const typename R::T* k_cache, const typename R::T* v_cache,
                    const float* k_scale, const float* v_scale, const int64_t* tables, int64_t max_blocks,
                    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx, int64_t P, at::BFloat16* out,
                    int64_t H, int64_t KVH, int64_t NB, int64_t BS, float scale, int64_t q_row, int64_t out_row) {
  using T = typename R::T;
  constexpr int64_t QT = kQueryTile;
  constexpr int64_t chunk_bytes = 16 * D * static_cast<int64_t>(sizeof(T));
  std::vector<PrefillTile> items;
  std::vector<int64_t> costs;
  prefill_tiles(P, KVH, q_len, ctx, items, costs);
  const __m512 scale2 = _mm512_set1_ps(scale * 1.44269504088896341f);  // scores in log2 units: exp2 below
  const __m512 neg_big = _mm512_set1_ps(-1e30f);  // finite: -ffast-math assumes no infinities
  const FlashPermutes perm = flash_permutes();  // named, not a structured binding: lambdas capture them from C++20 only
  const __m512i lane = perm.lane, vlo = perm.vlo, vhi = perm.vhi, pil = perm.pil;
  for_each_costed(costs, [&](int64_t it) {
    const PrefillTile& item = items[it];
    const int64_t p = item.p, h = item.h, r0 = item.r0, rows = item.rows, first_pos = item.first_pos;
    const int64_t* blocks = tables + p * max_blocks;
    const auto [kh, vh, ksh, vsh] = head_planes<R>(k_cache, v_cache, k_scale, v_scale, h, NB * BS, D);
    alignas(64) int32_t kconv[R::kQuantized ? 8 * D : 1];  // the chunk's 16 quantized keys as bf16
    alignas(64) float kmul[16], vmul[16];  // per key: K scale x softmax scale (log2 units), V scale
    alignas(64) float kzero[16], vzero[16];  // int8, per key: K offset m x softmax scale (log2 units), V offset
    alignas(64) int32_t qt[G][D / 2][QT];  // query dim pairs, lanes = rows
    alignas(64) float acc[G][D][QT];       // lanes = rows
    alignas(64) int32_t vi[8][D];          // 16 keys' V: (v[2t][d], v[2t+1][d]) per dim d
    __m512 m[G], l[G];
    const __mmask16 row_mask = static_cast<__mmask16>((1u << rows) - 1u);
    // Positions of the tile's rows; lanes past the last row repeat it (computed, never stored).
    const __m512i pos = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first_pos)), lane),
                                         _mm512_set1_epi32(static_cast<int32_t>(first_pos + rows - 1)));
    start_tile<D, G>(q + (q_start[p] + r0) * q_row + h * G * D, q_row, row_mask, lane, qt, acc, m, l);
    __m512 qsum[G], zacc[G];  // int8, per row: sum_d q_d; sum_t p_t m_t
    if constexpr (R::kZero)
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_setzero_ps();
        for (int pr = 0; pr < D / 2; ++pr) {  // a dim pair per lane: element 2pr in the low half
          const __m512i x = _mm512_load_si512(qt[g][pr]);
          a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
          a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)))));
        }
        qsum[g] = a, zacc[g] = _mm512_setzero_ps();
      }
    const int64_t num_keys = first_pos + rows;  // the last row attends this many keys
    for (int64_t j0 = 0; j0 < num_keys; j0 += 16) {
      const int64_t row0 = blocks[j0 / BS] * BS + j0 % BS, off = row0 * D;  // the chunk's first row
      const int32_t* kb = reinterpret_cast<const int32_t*>(kh + off);
      const T* vb = vh + off;
      const int64_t nk = std::min<int64_t>(16, num_keys - j0);
      if (j0 + 16 < num_keys) {
        const int64_t next = blocks[(j0 + 16) / BS] * BS + (j0 + 16) % BS;
        prefetch_rows(kh + next * D, chunk_bytes);
        prefetch_rows(vh + next * D, chunk_bytes);
        if constexpr (R::kQuantized) prefetch_rows(ksh + next, 64), prefetch_rows(vsh + next, 64);
      }
      if constexpr (R::kQuantized) {  // keys past nk: scale 0 (their rows may hold anything)
        const __mmask16 live = static_cast<__mmask16>((1u << nk) - 1u);
        __m512 ks, km, vs, vm;
        R::params16(ksh + row0, live, ks, km);
        R::params16(vsh + row0, live, vs, vm);
        _mm512_store_ps(kmul, _mm512_mul_ps(scale2, ks));
        _mm512_store_ps(vmul, vs);
        if constexpr (R::kZero) _mm512_store_ps(kzero, _mm512_mul_ps(scale2, km)), _mm512_store_ps(vzero, vm);
        for (int t = 0; t < 16; ++t)
          for (int c = 0; c < D / 32; ++c)
            _mm512_store_si512(kconv + t * (D / 2) + 16 * c, R::bf16x32(kh + off + t * D + 32 * c));
        kb = kconv;
      }
      for (int tp = 0; tp < 8; ++tp) {  // keys past nk get zero V (their rows may hold anything)
        const T* v0 = vb + 2 * tp * D;
        for (int c = 0; c < D / 32; ++c) {  // dims 32c .. 32c+31 of keys 2tp and 2tp+1, interleaved
          const __m512i a = 2 * tp < nk ? R::bf16x32(v0 + 32 * c) : _mm512_setzero_si512();
          const __m512i b = 2 * tp + 1 < nk ? R::bf16x32(v0 + D + 32 * c) : _mm512_setzero_si512();
          _mm512_store_si512(vi[tp] + 32 * c, _mm512_permutex2var_epi16(a, vlo, b));
          _mm512_store_si512(vi[tp] + 32 * c + 16, _mm512_permutex2var_epi16(a, vhi, b));
        }
      }
      const bool causal = j0 + 15 > first_pos;  // some key of this chunk lies past some row's position
      for (int g = 0; g < G; ++g) {
        __m512 s[16];
        for (int t = 0; t < 16; ++t) s[t] = _mm512_setzero_ps();
        for (int pr = 0; pr < D / 2; ++pr) {
          const __m512bh qv = (__m512bh)_mm512_load_si512(qt[g][pr]);
          for (int t = 0; t < 16; ++t)
            s[t] = _mm512_dpbf16_ps(s[t], qv, (__m512bh)_mm512_set1_epi32(kb[t * (D / 2) + pr]));
        }
        __m512 mx = neg_big;
        for (int t = 0; t < 16; ++t) {
          if constexpr (R::kZero)
            s[t] = _mm512_fmadd_ps(s[t], _mm512_set1_ps(kmul[t]), _mm512_mul_ps(qsum[g], _mm512_set1_ps(kzero[t])));
          else
            s[t] = _mm512_mul_ps(s[t], R::kQuantized ? _mm512_set1_ps(kmul[t]) : scale2);
          if (causal)
            s[t] = _mm512_mask_mov_ps(neg_big, _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(j0 + t))), s[t]);
          mx = _mm512_max_ps(mx, s[t]);
        }
        const __m512 m_new = _mm512_max_ps(m[g], mx);
        const __m512 alpha = exp2_ps(_mm512_sub_ps(m[g], m_new));
        m[g] = m_new;
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < 16; ++t) {
          s[t] = exp2_ps(_mm512_sub_ps(s[t], m_new));
          sum = _mm512_add_ps(sum, s[t]);
        }
        l[g] = _mm512_fmadd_ps(l[g], alpha, sum);
        if constexpr (R::kZero) {
          __m512 z = _mm512_mul_ps(zacc[g], alpha);
          for (int t = 0; t < 16; ++t) z = _mm512_fmadd_ps(s[t], _mm512_set1_ps(vzero[t]), z);
          zacc[g] = z;
        }
        if constexpr (R::kQuantized)
          for (int t = 0; t < 16; ++t) s[t] = _mm512_mul_ps(s[t], _mm512_set1_ps(vmul[t]));
        __m512bh pp[8];
        for (int tp = 0; tp < 8; ++tp)
          pp[tp] = (__m512bh)_mm512_permutexvar_epi16(pil, (__m512i)_mm512_cvtne2ps_pbh(s[2 * tp + 1], s[2 * tp]));
        for (int dc = 0; dc < D; dc += 16) {
          __m512 a[16];
          for (int k = 0; k < 16; ++k) a[k] = _mm512_mul_ps(_mm512_load_ps(acc[g][dc + k]), alpha);
          for (int tp = 0; tp < 8; ++tp)
            for (int k = 0; k < 16; ++k)
              a[k] = _mm512_dpbf16_ps(a[k], pp[tp], (__m512bh)_mm512_set1_epi32(vi[tp][dc + k]));
          for (int k = 0; k < 16; ++k) _mm512_store_ps(acc[g][dc + k], a[k]);
        }
      }
    }
    if constexpr (R::kZero)
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) _mm512_store_ps(acc[g][d], _mm512_add_ps(_mm512_load_ps(acc[g][d]), zacc[g]));
    finish_tile<D, G>(acc, l, rows, lane, out + (q_start[p] + r0) * out_row + h * G * D, out_row);
  });
}

#ifdef PDSERVE_HAVE_AMX

// Causal prefill attention over a bf16 paged cache with AMX BF16 tiles: the inputs, outputs and causal
// positions of paged_prefill / prefill_avx512, the same work items (sequence, kv head, tile of 16 query
// rows) and the same lane-wise online softmax (rows in the 16 lanes), 32 keys at a time. The two products
// run on the tile unit, each oriented so that the softmax needs no transpose:
// - scores transposed, S^T = K Q^T: K's 16 rows straight from the cache are the A tile, the tile's
//   queries gathered once into dim pairs x rows (start_tile's qt) the B tile; a C row is one key's scores
//   for the 16 rows, as prefill_avx512 holds them.
// - output transposed, O^T += V^T P^T: the probabilities of key pairs x rows (prefill_avx512's pp) are the
//   B tile, and the accumulators [head][dim][row] are C tiles as they lie in memory (16 dims x 16 rows);
//   the A tile is V transposed (dims x key pairs), which the cache does not hold: every (sequence, kv
//   head)'s V is packed so once per call, before the tiles run, and shared by all its query tiles and heads.
// The accumulators are rescaled only when some row's running max moved. Products are bf16 x bf16 summed
// in fp32 by the tile unit (its order, and bf16 denormal inputs read as zero), p rounded to bf16 as in
// prefill_avx512: within bf16 rounding of it, not bitwise equal.
template <int D, int G>
void prefill_amx(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache, const int64_t* tables,
                 int64_t max_blocks, const int64_t* q_start, const int64_t* q_len, const int64_t* ctx, int64_t P,
                 at::BFloat16* out, int64_t H, int64_t KVH, int64_t NB, int64_t BS, float scale, int64_t q_row,
                 int64_t out_row) {
  constexpr int64_t QT = kQueryTile, KC = 32;  // query rows per tile, keys per step
  // V^T per (sequence, kv head): per 32-key chunk, D rows of 16 key pairs (int32: two bf16), keys past the
  // context zero. vt_at[p * KVH + h] is its first chunk.
  std::vector<int64_t> vt_at(P * KVH + 1, 0), chunk_costs;
  std::vector<std::array<int64_t, 3>> chunks;  // (p, h, first key)
  for (int64_t p = 0; p < P; ++p)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t n = (ctx[p] + KC - 1) / KC;
      vt_at[p * KVH + h + 1] = vt_at[p * KVH + h] + n * D * 16;
      for (int64_t j = 0; j < n; ++j) chunks.push_back({p, h, j * KC}), chunk_costs.push_back(1);
    }
  std::unique_ptr<int32_t[]> vt(new int32_t[std::max<int64_t>(1, vt_at.back())]);
  const FlashPermutes perm = flash_permutes();
  const __m512i lane = perm.lane, vlo = perm.vlo, vhi = perm.vhi, pil = perm.pil;
  for_each_costed(chunk_costs, [&](int64_t c) {
    const auto [p, h, j0] = chunks[c];
    const int64_t nk = std::min<int64_t>(KC, ctx[p] - j0);
    alignas(64) int32_t vi[16][D];  // (v[2t][d], v[2t+1][d]) per dim d, as prefill_avx512's vi
    for (int64_t t = 0; t < 16; ++t) {
      const auto row = [&](int64_t key) -> const at::BFloat16* {
        return v_cache + ((h * NB + tables[p * max_blocks + key / BS]) * BS + key % BS) * D;
      };
      for (int c2 = 0; c2 < D / 32; ++c2) {
        const __m512i a = 2 * t < nk ? _mm512_loadu_si512(row(j0 + 2 * t) + 32 * c2) : _mm512_setzero_si512();
        const __m512i b = 2 * t + 1 < nk ? _mm512_loadu_si512(row(j0 + 2 * t + 1) + 32 * c2) : _mm512_setzero_si512();
        _mm512_store_si512(vi[t] + 32 * c2, _mm512_permutex2var_epi16(a, vlo, b));
        _mm512_store_si512(vi[t] + 32 * c2 + 16, _mm512_permutex2var_epi16(a, vhi, b));
      }
    }
    int32_t* dst = vt.get() + vt_at[p * KVH + h] + (j0 / KC) * D * 16;
    const __m512i col = _mm512_mullo_epi32(lane, _mm512_set1_epi32(D));
    for (int d = 0; d < D; ++d) _mm512_storeu_si512(dst + d * 16, _mm512_i32gather_epi32(col, &vi[0][d], 4));
  });

  std::vector<PrefillTile> items;
  std::vector<int64_t> costs;
  prefill_tiles(P, KVH, q_len, ctx, items, costs);
  const __m512 scale2 = _mm512_set1_ps(scale * 1.44269504088896341f);  // log2 units: exp2 below
  const __m512 neg_big = _mm512_set1_ps(-1e30f);
  const TileConfig config;
  for_each_costed(costs, [&](int64_t it) {
    const PrefillTile& item = items[it];
    const int64_t p = item.p, h = item.h, r0 = item.r0, rows = item.rows, first_pos = item.first_pos;
    const int64_t* blocks = tables + p * max_blocks;
    const at::BFloat16* kh = k_cache + h * NB * BS * D;
    const int32_t* vth = vt.get() + vt_at[p * KVH + h];
    alignas(64) int32_t qt[G][D / 2][QT];
    alignas(64) float acc[G][D][QT];
    alignas(64) float sbuf[KC][16];  // C rows: one key's scores for the 16 rows
    alignas(64) int32_t pbuf[KC / 2][16];
    __m512 m[G], l[G];
    const __mmask16 row_mask = static_cast<__mmask16>((1u << rows) - 1u);
    const __m512i pos = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first_pos)), lane),
                                         _mm512_set1_epi32(static_cast<int32_t>(first_pos + rows - 1)));
    start_tile<D, G>(q + (q_start[p] + r0) * q_row + h * G * D, q_row, row_mask, lane, qt, acc, m, l);
    _tile_loadconfig(&config);
    const int64_t num_keys = first_pos + rows;
    const auto krow = [&](int64_t key) { return kh + (blocks[key / BS] * BS + key % BS) * D; };
    for (int64_t j0 = 0; j0 < num_keys; j0 += KC) {
      const bool two = j0 + 16 < num_keys;  // the second 16 keys hold some key a row attends
      const at::BFloat16* k0 = krow(j0);
      const at::BFloat16* k1 = two ? krow(j0 + 16) : k0;
      if (j0 + KC < num_keys) {
        prefetch_rows(krow(j0 + KC), 16 * D * 2);
        if (j0 + KC + 16 < num_keys) prefetch_rows(krow(j0 + KC + 16), 16 * D * 2);
      }
      const int32_t* vtc = vth + (j0 / KC) * D * 16;
      const bool causal = j0 + KC - 1 > first_pos;
      for (int g = 0; g < G; ++g) {
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < D / 32; ++c) {
          _tile_loadd(2, &qt[g][16 * c][0], 64);
          _tile_loadd(4, k0 + 32 * c, D * 2);
          _tile_dpbf16ps(0, 4, 2);
          if (two) {
            _tile_loadd(5, k1 + 32 * c, D * 2);
            _tile_dpbf16ps(1, 5, 2);
          }
        }
        _tile_stored(0, &sbuf[0][0], 64);
        _tile_stored(1, &sbuf[16][0], 64);
        __m512 s[KC];
        __m512 mx = neg_big;
        for (int t = 0; t < KC; ++t) {
          s[t] = _mm512_mul_ps(_mm512_load_ps(sbuf[t]), scale2);
          if (causal)
            s[t] = _mm512_mask_mov_ps(neg_big, _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(j0 + t))), s[t]);
          mx = _mm512_max_ps(mx, s[t]);
        }
        const __m512 m_new = _mm512_max_ps(m[g], mx);
        const bool moved = _mm512_cmp_ps_mask(m_new, m[g], _CMP_NEQ_OQ) != 0;
        const __m512 alpha = exp2_ps(_mm512_sub_ps(m[g], m_new));
        m[g] = m_new;
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < KC; ++t) {
          s[t] = exp2_ps(_mm512_sub_ps(s[t], m_new));
          sum = _mm512_add_ps(sum, s[t]);
        }
        l[g] = _mm512_fmadd_ps(l[g], alpha, sum);
        for (int tp = 0; tp < KC / 2; ++tp)
          _mm512_store_si512(pbuf[tp], _mm512_permutexvar_epi16(pil, (__m512i)_mm512_cvtne2ps_pbh(s[2 * tp + 1], s[2 * tp])));
        if (moved)
          for (int d = 0; d < D; ++d) _mm512_store_ps(acc[g][d], _mm512_mul_ps(_mm512_load_ps(acc[g][d]), alpha));
        _tile_loadd(7, &pbuf[0][0], 64);
        for (int dg = 0; dg < D / 16; ++dg) {
          _tile_loadd(0, &acc[g][16 * dg][0], 64);
          _tile_loadd(6, vtc + 16 * dg * 16, 64);
          _tile_dpbf16ps(0, 6, 7);
          _tile_stored(0, &acc[g][16 * dg][0], 64);
        }
      }
    }
    _tile_release();
    finish_tile<D, G>(acc, l, rows, lane, out + (q_start[p] + r0) * out_row + h * G * D, out_row);
  });
}
#endif  // AMX

// int4 (KIVI) decode with AVX-512 BF16, reading the packed nibbles in place (head_dim D 64 or 128, G query
// heads per kv head, blocks of a multiple of 16 tokens). Sealed blocks:
// - keys, one scale s_c and zero z_c per channel over the block: q.k = sum_c (q_c s_c) n_c + sum_c q_c z_c.
//   Once per block the G query heads take the block's channel scales (G x D multiplies, rounded to bf16
//   for the dot products: the reference rounds the dequantized keys to bf16 instead) and one constant per
//   head (the zeros' share, in float); the nibbles become bf16 by a 32-entry table in one permute per 32
//   values and go through the same BF16 dot products as a bf16 block.
// - values, one scale s_t and zero z_t per token: p_t v_t = (p_t s_t) n_t + p_t z_t, so the scale is
//   folded into p (as the int8 path does) and sum_t p_t z_t is one scalar per head, added to every dim at
//   the end; the nibbles become float by a 16-entry table (vpermps) and enter float FMAs.
// Open blocks (res_slot >= 0) read their bf16 rows from the residual pool as the bf16 kernel reads a block.
// Nibble order: byte i holds elements 2i (low) and 2i + 1 (high), so unpacking gives the even elements of a
// span and then its odd ones. Rather than re-interleave every row, the queries are permuted once into the
// keys' order (per 64 dims: 32 even, 32 odd) and the V accumulators kept in the values' order (per 32
// dims: 16 even, 16 odd), put back in order once per item; open V rows are permuted into that order.
template <int D, int G>
void decode_int4_avx512(const at::BFloat16* q, const uint8_t* k_cache, const uint8_t* v_cache, const at::Half* k_scale,
                        const at::Half* k_zero, const at::Half* v_scale, const at::Half* v_zero,
                        const at::BFloat16* res_k, const at::BFloat16* res_v, const int32_t* res_slot,
                        const int64_t* table, const int64_t* ctx, at::BFloat16* out, int64_t B, int64_t H, int64_t KVH,
                        int64_t NB, int64_t BS, int64_t R, int64_t max_blocks, float scale) {
  constexpr int NC = D / 32, D2 = D / 2;
  const int64_t packed_bytes = BS * D2;
  const __m512 vscale = _mm512_set1_ps(scale);
  alignas(64) uint16_t nib_bf16[32];  // bf16 of (i & 15): the permute reads the low 5 bits of each lane
  for (int i = 0; i < 32; ++i) nib_bf16[i] = static_cast<uint16_t>(at::BFloat16(static_cast<float>(i & 15)).x);
  const __m512i nib_table = _mm512_load_si512(nib_bf16);
  const __m512 nib_f32 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);  // low 4 bits
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i inter_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i inter_hi = _mm512_add_epi32(inter_lo, _mm512_set1_epi32(8));
  // x[0..63] in the keys' nibble order (x even elements, then odd), into dst[0..63].
  const auto keys_order64 = [&](const __m512* x, float* dst) {
    _mm512_store_ps(dst, _mm512_permutex2var_ps(x[0], even, x[1]));
    _mm512_store_ps(dst + 16, _mm512_permutex2var_ps(x[2], even, x[3]));
    _mm512_store_ps(dst + 32, _mm512_permutex2var_ps(x[0], odd, x[1]));
    _mm512_store_ps(dst + 48, _mm512_permutex2var_ps(x[2], odd, x[3]));
  };
  for_each_item_ranged(ctx, B, KVH, [&](int64_t idx, bool first, bool last) {
    thread_local std::vector<float> scores;
    const int64_t b = idx / KVH, h = idx % KVH, L = ctx[b];
    const int64_t* blocks = table + b * max_blocks;
    const int64_t nblocks = (L + BS - 1) / BS;
    const at::BFloat16* qh = q + (b * H + h * G) * D;
    const int64_t stride = nblocks * BS + 16;
    scores.resize(G * stride);
    float* const sc = scores.data();  // (one thread-local lookup: the loops below would repeat it)
    const auto open_rows = [&](const at::BFloat16* pool, int32_t slot) { return pool + (h * R + slot) * BS * D; };
    const Int4Spans where{k_cache, v_cache, k_scale, k_zero, v_scale, v_zero, res_k, res_v, res_slot, h, NB, BS, R, D};
    // Block a's K side with its scales (or, past the last, V block a - nblocks), into L1.
    const auto prefetch_block = [&](int64_t a) {
      where.spans(a < nblocks, blocks[a < nblocks ? a : a - nblocks], BS, prefetch_rows);
    };
    alignas(64) float qf[G][D], qk[G][D];  // queries x softmax scale: in order, and in the keys' order
    for (int g = 0; g < G; ++g) {
      for (int d = 0; d < D; d += 16) _mm512_store_ps(qf[g] + d, _mm512_mul_ps(bf16x16_to_float(qh + g * D + d), vscale));
      for (int d = 0; d < D; d += 64) {
        const __m512 x[4] = {_mm512_load_ps(qf[g] + d), _mm512_load_ps(qf[g] + d + 16), _mm512_load_ps(qf[g] + d + 32),
                             _mm512_load_ps(qf[g] + d + 48)};
        keys_order64(x, qk[g] + d);
      }
    }
    alignas(64) uint16_t kconv[16 * D];  // 16 sealed K rows' nibbles as bf16, in the keys' order
    alignas(64) uint16_t qbf[G][D];      // q_c s_c as bf16, in the keys' order
    alignas(64) float sk[D];
    float kconst[G];
    // Memory as decode_avx512: a thread's first item reads its K side (sealed blocks: packed rows and the
    // channel scales and zeros; open ones: the residual rows) in a pure-load pass before the K pass; every
    // later side arrives through L2 streams paced by the compute of the side before (the item's V under its
    // K pass, the thread's next item's K under p.v). Open blocks' residual rows are not streamed (one per
    // sequence, written a step ago); the streams read their stale sealed bytes instead, harmlessly.
    const auto warm_k = [&] {
      __m512i x = _mm512_setzero_si512();
      const auto lines = [&](const void* p, int64_t bytes) {
        for (int64_t off = 0; off < bytes; off += 64)
          x = _mm512_or_si512(x, _mm512_loadu_si512(static_cast<const char*>(p) + off));
      };
      for (int64_t j = 0; j < nblocks; ++j) where.spans(true, blocks[j], std::min(BS, L - j * BS), lines);
      asm volatile("" : : "v"(x));  // keeps the loads
    };
    L2Stream streams[3];  // packed rows, scales, zeros of one side
    const auto start_side = [&](bool k_side, int64_t kv_head, const int64_t* blk, int64_t L1) {
      const int64_t nb1 = (L1 + BS - 1) / BS, last_rows = L1 - (nb1 - 1) * BS;
      const int64_t plane = kv_head * NB;
      if (k_side) {
        streams[0].start(k_cache + plane * packed_bytes, blk, nb1, packed_bytes, last_rows * D2);
        streams[1].start(k_scale + plane * D, blk, nb1, 2 * D, 2 * D);
        streams[2].start(k_zero + plane * D, blk, nb1, 2 * D, 2 * D);
      } else {
        streams[0].start(v_cache + plane * packed_bytes, blk, nb1, packed_bytes, last_rows * D2);
        streams[1].start(v_scale + plane * BS, blk, nb1, 2 * BS, 2 * last_rows);
        streams[2].start(v_zero + plane * BS, blk, nb1, 2 * BS, 2 * last_rows);
      }
    };
    const auto pace = [&](int64_t done, int64_t total) {
      for (L2Stream& st : streams) st.pace(done, total);
    };
    if (first) warm_k();
    start_side(false, h, blocks, L);
    for (int64_t a = 0; a < kPrefetch && a < 2 * nblocks; ++a) prefetch_block(a);
    for (int64_t j = 0; j < nblocks; ++j) {
      if (j + kPrefetch < 2 * nblocks) prefetch_block(j + kPrefetch);
      pace(j + 1, nblocks);
      const int64_t blk = blocks[j], t0 = j * BS, n = std::min(BS, L - t0);
      const int32_t slot = res_slot[blk];
      if (slot >= 0) {  // open: bf16 rows, as the bf16 kernel
        const at::BFloat16* kb = open_rows(res_k, slot);
        for (int64_t t = 0; t < n; t += 16)  // rows past n are read (the slot has BS rows), never used
          bf16_scores16<D, G>(qh, kb + t * D, [&](int g, __m512 dots) {
            _mm512_storeu_ps(sc + g * stride + t0 + t, _mm512_mul_ps(dots, vscale));
          });
        continue;
      }
      // Sealed: the block's channel scales into the queries, the zeros into one constant per head.
      const at::Half* ksb = k_scale + (h * NB + blk) * D;
      const at::Half* kzb = k_zero + (h * NB + blk) * D;
      for (int d = 0; d < D; d += 64) {
        __m512 x[4];
        for (int i = 0; i < 4; ++i) x[i] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ksb + d + 16 * i)));
        keys_order64(x, sk + d);
      }
      for (int g = 0; g < G; ++g) {
        __m512 z = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16)
          z = _mm512_fmadd_ps(_mm512_load_ps(qf[g] + d),
                              _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kzb + d))), z);
        kconst[g] = _mm512_reduce_add_ps(z);
        for (int c = 0; c < NC; ++c) {
          const __m512 lo = _mm512_mul_ps(_mm512_load_ps(qk[g] + 32 * c), _mm512_load_ps(sk + 32 * c));
          const __m512 hi = _mm512_mul_ps(_mm512_load_ps(qk[g] + 32 * c + 16), _mm512_load_ps(sk + 32 * c + 16));
          _mm512_store_si512(qbf[g] + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      }
      const uint8_t* kb = k_cache + (h * NB + blk) * packed_bytes;
      for (int64_t t = 0; t < n; t += 16) {
        for (int r = 0; r < 16; ++r)
          for (int d = 0; d < D; d += 64) {  // 32 bytes: 32 even elements (low nibbles), then 32 odd
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + (t + r) * D2 + d / 2)));
            _mm512_store_si512(kconv + r * D + d, _mm512_permutexvar_epi16(w, nib_table));
            _mm512_store_si512(kconv + r * D + d + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), nib_table));
          }
        bf16_scores16<D, G>(qbf, kconv, [&](int g, __m512 dots) {
          _mm512_storeu_ps(sc + g * stride + t0 + t, _mm512_add_ps(dots, _mm512_set1_ps(kconst[g])));
        });
      }
    }
    for (int g = 0; g < G; ++g) softmax_avx512(sc + g * stride, L);
    pace(1, 1);  // the rest of V
    for (L2Stream& st : streams) st = L2Stream();
    if (!last) start_side(true, (idx + 1) % KVH, table + (idx + 1) / KVH * max_blocks, ctx[(idx + 1) / KVH]);
    alignas(64) float accm[G][D];  // in the values' order
    __m512 zacc[G];                // sum_t p_t z_t, per lane
    alignas(64) int16_t w16[G][avx2::kPvRows + 16];  // a run's weights in int16 steps of unit[g]
    float unit[G];
    for (int g = 0; g < G; ++g) {
      zacc[g] = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 16) _mm512_store_ps(accm[g] + d, _mm512_setzero_ps());
    }
    // A sealed block's V scales into its weights (p_t s_t in place of p_t) and its zeros' share into zacc.
    const auto fold_v = [&](int64_t j) {
      const int64_t blk = blocks[j], t0 = j * BS, n = std::min(BS, L - t0);
      const at::Half* vsb = v_scale + (h * NB + blk) * BS;
      const at::Half* vzb = v_zero + (h * NB + blk) * BS;
      for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1u);
        const __m512 vs = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, vsb + t));
        const __m512 vz = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, vzb + t));
        for (int g = 0; g < G; ++g) {
          float* p = sc + g * stride + t0 + t;
          const __m512 pv = _mm512_maskz_loadu_ps(live, p);
          zacc[g] = _mm512_fmadd_ps(pv, vz, zacc[g]);
          _mm512_mask_storeu_ps(p, live, _mm512_mul_ps(pv, vs));
        }
      }
    };
    const auto next_block = [&](int64_t j) {
      if (j + kPrefetch < nblocks) prefetch_block(nblocks + j + kPrefetch);
      pace(j + 1, nblocks);
    };
    for (int64_t j = 0; j < nblocks;) {
      const int64_t t0 = j * BS;
      const int32_t slot = res_slot[blocks[j]];
      if (slot >= 0) {  // open: bf16 rows, each slice's 32 dims permuted into the values' order
        next_block(j);
        const at::BFloat16* vr = open_rows(res_v, slot);
        pv_block<D, G>(accm, sc + t0, stride, std::min(BS, L - t0), [&](int64_t t, int c, __m512& v0, __m512& v1) {
          const __m512 x0 = bf16x16_to_float(vr + t * D + 32 * c), x1 = bf16x16_to_float(vr + t * D + 32 * c + 16);
          v0 = _mm512_permutex2var_ps(x0, even, x1), v1 = _mm512_permutex2var_ps(x0, odd, x1);
        });
        ++j;
        continue;
      }
      if constexpr (kHaveVnni) {
        if (BS <= avx2::kPvRows) {  // a run of sealed blocks, at most kPvRows rows, in integers
          int64_t j1 = j, m = 0;
          while (j1 < nblocks && res_slot[blocks[j1]] < 0 && m + BS <= avx2::kPvRows) m += std::min(BS, L - j1 * BS), fold_v(j1++);
          avx2::int16_weights<G>(sc + t0, stride, m, w16, unit);
          int4_pv_run_vnni<D, G>(accm, w16, unit, m, BS, [&](int64_t k) {
            next_block(j + k);
            return v_cache + (h * NB + blocks[j + k]) * packed_bytes;
          });
          j = j1;
          continue;
        }
      }
      next_block(j);
      fold_v(j);
      const uint8_t* vb = v_cache + (h * NB + blocks[j]) * packed_bytes;
      pv_block<D, G>(accm, sc + t0, stride, std::min(BS, L - t0), [&](int64_t t, int c, __m512& v0, __m512& v1) {
        const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vb + t * D2 + 16 * c)));
        v0 = _mm512_permutexvar_ps(w, nib_f32), v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), nib_f32);
      });
      ++j;
    }
    pace(1, 1);  // the rest of the next item's K
    for (int g = 0; g < G; ++g) {  // back in order, plus the zeros' share
      at::BFloat16* o = out + (b * H + h * G + g) * D;
      const __m512 z = _mm512_set1_ps(_mm512_reduce_add_ps(zacc[g]));
      for (int c = 0; c < NC; ++c) {
        const __m512 e = _mm512_load_ps(accm[g] + 32 * c), od = _mm512_load_ps(accm[g] + 32 * c + 16);
        store_bf16x16(o + 32 * c, _mm512_add_ps(_mm512_permutex2var_ps(e, inter_lo, od), z));
        store_bf16x16(o + 32 * c + 16, _mm512_add_ps(_mm512_permutex2var_ps(e, inter_hi, od), z));
      }
    }
  });
}
#endif

}  // namespace

namespace {

bool is_quantized(const torch::Tensor& cache) {
  return cache.scalar_type() == torch::kChar || cache.scalar_type() == torch::kFloat8_e4m3fn;
}

// A quantized cache comes with its rows' parameters (kv/quant.py's qparams, kv/cache.py's LayerCache),
// contiguous, 4 bytes per row: fp8 float32 scales [KVH, NB, BS]; int8 float16 (scale, zero) pairs
// [KVH, NB, BS, 2]. An unquantized cache comes without. Returns the rows' 4-byte slots (nullptr, nullptr
// for an unquantized cache) as float pointers: fp8's are its scales; int8's are read as pairs
// (Int8Rows::params16, int8_params) and written by quantize_row_int8.
std::pair<float*, float*> cache_scales(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                       const std::optional<torch::Tensor>& k_scale,
                                       const std::optional<torch::Tensor>& v_scale) {
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k and v caches have different dtypes");
  if (!is_quantized(k_cache)) {
    TORCH_CHECK(!k_scale && !v_scale, "scales given for a ", k_cache.scalar_type(), " cache");
    return {nullptr, nullptr};
  }
  TORCH_CHECK(k_scale && v_scale, "a ", k_cache.scalar_type(), " cache needs k_scale and v_scale");
  const bool int8 = k_cache.scalar_type() == torch::kChar;
  std::vector<int64_t> shape(k_cache.sizes().begin(), k_cache.sizes().begin() + 3);
  if (int8) shape.push_back(2);
  for (const torch::Tensor* t : {&*k_scale, &*v_scale})
    TORCH_CHECK(t->scalar_type() == (int8 ? torch::kHalf : torch::kFloat) && t->is_contiguous() &&
                    t->sizes() == c10::IntArrayRef(shape),
                "scales must be contiguous: float16 (scale, zero) pairs [KVH, NB, BS, 2] for int8, float32 "
                "[KVH, NB, BS] for fp8");
  return {static_cast<float*>(k_scale->data_ptr()), static_cast<float*>(v_scale->data_ptr())};
}

#ifdef PDSERVE_HAVE_AVX512BF16
// Calls f(R{}) with the row type of a cache dtype that has fast kernels.
template <typename F>
void with_rows(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case torch::kBFloat16: f(Bf16Rows{}); break;
    case torch::kChar: f(Int8Rows{}); break;
    case torch::kFloat8_e4m3fn: f(Fp8Rows{}); break;
    default: TORCH_CHECK(false, "no fast kernels for a ", dtype, " cache");
  }
}
#endif

template <typename T>
void decode_portable(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const float* ks, const float* vs, const torch::Tensor& table, const torch::Tensor& ctx,
                     torch::Tensor& out, float scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const auto run = [&](auto cache_elem) {
    using C = decltype(cache_elem);
    const ScaledRows<C> rows{static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
                             ks, vs, NB, BS, D};
    decode_kernel<T>(q.data_ptr<T>(), rows, table.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(), out.data_ptr<T>(),
                     B, H, D, KVH, BS, table.size(1), scale);
  };
  switch (k_cache.scalar_type()) {
    case torch::kChar: run(int8_t{}); break;
    case torch::kFloat8_e4m3fn: run(at::Float8_e4m3fn{}); break;
    default:
      TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "q and cache dtypes differ");
      run(T{});
  }
}

// a / b as IEEE division: -ffast-math lets the compiler turn a division into a multiplication by the
// reciprocal, which rounds differently, and the quantized rows must match the reference bit for bit.
inline float exact_div(float a, float b) {
#if defined(__SSE__) && !defined(__clang__)
  return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b)));  // a builtin: opaque to the optimiser
#else
  volatile float vb = b;
  return a / vb;
#endif
}

// The e4m3fn code nearest to y, ties to even, as torch converts float -> float8_e4m3fn (|y| >= 480 and
// NaN give the NaN code; a quantized row's values stay within +-448).
inline uint8_t fp8_e4m3_code(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof(bits));
  const uint32_t sign = (bits >> 24) & 0x80u;
  bits &= 0x7FFFFFFFu;
  float a;
  std::memcpy(&a, &bits, sizeof(a));
  uint32_t code;
  if (bits >= 0x43F00000u) code = 0x7F;  // 480
  else if (bits < 0x3C800000u) code = static_cast<uint32_t>(std::nearbyint(a * 512.f));  // below 2^-6: steps of 2^-9
  else code = ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);  // drop 20 mantissa bits, rebias
  return static_cast<uint8_t>(code | sign);
}

// One fp8 row quantized exactly as kv/quant.py does (the oracle): scale = max|x| / 448, x * (1 / scale)
// rounded to the nearest code, a row of zeros stored as zeros with scale 0.
template <typename In>
void quantize_row(const In* x, int64_t D, at::Float8_e4m3fn* dst, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  *scale = exact_div(amax, 448.f);
  const float inv = *scale > 0.f ? exact_div(1.f, *scale) : 0.f;
  for (int64_t d = 0; d < D; ++d)
    dst[d] = at::Float8_e4m3fn(fp8_e4m3_code(to_float(x[d]) * inv), at::Float8_e4m3fn::from_bits());
}

// int8's row parameters from the row's min and max, exactly as kv/quant.py computes them: zero =
// fp16(min), scale = fp16((max - zero) / 255), each clamped to float16's range first (beyond it a row
// saturates rather than turning into NaN); inv = 1 / scale, or 0 for a constant row.
constexpr float kFp16Max = 65504.f;
inline void int8_row_params(float lo, float hi, float& s, float& z, float& inv) {
  z = static_cast<float>(at::Half(std::min(kFp16Max, std::max(-kFp16Max, lo))));
  s = static_cast<float>(at::Half(std::min(kFp16Max, exact_div(hi - z, 255.f))));
  inv = s > 0.f ? exact_div(1.f, s) : 0.f;
}

// The pair (scale, zero) as float16 into a row's 4-byte slot.
inline void store_int8_params(float* slot, float s, float z) {
  const uint16_t h[2] = {at::Half(s).x, at::Half(z).x};
  std::memcpy(slot, h, sizeof(h));
}

// One int8 row quantized exactly as kv/quant.py does: q = (x - zero) * (1 / scale) rounded to nearest
// even and clamped to [0, 255], stored as q - 128; a constant row stores q = 0 with scale 0.
template <typename In>
void quantize_row_int8(const In* x, int64_t D, int8_t* dst, float* slot) {
  float lo = to_float(x[0]), hi = lo;
  for (int64_t d = 1; d < D; ++d) lo = std::min(lo, to_float(x[d])), hi = std::max(hi, to_float(x[d]));
  float s, z, inv;
  int8_row_params(lo, hi, s, z, inv);
  for (int64_t d = 0; d < D; ++d) {
    const float q = std::min(255.f, std::max(0.f, std::nearbyint((to_float(x[d]) - z) * inv)));
    dst[d] = static_cast<int8_t>(q - 128.f);
  }
  store_int8_params(slot, s, z);
}

#ifdef PDSERVE_HAVE_AVX512BF16
inline __m512 load_f32x16(const at::BFloat16* p) { return bf16x16_to_float(p); }
inline __m512 load_f32x16(const float* p) { return _mm512_loadu_ps(p); }

// fp8_e4m3_code on 16 lanes, as 16 int32 codes.
inline __m512i fp8_e4m3_codes(__m512 y) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
  __m512i code = _mm512_sub_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(mag, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), lsb)), 20),
      _mm512_set1_epi32(120 << 3));
  const __m512 sub_steps = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(512.f)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  code = _mm512_mask_mov_epi32(code, _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(0x3C800000)),
                               _mm512_cvttps_epi32(sub_steps));
  code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(0x43F00000)), _mm512_set1_epi32(0x7F));
  return _mm512_or_si512(code, sign);
}

// quantize_row, 16 values at a time (D a multiple of 16): the same operations in the same order, so the
// same bits (the horizontal max is exact in any order).
template <typename In>
void quantize_row_avx512(const In* x, int64_t D, at::Float8_e4m3fn* dst, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_f32x16(x + d)));
  *scale = exact_div(_mm512_reduce_max_ps(amax), 448.f);
  const __m512 inv = _mm512_set1_ps(*scale > 0.f ? exact_div(1.f, *scale) : 0.f);
  for (int64_t d = 0; d < D; d += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm512_cvtepi32_epi8(fp8_e4m3_codes(_mm512_mul_ps(load_f32x16(x + d), inv))));
}

// quantize_row_int8, 16 values at a time (D a multiple of 16): the same operations, the same bits (min
// and max are exact in any order).
template <typename In>
void quantize_row_int8_avx512(const In* x, int64_t D, int8_t* dst, float* slot) {
  __m512 lo = load_f32x16(x), hi = lo;
  for (int64_t d = 16; d < D; d += 16) {
    const __m512 v = load_f32x16(x + d);
    lo = _mm512_min_ps(lo, v), hi = _mm512_max_ps(hi, v);
  }
  float s, z, inv;
  int8_row_params(_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi), s, z, inv);
  const __m512 vz = _mm512_set1_ps(z), vinv = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(load_f32x16(x + d), vz), vinv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 q = _mm512_min_ps(_mm512_set1_ps(255.f), _mm512_max_ps(_mm512_setzero_ps(), r));
    const __m512i codes = _mm512_sub_epi32(_mm512_cvttps_epi32(q), _mm512_set1_epi32(128));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtepi32_epi8(codes));
  }
  store_int8_params(slot, s, z);
}
#endif

// One row into the cache (slot: its 4 bytes of parameters): the vector version where it applies, else
// the scalar one.
template <typename In, typename C>
void quantize_into(const In* x, int64_t D, C* dst, float* slot) {
  constexpr bool int8 = std::is_same_v<C, int8_t>;
#ifdef PDSERVE_HAVE_AVX512BF16
  if (D % 16 == 0) {
    if constexpr (int8) return quantize_row_int8_avx512(x, D, dst, slot);
    else return quantize_row_avx512(x, D, dst, slot);
  }
#endif
  if constexpr (int8) quantize_row_int8(x, D, dst, slot);
  else quantize_row(x, D, dst, slot);
}


// What an open block reads as once sealed, exactly as kv/int4.py quantizes it (the oracle: zero = min and
// scale = (max - min) / 15 rounded to float16, codes round((x - zero) / scale) to even in [0, 15]),
// dequantized to bf16 as the reference reads it: rows [BS, D] of K (per channel) or V (per token) in, out.
void seal_open_rows(const at::BFloat16* x, int64_t BS, int64_t D, bool per_channel, at::BFloat16* out) {
  const int64_t groups = per_channel ? D : BS, len = per_channel ? BS : D;
  const auto idx = [&](int64_t grp, int64_t i) { return per_channel ? i * D + grp : grp * D + i; };
  for (int64_t grp = 0; grp < groups; ++grp) {
    float lo = to_float(x[idx(grp, 0)]), hi = lo;
    for (int64_t i = 1; i < len; ++i) lo = std::min(lo, to_float(x[idx(grp, i)])), hi = std::max(hi, to_float(x[idx(grp, i)]));
    const float zero = static_cast<float>(at::Half(lo));
    const float s = static_cast<float>(at::Half(exact_div(hi - zero, 15.f)));
    const float inv = s > 0.f ? exact_div(1.f, s) : 0.f;
    for (int64_t i = 0; i < len; ++i) {
      const float code = std::min(15.f, std::max(0.f, std::nearbyint((to_float(x[idx(grp, i)]) - zero) * inv)));
      out[idx(grp, i)] = at::BFloat16(code * s + zero);
    }
  }
}

#ifdef PDSERVE_HAVE_AVX512BF16
// (lo[i], hi[i]) pairs from a vector whose lanes 0..15 are lo and 16..31 hi: lane 2i <- i, 2i + 1 <- 16 + i.
alignas(64) constexpr int16_t kNibblePairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// 32 dequantized int4 values in order (16 packed bytes; element 2i is byte i's low nibble), x = n * s + z
// with scale and zero per element (s_even, z_even for elements 2i; s_odd, z_odd for 2i + 1), as bf16.
inline __m512i int4_bf16x32(const uint8_t* p, __m512 s_even, __m512 z_even, __m512 s_odd, __m512 z_odd) {
  const __m512 nib = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i pairs = _mm512_load_si512(kNibblePairs);
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(w, nib), s_even, z_even);
  const __m512 hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), nib), s_odd, z_odd);
  return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Causal prefill over an int4 (KIVI) cache: prefill_avx512's tiles (16 query rows in the lanes, 16 keys
// at a time, lane-wise online softmax, BF16 dot products), with what a decode at each query's position
// reads (torch_ref._prefill_int4): the blocks before the query's own as sealed, its own block unquantized.
// Each 16-key chunk is converted to bf16 (exact for open rows; sealed ones dequantized, n * s + z rounded
// to bf16 as the reference rounds them, up to an FMA's rounding). A chunk of an open block that some rows
// of the tile see as sealed and others as their own runs twice, once per version, each lane masked to
// the rows that read it; the sealed version of open blocks is made once per call (seal_open_rows) into
// `sealed` [KVH, n, BS, D] bf16, `sealed_index[block]` naming its row.
template <int D, int G>
void prefill_int4_avx512(const at::BFloat16* q, const uint8_t* k_cache, const uint8_t* v_cache, const at::Half* k_scale,
                         const at::Half* k_zero, const at::Half* v_scale, const at::Half* v_zero,
                         const at::BFloat16* res_k, const at::BFloat16* res_v, const int32_t* res_slot,
                         const at::BFloat16* sealed_k, const at::BFloat16* sealed_v, const int32_t* sealed_index,
                         int64_t num_sealed, const int64_t* tables, int64_t max_blocks, const int64_t* q_start,
                         const int64_t* q_len, const int64_t* ctx, int64_t P, at::BFloat16* out, int64_t H, int64_t KVH,
                         int64_t NB, int64_t BS, int64_t R, float scale, int64_t q_row, int64_t out_row) {
  constexpr int64_t QT = kQueryTile, D2 = D / 2;
  std::vector<PrefillTile> items;
  std::vector<int64_t> costs;
  prefill_tiles(P, KVH, q_len, ctx, items, costs);
  const __m512 scale2 = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512 neg_big = _mm512_set1_ps(-1e30f);
  const FlashPermutes perm = flash_permutes();  // named, not a structured binding: lambdas capture them from C++20 only
  const __m512i lane = perm.lane, vlo = perm.vlo, vhi = perm.vhi, pil = perm.pil;
  const __m512i even = _mm512_mullo_epi32(lane, _mm512_set1_epi32(2)), odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for_each_costed(costs, [&](int64_t it) {
    const PrefillTile& item = items[it];
    const int64_t p = item.p, h = item.h, r0 = item.r0, rows = item.rows, first_pos = item.first_pos, last_pos = first_pos + rows - 1;
    const int64_t* blocks = tables + p * max_blocks;
    alignas(64) int32_t kconv[8 * D];  // the chunk's 16 keys as bf16 pairs
    alignas(64) int32_t qt[G][D / 2][QT];
    alignas(64) float acc[G][D][QT];
    alignas(64) int32_t vi[8][D];
    __m512 m[G], l[G];
    const __mmask16 row_mask = static_cast<__mmask16>((1u << rows) - 1u);
    const __m512i pos = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first_pos)), lane),
                                         _mm512_set1_epi32(static_cast<int32_t>(last_pos)));
    start_tile<D, G>(q + (q_start[p] + r0) * q_row + h * G * D, q_row, row_mask, lane, qt, acc, m, l);
    // One pass over the chunk in kconv / vi: row lanes attend key j0 + t iff lo <= pos, j0 + t <= pos, pos < hi.
    const auto attend = [&](int64_t j0, int64_t nk, int64_t lo, int64_t hi) {
      __mmask16 see[16];
      for (int t = 0; t < 16; ++t) {
        const int64_t from = std::max(lo, j0 + t);
        see[t] = t < nk ? static_cast<__mmask16>(_mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(from))) &
                                                 _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(hi, INT32_MAX)))))
                        : static_cast<__mmask16>(0);
      }
      for (int g = 0; g < G; ++g) {
        __m512 s[16];
        for (int t = 0; t < 16; ++t) s[t] = _mm512_setzero_ps();
        for (int pr = 0; pr < D / 2; ++pr) {
          const __m512bh qv = (__m512bh)_mm512_load_si512(qt[g][pr]);
          for (int t = 0; t < 16; ++t) s[t] = _mm512_dpbf16_ps(s[t], qv, (__m512bh)_mm512_set1_epi32(kconv[t * (D / 2) + pr]));
        }
        __m512 mx = neg_big;
        for (int t = 0; t < 16; ++t) {
          s[t] = _mm512_mask_mov_ps(neg_big, see[t], _mm512_mul_ps(s[t], scale2));
          mx = _mm512_max_ps(mx, s[t]);
        }
        const __m512 m_new = _mm512_max_ps(m[g], mx);
        const __m512 alpha = exp2_ps(_mm512_sub_ps(m[g], m_new));
        m[g] = m_new;
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < 16; ++t) {  // masked lanes to zero: a row may see no key of this pass
          s[t] = _mm512_maskz_mov_ps(see[t], exp2_ps(_mm512_sub_ps(s[t], m_new)));
          sum = _mm512_add_ps(sum, s[t]);
        }
        l[g] = _mm512_fmadd_ps(l[g], alpha, sum);
        __m512bh pp[8];
        for (int tp = 0; tp < 8; ++tp)
          pp[tp] = (__m512bh)_mm512_permutexvar_epi16(pil, (__m512i)_mm512_cvtne2ps_pbh(s[2 * tp + 1], s[2 * tp]));
        for (int dc = 0; dc < D; dc += 16) {
          __m512 a[16];
          for (int k = 0; k < 16; ++k) a[k] = _mm512_mul_ps(_mm512_load_ps(acc[g][dc + k]), alpha);
          for (int tp = 0; tp < 8; ++tp)
            for (int k = 0; k < 16; ++k) a[k] = _mm512_dpbf16_ps(a[k], pp[tp], (__m512bh)_mm512_set1_epi32(vi[tp][dc + k]));
          for (int k = 0; k < 16; ++k) _mm512_store_ps(acc[g][dc + k], a[k]);
        }
      }
    };
    // V of 16 keys (32 bf16 per 32 dims from row_v(t, c); keys past nk zero) interleaved by key pairs into vi.
    const auto interleave_v = [&](int64_t nk, const auto& row_v) {
      for (int tp = 0; tp < 8; ++tp)
        for (int c = 0; c < D / 32; ++c) {
          const __m512i a = 2 * tp < nk ? row_v(2 * tp, c) : _mm512_setzero_si512();
          const __m512i b = 2 * tp + 1 < nk ? row_v(2 * tp + 1, c) : _mm512_setzero_si512();
          _mm512_store_si512(vi[tp] + 32 * c, _mm512_permutex2var_epi16(a, vlo, b));
          _mm512_store_si512(vi[tp] + 32 * c + 16, _mm512_permutex2var_epi16(a, vhi, b));
        }
    };
    // A chunk from bf16 rows (the residual pool, or the sealed version of an open block).
    const auto load_bf16 = [&](const at::BFloat16* kr, const at::BFloat16* vr, int64_t nk) {
      for (int t = 0; t < 16; ++t)
        for (int c = 0; c < D / 32; ++c)
          _mm512_store_si512(kconv + t * (D / 2) + 16 * c, _mm512_loadu_si512(kr + t * D + 32 * c));
      interleave_v(nk, [&](int t, int c) { return _mm512_loadu_si512(vr + t * D + 32 * c); });
    };
    const auto sealed = [&](int64_t blk, int64_t off, int64_t nk) {  // dequantized in place
      const uint8_t* kp = k_cache + ((h * NB + blk) * BS + off) * D2;
      const uint8_t* vp = v_cache + ((h * NB + blk) * BS + off) * D2;
      const at::Half* ksb = k_scale + (h * NB + blk) * D;
      const at::Half* kzb = k_zero + (h * NB + blk) * D;
      for (int c = 0; c < D / 32; ++c) {
        const auto half16 = [](const at::Half* x) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); };
        const __m512 s0 = half16(ksb + 32 * c), s1 = half16(ksb + 32 * c + 16);
        const __m512 z0 = half16(kzb + 32 * c), z1 = half16(kzb + 32 * c + 16);
        const __m512 se = _mm512_permutex2var_ps(s0, even, s1), so = _mm512_permutex2var_ps(s0, odd, s1);
        const __m512 ze = _mm512_permutex2var_ps(z0, even, z1), zo = _mm512_permutex2var_ps(z0, odd, z1);
        for (int t = 0; t < 16; ++t)
          _mm512_store_si512(kconv + t * (D / 2) + 16 * c, int4_bf16x32(kp + t * D2 + 16 * c, se, ze, so, zo));
      }
      const at::Half* vsb = v_scale + (h * NB + blk) * BS + off;
      const at::Half* vzb = v_zero + (h * NB + blk) * BS + off;
      interleave_v(nk, [&](int t, int c) {
        const __m512 s = _mm512_set1_ps(static_cast<float>(vsb[t])), z = _mm512_set1_ps(static_cast<float>(vzb[t]));
        return int4_bf16x32(vp + t * D2 + 16 * c, s, z, s, z);
      });
    };
    int4_prefill_passes<D>(first_pos, last_pos, blocks, BS, h, res_slot, res_k, res_v, R, sealed_k, sealed_v,
                           sealed_index, num_sealed, sealed, load_bf16, attend);
    finish_tile<D, G>(acc, l, rows, lane, out + (q_start[p] + r0) * out_row + h * G * D, out_row);
  });
}
#endif

}  // namespace

// Whether paged_decode / paged_prefill take their AVX-512 BF16 path for these shapes (bf16 queries and a
// bf16, int8 or fp8 e4m3 cache, contiguous); otherwise decode runs the portable loop above and prefill
// returns false.
bool decode_fast_path(bool bf16, int64_t H, int64_t KVH, int64_t D) {
#ifdef PDSERVE_HAVE_AVX512BF16
  return bf16 && KVH > 0 && H % KVH == 0 && is_fast_shape(H / KVH, D);
#else
  return false;
#endif
}

// Whether paged_decode has its AVX2 + FMA path for these shapes (bf16 queries and a bf16, int8 or fp8 e4m3
// cache): the one it takes where the CPU has no AVX-512 BF16.
bool decode_avx2_path(int64_t H, int64_t KVH, int64_t D) {
#ifdef PDSERVE_HAVE_AVX2
  return KVH > 0 && H % KVH == 0 && is_fast_shape(H / KVH, D);
#else
  return false;
#endif
}

bool prefill_fast_path(bool bf16, int64_t H, int64_t KVH, int64_t D, int64_t BS) {
  return decode_fast_path(bf16, H, KVH, D) && BS % 16 == 0;
}

// Whether paged_decode(isa="amx") runs for these shapes: the AVX-512 BF16 decode's shapes over a bf16 cache
// (`bf16`: bf16 queries and cache) in blocks of a multiple of 16 tokens, on a build and CPU with AMX BF16
// and a kernel that grants the tile state.
bool decode_amx_fast_path(bool bf16, int64_t H, int64_t KVH, int64_t D, int64_t BS) {
#ifdef PDSERVE_HAVE_AMX
  return decode_fast_path(bf16, H, KVH, D) && BS % 16 == 0 && amx_ready();
#else
  return false;
#endif
}

// Whether paged_prefill has its AVX2 + FMA path (prefill_avx2) for these shapes: the one it takes where the
// CPU has no AVX-512 BF16.
bool prefill_avx2_path(bool bf16, int64_t H, int64_t KVH, int64_t D, int64_t BS) {
  return bf16 && decode_avx2_path(H, KVH, D) && BS % 16 == 0;
}

// Whether paged_decode_int4 takes its AVX-512 path (bf16 queries and residual pool, blocks of a multiple
// of 16 tokens); otherwise it runs the portable loop.
bool decode_int4_fast_path(bool bf16, int64_t H, int64_t KVH, int64_t D, int64_t BS) {
  return decode_fast_path(bf16, H, KVH, D) && BS % 16 == 0;
}

// Whether paged_decode_int4 has its AVX2 + FMA path (decode_int4_avx2) for these shapes: the one it takes
// where the CPU has no AVX-512 BF16.
bool decode_int4_avx2_path(bool bf16, int64_t H, int64_t KVH, int64_t D, int64_t BS) {
  return bf16 && decode_avx2_path(H, KVH, D) && BS % 16 == 0;
}

// q [B, H, D]; k_cache, v_cache [KVH, NB, BS, D] (contiguous); table [B, max_blocks] int64;
// context_lens [B] int64 (>= 1); k_scale, v_scale the rows' parameters with an int8 or fp8 cache (cache_scales).
// isa: "auto" takes the fastest path this build has for the shapes (AVX-512 BF16, else AVX2, else the
// portable loop); "avx2" / "portable" force one (tests, benchmarks); "amx" the AVX-512 BF16 kernel with q.k and
// p.v on AMX tiles (a bf16 cache only, where decode_amx_fast_path; an error elsewhere: the caller checks, as the
// attention plan does). Returns [B, H, D] in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                           torch::Tensor context_lens, double scale, std::optional<torch::Tensor> k_scale,
                           std::optional<torch::Tensor> v_scale, const std::string& isa) {
  TORCH_CHECK(isa == "auto" || isa == "amx" || isa == "avx2" || isa == "portable",
              "isa must be auto, amx, avx2 or portable, not ", isa);
  TORCH_CHECK(q.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const auto [ks, vs] = cache_scales(k_cache, v_cache, k_scale, v_scale);
  q = q.contiguous();
  table = table.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D, "head layout mismatch");
  auto out = torch::empty_like(q);
  const bool bf16 = q.scalar_type() == torch::kBFloat16 &&
                    (k_cache.scalar_type() == torch::kBFloat16 || is_quantized(k_cache));
  if (isa == "amx") {
    TORCH_CHECK(decode_amx_fast_path(bf16 && k_cache.scalar_type() == torch::kBFloat16, H, KVH, D, BS),
                "no AMX decode path for this build, CPU, dtype or shape");
#ifdef PDSERVE_HAVE_AMX
    auto args = std::make_tuple(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), ks, vs, table.data_ptr<int64_t>(),
                                context_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H, KVH, NB, BS,
                                table.size(1), static_cast<float>(scale));
    with_shape(H / KVH, D, [&](auto d, auto g) {
      std::apply(decode_avx512<decltype(d)::value, decltype(g)::value, Bf16Rows, true>, args);
    });
#endif
    return out;
  }
#ifdef PDSERVE_HAVE_AVX512BF16
  if (isa == "auto" && decode_fast_path(bf16, H, KVH, D)) {
    with_rows(k_cache.scalar_type(), [&](auto rows) {
      using R = decltype(rows);
      using T = typename R::T;
      auto args = std::make_tuple(q.data_ptr<at::BFloat16>(), static_cast<const T*>(k_cache.data_ptr()),
                                  static_cast<const T*>(v_cache.data_ptr()), ks, vs, table.data_ptr<int64_t>(),
                                  context_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H, KVH, NB, BS,
                                  table.size(1), static_cast<float>(scale));
      with_shape(H / KVH, D, [&](auto d, auto g) { std::apply(decode_avx512<decltype(d)::value, decltype(g)::value, R>, args); });
    });
    return out;
  }
#endif
  const bool avx2 = bf16 && decode_avx2_path(H, KVH, D);
  TORCH_CHECK(isa != "avx2" || avx2, "no AVX2 decode path for this build, dtype or shape");
#ifdef PDSERVE_HAVE_AVX2
  if (avx2 && isa != "portable") {
    const auto run = [&](auto rows) {
      using R = decltype(rows);
      using T = typename R::T;
      auto args = std::make_tuple(q.data_ptr<at::BFloat16>(), static_cast<const T*>(k_cache.data_ptr()),
                                  static_cast<const T*>(v_cache.data_ptr()), ks, vs, table.data_ptr<int64_t>(),
                                  context_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H, KVH, NB, BS,
                                  table.size(1), static_cast<float>(scale));
      with_shape(H / KVH, D, [&](auto d, auto g) { std::apply(decode_avx2<decltype(d)::value, decltype(g)::value, R>, args); });
    };
    avx2::with_rows2(k_cache.scalar_type(), run);
    return out;
  }
#endif
  if (q.scalar_type() == torch::kBFloat16) {
    decode_portable<at::BFloat16>(q, k_cache, v_cache, ks, vs, table, context_lens, out, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_decode supports bfloat16 and float32 queries");
    decode_portable<float>(q, k_cache, v_cache, ks, vs, table, context_lens, out, static_cast<float>(scale));
  }
  return out;
}

// Causal prefill attention for several sequences in one call, into `out` (rows of `q` outside the
// sequences are left alone). q, out [T, H, D] bf16, heads and head_dim contiguous (rows may be strided:
// q is a view into the fused QKV projection; the row stride even, as q is read in pairs of dims);
// caches [KVH, NB, BS, D] bf16, int8 or fp8 e4m3 (with their scales) with BS a multiple of 16; tables
// [P, max_blocks]; q_start, q_len, ctx [P] int64. isa: "auto" takes the AVX-512 BF16 kernel where this
// build has it, else the AVX2 + FMA one; "avx512" / "avx2" only that one (tests, benchmarks). Returns false
// (nothing done) when this build or these shapes have no such path: the caller then uses its own.
bool paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                   torch::Tensor q_start, torch::Tensor q_len, torch::Tensor ctx, double scale, torch::Tensor out,
                   std::optional<torch::Tensor> k_scale, std::optional<torch::Tensor> v_scale, const std::string& isa) {
  TORCH_CHECK(isa == "auto" || isa == "avx512" || isa == "avx2", "isa must be auto, avx512 or avx2, not ", isa);
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(0), BS = k_cache.size(2);
  const auto rows_ok = [&](const torch::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == D && t.stride(0) % 2 == 0; };
  const bool bf16 = q.scalar_type() == torch::kBFloat16 &&
                    (k_cache.scalar_type() == torch::kBFloat16 || is_quantized(k_cache));
  const bool avx512 = isa != "avx2" && prefill_fast_path(bf16, H, KVH, D, BS);
  const bool avx2 = !avx512 && isa != "avx512" && prefill_avx2_path(bf16, H, KVH, D, BS);
  if (!(avx512 || avx2) || out.scalar_type() != torch::kBFloat16 || !rows_ok(q) || !rows_ok(out) ||
      !k_cache.is_contiguous() || !v_cache.is_contiguous())
    return false;
  const auto [ks, vs] = cache_scales(k_cache, v_cache, k_scale, v_scale);
  tables = tables.to(torch::kInt64).contiguous();
  q_start = q_start.to(torch::kInt64).contiguous();
  q_len = q_len.to(torch::kInt64).contiguous();
  ctx = ctx.to(torch::kInt64).contiguous();
  const auto args = [&](auto rows) {
    using T = typename decltype(rows)::T;
    return std::make_tuple(q.data_ptr<at::BFloat16>(), static_cast<const T*>(k_cache.data_ptr()),
                           static_cast<const T*>(v_cache.data_ptr()), ks, vs, tables.data_ptr<int64_t>(), tables.size(1),
                           q_start.data_ptr<int64_t>(), q_len.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(),
                           tables.size(0), out.data_ptr<at::BFloat16>(), H, KVH, k_cache.size(1), BS,
                           static_cast<float>(scale), q.stride(0), out.stride(0));
  };
#ifdef PDSERVE_HAVE_AVX512BF16
  if (avx512) {
    with_rows(k_cache.scalar_type(), [&](auto rows) {
      using R = decltype(rows);
      with_shape(H / KVH, D, [&](auto d, auto g) { std::apply(prefill_avx512<decltype(d)::value, decltype(g)::value, R>, args(rows)); });
    });
    return true;
  }
#endif
#ifdef PDSERVE_HAVE_AVX2
  const auto run = [&](auto rows) {
    using R = decltype(rows);
    with_shape(H / KVH, D, [&](auto d, auto g) { std::apply(prefill_avx2<decltype(d)::value, decltype(g)::value, R>, args(rows)); });
  };
  avx2::with_rows2(k_cache.scalar_type(), run);
  return true;
#else
  return false;
#endif
}

// Whether paged_prefill_amx runs for these shapes: paged_prefill's fast shapes over a bf16 cache, on a build
// and CPU with AMX BF16 and a kernel that grants the tile state.
bool prefill_amx_fast_path(bool bf16, int64_t H, int64_t KVH, int64_t D, int64_t BS) {
#ifdef PDSERVE_HAVE_AMX
  return prefill_fast_path(bf16, H, KVH, D, BS) && amx_ready();
#else
  return false;
#endif
}

// paged_prefill on the AMX tile unit (prefill_amx), for a bf16 cache only; false (nothing done) where it has
// no path, as paged_prefill.
bool paged_prefill_amx(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                       torch::Tensor q_start, torch::Tensor q_len, torch::Tensor ctx, double scale, torch::Tensor out) {
#ifdef PDSERVE_HAVE_AMX
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(0), BS = k_cache.size(2);
  const auto rows_ok = [&](const torch::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == D && t.stride(0) % 2 == 0; };
  const bool bf16 = q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 &&
                    v_cache.scalar_type() == torch::kBFloat16;
  if (!prefill_amx_fast_path(bf16, H, KVH, D, BS) || out.scalar_type() != torch::kBFloat16 || !rows_ok(q) ||
      !rows_ok(out) || !k_cache.is_contiguous() || !v_cache.is_contiguous() || v_cache.sizes() != k_cache.sizes())
    return false;
  tables = tables.to(torch::kInt64).contiguous();
  q_start = q_start.to(torch::kInt64).contiguous();
  q_len = q_len.to(torch::kInt64).contiguous();
  ctx = ctx.to(torch::kInt64).contiguous();
  auto args = std::make_tuple(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                              tables.data_ptr<int64_t>(), tables.size(1), q_start.data_ptr<int64_t>(),
                              q_len.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(), tables.size(0),
                              out.data_ptr<at::BFloat16>(), H, KVH, k_cache.size(1), BS, static_cast<float>(scale),
                              q.stride(0), out.stride(0));
  with_shape(H / KVH, D, [&](auto d, auto g) { std::apply(prefill_amx<decltype(d)::value, decltype(g)::value>, args); });
  return true;
#else
  return false;
#endif
}

// Writes each token's new K and V rows into the caches: k, v [T, KVH, D] (rows may be strided: views
// into the fused QKV projection), caches [KVH, NB, BS, D] contiguous, slots [T] int64 (block * BS +
// offset). One copy per (token, head) row; the same as two index_copy_ calls, without their dispatch
// and per-call setup (~40 us each, 60 a step). An int8 or fp8 e4m3 cache quantizes each row on the way
// (kv/quant.py's rounding, bit for bit) and writes its parameters into k_scale / v_scale (cache_scales).
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
              std::optional<torch::Tensor> k_scale, std::optional<torch::Tensor> v_scale) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "bad shapes");
  TORCH_CHECK(k.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous CPU tensors");
  const auto [ks, vs] = cache_scales(k_cache, v_cache, k_scale, v_scale);
  const bool quantized = ks != nullptr;
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && (quantized || k.scalar_type() == k_cache.scalar_type()),
              "k, v and cache dtypes differ");
  TORCH_CHECK(!quantized || k.scalar_type() == torch::kBFloat16 || k.scalar_type() == torch::kFloat32,
              "a quantized cache takes bfloat16 or float32 rows");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), slots_per_head = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == KVH && k_cache.size(3) == D && k.stride(2) == 1 && v.stride(2) == 1, "head layout mismatch");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T, "one slot per token");
  slots = slots.to(torch::kInt64).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_per_head, "slot ", slot[t], " out of range");
  if (quantized) {
    const auto run = [&](auto in_elem, auto cache_elem) {
      using In = decltype(in_elem);
      using C = decltype(cache_elem);
      const In* kp = static_cast<const In*>(k.data_ptr());
      const In* vp = static_cast<const In*>(v.data_ptr());
      C* kc = static_cast<C*>(k_cache.data_ptr());
      C* vc = static_cast<C*>(v_cache.data_ptr());
      at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {  // a decode step's rows: inline, no fork
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t h = 0; h < KVH; ++h) {
            const int64_t row = h * slots_per_head + slot[t];
            quantize_into(kp + t * k.stride(0) + h * k.stride(1), D, kc + row * D, ks + row);
            quantize_into(vp + t * v.stride(0) + h * v.stride(1), D, vc + row * D, vs + row);
          }
      });
    };
    const bool in_bf16 = k.scalar_type() == torch::kBFloat16, to_int8 = k_cache.scalar_type() == torch::kChar;
    if (in_bf16 && to_int8) run(at::BFloat16{}, int8_t{});
    else if (in_bf16) run(at::BFloat16{}, at::Float8_e4m3fn{});
    else if (to_int8) run(float{}, int8_t{});
    else run(float{}, at::Float8_e4m3fn{});
    return;
  }
  const int64_t esize = k.element_size(), row = D * esize;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t dst = (h * slots_per_head + slot[t]) * row;
        std::memcpy(kc + dst, kp + (t * k.stride(0) + h * k.stride(1)) * esize, row);
        std::memcpy(vc + dst, vp + (t * v.stride(0) + h * v.stride(1)) * esize, row);
      }
  });
}

// int4's writes (kv.cache.write's for an int4 cache, in one call per layer): new K/V rows k, v [T, KVH, D]
// (the residual pool's dtype) into the residual rows of their blocks, which must be open: residual_k,
// residual_v [KVH, R, BS, D], residual_slot [NB] int32 (the block's slot, -1 once sealed), slots [T] (block
// * BS + offset). Each slot maps to its row of the pool (slot r's rows r * BS ...), which write_kv then
// fills as a bf16 cache's slots. A slot in a sealed block or out of range is an error and nothing is written.
void write_kv_int4(torch::Tensor k, torch::Tensor v, torch::Tensor residual_k, torch::Tensor residual_v,
                   torch::Tensor residual_slot, torch::Tensor slots) {
  TORCH_CHECK(residual_k.dim() == 4 && residual_slot.dim() == 1 && residual_slot.is_contiguous() &&
                  residual_slot.scalar_type() == torch::kInt,
              "residual pools [KVH, R, BS, D] and an int32 residual_slot [NB] expected");
  TORCH_CHECK(slots.dim() == 1, "one slot per token");
  const int64_t R = residual_k.size(1), BS = residual_k.size(2), NB = residual_slot.size(0), T = slots.size(0);
  slots = slots.to(torch::kInt64).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int32_t* res = residual_slot.data_ptr<int32_t>();
  auto rows = torch::empty({T}, slots.options());
  int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] / BS < NB, "slot ", slot[t], " out of range");
    const int32_t r = res[slot[t] / BS];
    TORCH_CHECK(r >= 0 && r < R, "slot ", slot[t], " lies in a sealed int4 block (no residual slot)");
    row[t] = r * BS + slot[t] % BS;
  }
  write_kv(k, v, residual_k, residual_v, rows, std::nullopt, std::nullopt);
}

// Decode attention over an int4 (KIVI) cache, one layer: q [B, H, D] bf16 or float32; k_cache, v_cache
// [KVH, NB, BS, D / 2] uint8; k_scale, k_zero [KVH, NB, D] and v_scale, v_zero [KVH, NB, BS] float16;
// residual_k, residual_v [KVH, R, BS, D] in q's dtype; residual_slot [NB] int32; table [B, max_blocks];
// context_lens [B]. isa "auto": the AVX-512 kernel where decode_int4_fast_path says so, else the AVX2 one
// where decode_int4_avx2_path does, else the portable loop; "avx2" / "portable" force one (tests, benchmarks).
torch::Tensor paged_decode_int4(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scale,
                                torch::Tensor k_zero, torch::Tensor v_scale, torch::Tensor v_zero,
                                torch::Tensor residual_k, torch::Tensor residual_v, torch::Tensor residual_slot,
                                torch::Tensor table, torch::Tensor context_lens, double scale, const std::string& isa) {
  TORCH_CHECK(isa == "auto" || isa == "avx2" || isa == "portable", "isa must be auto, avx2 or portable, not ", isa);
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_int4 runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && residual_k.dim() == 4,
              "bad shapes");
  TORCH_CHECK(k_cache.scalar_type() == torch::kByte && k_scale.scalar_type() == torch::kHalf &&
                  residual_slot.scalar_type() == torch::kInt && residual_k.scalar_type() == q.scalar_type(),
              "int4 cache: uint8 packed rows, float16 scales, int32 slots, residual in the query dtype");
  for (const auto& t : {k_cache, v_cache, k_scale, k_zero, v_scale, v_zero, residual_k, residual_v, residual_slot})
    TORCH_CHECK(t.is_contiguous(), "int4 cache tensors must be contiguous");
  q = q.contiguous();
  table = table.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2), R = residual_k.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) * 2 == D && residual_k.size(3) == D && residual_k.size(2) == BS,
              "head layout mismatch");
  auto out = torch::empty_like(q);
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  const auto args = [&] {  // the bf16 kernels' arguments
    return std::make_tuple(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(),
                           k_scale.data_ptr<at::Half>(), k_zero.data_ptr<at::Half>(), v_scale.data_ptr<at::Half>(),
                           v_zero.data_ptr<at::Half>(), residual_k.data_ptr<at::BFloat16>(),
                           residual_v.data_ptr<at::BFloat16>(), residual_slot.data_ptr<int32_t>(),
                           table.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(),
                           B, H, KVH, NB, BS, R, table.size(1), static_cast<float>(scale));
  };
  const bool avx2 = decode_int4_avx2_path(bf16, H, KVH, D, BS);
  TORCH_CHECK(isa != "avx2" || avx2, "no AVX2 int4 decode path for this build, dtype or shape");
#ifdef PDSERVE_HAVE_AVX512BF16
  if (isa == "auto" && decode_int4_fast_path(bf16, H, KVH, D, BS)) {
    with_shape(H / KVH, D, [&](auto d, auto g) { std::apply(decode_int4_avx512<decltype(d)::value, decltype(g)::value>, args()); });
    return out;
  }
#endif
#ifdef PDSERVE_HAVE_AVX2
  if (avx2 && isa != "portable") {
    with_shape(H / KVH, D, [&](auto d, auto g) { std::apply(decode_int4_avx2<decltype(d)::value, decltype(g)::value>, args()); });
    return out;
  }
#endif
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    const Int4Rows<T> rows{k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), k_scale.data_ptr<at::Half>(),
                           k_zero.data_ptr<at::Half>(), v_scale.data_ptr<at::Half>(), v_zero.data_ptr<at::Half>(),
                           residual_k.data_ptr<T>(), residual_v.data_ptr<T>(), residual_slot.data_ptr<int32_t>(),
                           NB, BS, R, D};
    decode_kernel<T>(q.data_ptr<T>(), rows, table.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                     out.data_ptr<T>(), B, H, D, KVH, BS, table.size(1), static_cast<float>(scale));
  };
  if (q.scalar_type() == torch::kBFloat16) {
    run(at::BFloat16{});
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_decode_int4 supports bfloat16 and float32 queries");
    run(float{});
  }
  return out;
}


// Causal prefill attention over an int4 (KIVI) cache, as paged_prefill (q, out bf16 [T, H, D], rows may be
// strided) with the cache tensors of paged_decode_int4 (residual pool bf16, blocks of a multiple of 16
// tokens). Each query reads the blocks before its own as sealed (open ones quantized on the fly, as
// kv/int4.py seals them) and its own block unquantized. isa: "auto" the AVX-512 BF16 kernel where this build
// has it, else the AVX2 + FMA one; "avx512" / "avx2" only that one. Returns false (nothing done) where this
// build or these shapes have no such path.
bool paged_prefill_int4(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scale,
                        torch::Tensor k_zero, torch::Tensor v_scale, torch::Tensor v_zero, torch::Tensor residual_k,
                        torch::Tensor residual_v, torch::Tensor residual_slot, torch::Tensor tables,
                        torch::Tensor q_start, torch::Tensor q_len, torch::Tensor ctx, double scale, torch::Tensor out,
                        const std::string& isa) {
  TORCH_CHECK(isa == "auto" || isa == "avx512" || isa == "avx2", "isa must be auto, avx512 or avx2, not ", isa);
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t R = residual_k.size(1);
  const auto rows_ok = [&](const torch::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == D && t.stride(0) % 2 == 0; };
  const bool bf16 = q.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16 &&
                    residual_k.scalar_type() == torch::kBFloat16;
  const bool avx512 = isa != "avx2" && decode_int4_fast_path(bf16, H, KVH, D, BS);
  const bool avx2 = !avx512 && isa != "avx512" && decode_int4_avx2_path(bf16, H, KVH, D, BS);
  if (!(avx512 || avx2) || !rows_ok(q) || !rows_ok(out)) return false;
  TORCH_CHECK(k_cache.scalar_type() == torch::kByte && k_scale.scalar_type() == torch::kHalf &&
                  residual_slot.scalar_type() == torch::kInt && residual_v.scalar_type() == torch::kBFloat16,
              "int4 cache: uint8 packed rows, float16 scales, int32 slots, residual in bf16");
  for (const auto& t : {k_cache, v_cache, k_scale, k_zero, v_scale, v_zero, residual_k, residual_v, residual_slot})
    TORCH_CHECK(t.is_contiguous(), "int4 cache tensors must be contiguous");
  TORCH_CHECK(k_cache.size(3) * 2 == D && residual_k.size(3) == D && residual_k.size(2) == BS, "head layout mismatch");
  tables = tables.to(torch::kInt64).contiguous();
  q_start = q_start.to(torch::kInt64).contiguous();
  q_len = q_len.to(torch::kInt64).contiguous();
  ctx = ctx.to(torch::kInt64).contiguous();
  const int64_t P = tables.size(0), max_blocks = tables.size(1);
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* cl = ctx.data_ptr<int64_t>();
  const int32_t* slot = residual_slot.data_ptr<int32_t>();
  // Open blocks some query reads as sealed (every block before a sequence's last query's own), once each.
  std::vector<int32_t> sealed_index(NB, -1);
  std::vector<int64_t> open_ids;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t kb = 0; kb < (cl[p] - 1) / BS; ++kb) {
      const int64_t blk = tab[p * max_blocks + kb];
      if (slot[blk] >= 0 && sealed_index[blk] < 0) {
        sealed_index[blk] = static_cast<int32_t>(open_ids.size());
        open_ids.push_back(blk);
      }
    }
  const int64_t n = static_cast<int64_t>(open_ids.size());
  auto sealed_k = torch::empty({KVH, std::max<int64_t>(n, 1), BS, D}, residual_k.options());
  auto sealed_v = torch::empty_like(sealed_k);
  const at::BFloat16* rk = residual_k.data_ptr<at::BFloat16>();
  const at::BFloat16* rv = residual_v.data_ptr<at::BFloat16>();
  at::BFloat16* sk = sealed_k.data_ptr<at::BFloat16>();
  at::BFloat16* sv = sealed_v.data_ptr<at::BFloat16>();
  at::parallel_for(0, KVH * n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / n, j = i % n, src = (h * R + slot[open_ids[j]]) * BS * D, dst = (h * n + j) * BS * D;
      seal_open_rows(rk + src, BS, D, true, sk + dst);
      seal_open_rows(rv + src, BS, D, false, sv + dst);
    }
  });
  const auto args = std::make_tuple(
      q.data_ptr<at::BFloat16>(), k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), k_scale.data_ptr<at::Half>(),
      k_zero.data_ptr<at::Half>(), v_scale.data_ptr<at::Half>(), v_zero.data_ptr<at::Half>(), rk, rv, slot,
      static_cast<const at::BFloat16*>(sk), static_cast<const at::BFloat16*>(sv),
      static_cast<const int32_t*>(sealed_index.data()), n, static_cast<const int64_t*>(tab), max_blocks,
      static_cast<const int64_t*>(q_start.data_ptr<int64_t>()), static_cast<const int64_t*>(q_len.data_ptr<int64_t>()), cl,
      P, out.data_ptr<at::BFloat16>(), H, KVH, NB, BS, R, static_cast<float>(scale), q.stride(0), out.stride(0));
#ifdef PDSERVE_HAVE_AVX512BF16
  if (avx512) {
    with_shape(H / KVH, D, [&](auto d, auto g) { std::apply(prefill_int4_avx512<decltype(d)::value, decltype(g)::value>, args); });
    return true;
  }
#endif
#ifdef PDSERVE_HAVE_AVX2
  with_shape(H / KVH, D, [&](auto d, auto g) { std::apply(prefill_int4_avx2<decltype(d)::value, decltype(g)::value>, args); });
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  const auto no_scale = [](const char* name) { return py::arg(name) = py::none(); };
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("table"), py::arg("context_lens"), py::arg("scale"), no_scale("k_scale"),
        no_scale("v_scale"), py::arg("isa") = "auto");
  m.def("paged_prefill", &paged_prefill, "paged causal prefill attention (CPU, bf16 queries)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("q_start"), py::arg("q_len"),
        py::arg("ctx"), py::arg("scale"), py::arg("out"), no_scale("k_scale"), no_scale("v_scale"),
        py::arg("isa") = "auto");
  m.def("write_kv", &write_kv, "new K/V rows into the paged caches by slot (quantized on the way for int8/fp8)",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), no_scale("k_scale"),
        no_scale("v_scale"));
  m.def("write_kv_int4", &write_kv_int4, "new K/V rows into an int4 cache's residual pool (their blocks open)",
        py::arg("k"), py::arg("v"), py::arg("residual_k"), py::arg("residual_v"), py::arg("residual_slot"),
        py::arg("slots"));
  m.def("paged_decode_int4", &paged_decode_int4, "paged decode attention over an int4 (KIVI) cache (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("k_zero"), py::arg("v_scale"),
        py::arg("v_zero"), py::arg("residual_k"), py::arg("residual_v"), py::arg("residual_slot"), py::arg("table"),
        py::arg("context_lens"), py::arg("scale"), py::arg("isa") = "auto");
  m.def("paged_prefill_int4", &paged_prefill_int4, "paged causal prefill attention over an int4 (KIVI) cache (CPU, bf16)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("k_zero"), py::arg("v_scale"),
        py::arg("v_zero"), py::arg("residual_k"), py::arg("residual_v"), py::arg("residual_slot"), py::arg("tables"),
        py::arg("q_start"), py::arg("q_len"), py::arg("ctx"), py::arg("scale"), py::arg("out"), py::arg("isa") = "auto");
  m.def("decode_fast_path", &decode_fast_path, "whether paged_decode has an AVX-512 BF16 path for (bf16, H, KVH, D)");
  m.def("decode_avx2_path", &decode_avx2_path, "whether paged_decode has an AVX2 + FMA path for (H, KVH, D), bf16");
  m.def("decode_int4_fast_path", &decode_int4_fast_path,
        "whether paged_decode_int4 has an AVX-512 BF16 path for (bf16, H, KVH, D, BS)");
  m.def("decode_int4_avx2_path", &decode_int4_avx2_path,
        "whether paged_decode_int4 has an AVX2 + FMA path for (bf16, H, KVH, D, BS)");
  m.def("prefill_fast_path", &prefill_fast_path, "whether paged_prefill has an AVX-512 BF16 path for (bf16, H, KVH, D, BS)");
  m.def("prefill_avx2_path", &prefill_avx2_path, "whether paged_prefill has an AVX2 + FMA path for (bf16, H, KVH, D, BS)");
  m.def("paged_prefill_amx", &paged_prefill_amx, "paged causal prefill attention on AMX BF16 tiles (CPU, bf16 cache)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("q_start"), py::arg("q_len"),
        py::arg("ctx"), py::arg("scale"), py::arg("out"));
  m.def("decode_amx_fast_path", &decode_amx_fast_path,
        "whether paged_decode(isa=\"amx\") runs for (bf16 queries and cache, H, KVH, D, block size) here");
  m.def("prefill_amx_fast_path", &prefill_amx_fast_path,
        "whether paged_prefill_amx runs for (bf16, H, KVH, D, BS) on this build and CPU");
}

"""CPU backend: decode attention by a small C++ kernel that reads K/V in place through the block table.

The kernel (`csrc/paged_decode.cpp`) walks each request's real context block by block, once over K for
the scores and once over V for the output, split over (request, kv head) pairs on ATen's thread pool.
It reads each KV row once and never pads, so decodes of any context lengths go in one call (measured on
one AVX-512 core, 150 decodes averaging 300 context tokens: 47 ms gather + bmm, 19 ms inductor, 9.6 ms
here). It is built on first use with the machine's compiler (about 20-40 s, then cached by torch in
~/.cache/torch_extensions).

Both kernels have an AVX-512 BF16 fast path for bf16 with head_dim 64 or 128 and 1-8 query heads per kv
head (SmolLM2: 64 / 3; Qwen2.5-0.5B: 64 / 7; Qwen2.5-1.5B: 128 / 6); `warmup` logs which path the model's
shape takes, with a WARNING naming why when it is not the fast one. On CPUs without AVX-512 (AMD EPYC
Zen 3 among this machine kind's hosts) decode takes an AVX2 + FMA kernel for the same shapes and cache
dtypes (rows split into even and odd dims as float, 8 rows' scores at a time): on such a host, 2
threads, 128-token blocks from DRAM, 15-18 GB/s where the portable loop read 5-6
(`benchmarks/attention_kernels.py --kv-dtypes bf16 --paths auto,avx2,portable,torch`). Prefill (blocks of a multiple of 16
tokens) goes through the same file's flash-style kernel: every prompt chunk of the step in one call, its context read in place through the block table,
tiles of 16 query rows (one per vector lane) x 16 keys with AVX-512 BF16 dot products for q.k and p.v
and a lane-wise online softmax (measured here, one 9-head prompt: 5.5-6.4x torch's CPU SDPA at
128-1,000 tokens, 3.2-3.9x the previous key-per-lane version). Without AVX-512 the prefill runs its AVX2
+ FMA variant (`prefill_avx2`: 8 query rows per tile, K and V widened to float in L1, everything in
float32; on an EPYC 1.4-1.9x the faster SDPA up to 256 tokens, about even from 1,024 on:
`benchmarks/prefill_kernels.py`). Other shapes and dtypes use the reference SDPA path.

A quantized cache (`--kv-cache-dtype int8 | fp8_e4m3`, kv/quant.py: 4 bytes of parameters per token and
kv head, fp8's float32 scale or int8's float16 scale and zero) goes through the same kernels, which read
the one-byte values in place and dequantize in registers (int8 and e4m3 are exact in bf16, so the dot
products stay BF16 ones, except decode's int8 q.k: AVX512-VNNI integer dot products against the query
rounded to int16; the K scale multiplies each score, the V scale is folded into the probabilities, and
int8's zero adds its row's offset times the query's sum to each score and sum_t p_t m_t to each output):
a decode step reads D + 4 bytes per row instead of 2D (0.53x at head_dim 64). `write_kv` quantizes the
new rows on the way, bit for bit as kv/quant.py does.
The prefill kernel reads every token of a chunk back from the cache, so a fresh prompt attends to its own
quantized K/V as later decodes will; where it has no fast path the reference's prefill runs (which must
then dequantize the cache itself).

Both softmaxes flush weights below ~1e-30 of the largest to zero (`kSoftmaxFlush` in the C++): a peaked
head over a long context otherwise makes most weights float denormals, and every multiply touching one
takes a microcode assist (reported ~3x on a decode step, bf16 included; to be re-measured on a quiet
host). The flush is in the kernel rather than FTZ/DAZ in MXCSR, which is per thread (to be set and
restored on every pool thread per call) and would change torch's own float math on those threads.

An int4 cache (KIVI, kv/int4.py) decodes through `paged_decode_int4` and prefills through
`paged_prefill_int4`: AVX-512 BF16 kernels, else AVX2 + FMA ones, for the fast shapes (blocks of a
multiple of 16) that read sealed blocks' packed nibbles in place (key channel scales folded into the
query once per block, value scales into the probabilities) and open blocks from the residual pool;
elsewhere a portable decode loop and the reference's prefill. Writes are the torch reference's (they
only fill the unquantized residual pool). Not timed by `autotune` (one candidate per phase).

Where the CPU has AMX (and Linux grants the tile state), prefill has a third candidate, `paged_prefill_amx`:
the same flash loop with both products on the tile unit (scores as K Q^T, output as V^T P^T, so the
lane-wise softmax stays as it is), for a bf16 cache; measured on a Xeon with AMX, 2 threads, 3-5x the
AVX-512 kernel and 1.4-2x torch's SDPA at 256-2,048 tokens (`benchmarks/prefill_kernels.py`). Decode has
a second C++ candidate there too, `paged_decode(isa="amx")`: the AVX-512 kernel with both products on the
tile unit: q.k (16 K rows from the cache as the A tile, the item's query heads as B, C transposed in
registers), which drops the 16-row horizontal sums that cost most at 6-7 query heads per kv head (Qwen2.5),
and p.v (the heads' probabilities in bf16 as A, pairs of V rows interleaved by two unpacks as B), which
drops the 2G FMAs per row and 32 dims; softmax and the prefetching are the AVX-512 kernel's
(`benchmarks/attention_kernels.py --paths auto,amx`).

Under `--attention-backend auto` the engine calls `autotune`, which times each phase's C++ kernels
against the reference's (decode: gather + bmm; prefill: SDPA) on the model's shapes and sets an
`AttentionPlan` that `decode` and `prefill` consult per step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.attention.base import AttentionMetadata, DecodeGroup, PrefillSeq
from pdserve.attention.torch_ref import TorchAttention
from pdserve.kv.cache import LayerCache
from pdserve.kv.quant import quantize
from pdserve.model import autotune

logger = logging.getLogger(__name__)

# Cache dtypes the fast C++ kernels read (with bf16 queries), and how the log names them.
_FAST_CACHE_DTYPES = {torch.bfloat16: "", torch.int8: ", int8 KV", torch.float8_e4m3fn: ", fp8 e4m3 KV"}

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")


def load_kernel():  # type: ignore[no-untyped-def]
    """Build (or load the cached build of) the extension; raises if no compiler can build it."""
    from pdserve.extensions import load_extension

    return load_extension(
        "pdserve_paged_decode",
        [_SOURCE],
        # -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers; without it the kernel ran on
        # one core. The extension then resolves libgomp.so.1 to the copy torch has already loaded.
        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


# What `--attention-backend auto` times at first start (`CpuPagedAttention.autotune`): decode steps of
# DECODE_BATCHES requests of DECODE_CONTEXT tokens each, and fresh prompts of PREFILL_LENS tokens.
DECODE_BATCHES: tuple[int, ...] = (1, 8, 32)
DECODE_CONTEXT = 512
PREFILL_LENS: tuple[int, ...] = (16, 64, 256, 1024, 2048)
# the C++ paged decode / with q.k and p.v on AMX tiles (a bf16 cache where the CPU has AMX); the reference's gather + bmm
DECODE_KERNELS = ("cpp", "amx", "torch")
# the C++ flash prefill (AVX-512 BF16, else AVX2 + FMA) / on AMX tiles; torch SDPA in the model's dtype / on
# inputs widened to float32 (a 16-bit model on a CPU without AVX-512 BF16: bf16 SDPA took 1.06-1.34x its time
# on an EPYC)
PREFILL_KERNELS = ("cpp", "amx", "sdpa", "sdpa-f32")
_SDPA = {"sdpa": None, "sdpa-f32": torch.float32}  # the reference's prefill and its compute dtype


@dataclass(slots=True)
class AttentionPlan:
    """Which kernel each phase uses: one for every decode (the choice decides whether the runner groups
    decodes by context length, so it cannot change per step), and per prefill bucket (`prefill_lens`, as
    autotune's row buckets: a bucket covers the lengths above the previous one) by a step's longest chunk,
    since the C++ kernel takes every chunk of a step in one call."""

    decode: str = "cpp"
    prefill_lens: tuple[int, ...] = (PREFILL_LENS[-1],)
    prefill: tuple[str, ...] = ("cpp",)

    def prefill_kernel(self, longest_chunk: int) -> str:
        return self.prefill[autotune.bucket_index(longest_chunk, self.prefill_lens)]

    @classmethod
    def from_tables(cls, decode: autotune.TuneTable, prefill: autotune.TuneTable) -> AttentionPlan:
        """Decode: the kernel with the least time summed over the timed batches; prefill: the fastest per
        length bucket (ties to the C++ kernel, first in each table's order)."""
        return cls(
            decode=autotune.pick_one(decode, decode.order, decode_rows=max(decode.buckets)),
            prefill_lens=prefill.buckets,
            prefill=tuple(prefill.winners("prefill")),
        )


# Up to this many query rows of one sequence (a verification's drafts and the token before them) run
# as decode rows, each over its own prefix, rather than through the prefill kernel: the decode kernel
# reads the sequence's K/V once per row, from L2 after the first, and the prefill kernel's 16-row tiles
# over the whole context cost more than that for a few rows (`benchmarks/attention_kernels.py --paths
# amx,verify2,rows2,verify3,rows3,verify4,rows4`; host H, session 39: 2.0-2.2x faster at 2 rows and
# 1.5x or more at 3; at 4-5 rows faster at 512 tokens but slower at 16 x 2k in one run of two, where a
# sequence's K/V no longer stays in L2 between its rows).
VERIFY_AS_DECODE_ROWS = 3


class CpuPagedAttention(TorchAttention):
    """The C++ kernels, consulting an `AttentionPlan` (set by `autotune`) per phase: one step may run the
    C++ decode and torch's SDPA for its prompt chunks. Without a plan, the C++ kernels wherever they run."""

    name = "cpu-paged"
    pads_decodes = False  # the kernel reads only real context: one call for all decodes

    def __init__(self, plan: AttentionPlan | None = None) -> None:
        self._kernel = load_kernel()
        self.plan = plan or AttentionPlan()

    @property
    def plan(self) -> AttentionPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: AttentionPlan) -> None:
        if plan.decode not in DECODE_KERNELS or any(k not in PREFILL_KERNELS for k in plan.prefill):
            raise ValueError(f"unknown attention kernel in {plan}")
        self._plan = plan
        # The reference's decode pads each group to its longest context: let the runner bound the padding.
        self.pads_decodes = plan.decode == "torch"
        self.max_decode_rows = 1 if plan.decode == "torch" else VERIFY_AS_DECODE_ROWS

    def supports_kv_dtype(self, kv_dtype: str) -> bool:
        """The kernels read bf16 and float32 caches, and int8 / fp8 e4m3 ones in place (the storage dtype's
        name as the engine resolves it), and int4 (decode and prefill in C++, writes the reference's); not
        float16 (no fp16 queries), where the engine uses the reference."""
        return kv_dtype in ("bfloat16", "float32", "int8", "fp8_e4m3", "int4")

    def has_cpp_prefill(self, bf16: bool, num_heads: int, kvh: int, head_dim: int, block_size: int) -> bool:
        """Whether `paged_prefill` runs for these shapes (bf16 queries and a bf16, int8 or fp8 cache: `bf16`)
        on this build: its AVX-512 BF16 kernel, or its AVX2 + FMA one."""
        k = self._kernel
        return bool(k.prefill_fast_path(bf16, num_heads, kvh, head_dim, block_size)
                    or k.prefill_avx2_path(bf16, num_heads, kvh, head_dim, block_size))

    def kernel_paths(self, cache: LayerCache, num_heads: int) -> tuple[str, str, str | None]:
        """(decode path, prefill path, why either is not the fast one or None) for a model's cache (the
        fast paths of a quantized cache assume bf16 queries, as a model with such a cache runs)."""
        if cache.is_int4:
            return self._int4_kernel_paths(cache, num_heads)
        k_cache = cache.k
        kvh, _, block_size, head_dim = k_cache.shape
        label = _FAST_CACHE_DTYPES.get(k_cache.dtype)
        fast = label is not None
        fast_decode = bool(self._kernel.decode_fast_path(fast, num_heads, kvh, head_dim))
        fast_prefill = bool(self._kernel.prefill_fast_path(fast, num_heads, kvh, head_dim, block_size))
        shape = f"head_dim {head_dim}, {num_heads // kvh} query heads per kv head"
        label = label or ""
        avx2_decode = fast and bool(self._kernel.decode_avx2_path(num_heads, kvh, head_dim))
        if fast_decode:
            decode = f"C++ AVX-512 BF16{label} ({shape})"
            if self._kernel.decode_amx_fast_path(k_cache.dtype == torch.bfloat16, num_heads, kvh, head_dim, block_size):
                decode += " or with q.k and p.v on AMX BF16 tiles"
        elif avx2_decode:
            decode = f"C++ AVX2 + FMA{label} ({shape})"
        else:
            decode = f"C++ portable loop{label}"
        avx2_prefill = bool(self._kernel.prefill_avx2_path(fast, num_heads, kvh, head_dim, block_size))
        if fast_prefill:
            prefill = f"C++ AVX-512 BF16 flash{label} ({shape})"
        elif avx2_prefill:
            prefill = f"C++ AVX2 + FMA flash{label} ({shape})"
        else:
            prefill = "torch SDPA"
        if self._kernel.prefill_amx_fast_path(k_cache.dtype == torch.bfloat16, num_heads, kvh, head_dim, block_size):
            prefill += " or on AMX BF16 tiles"
        why = None
        if not ((fast_decode or avx2_decode) and (fast_prefill or avx2_prefill)):
            k = self._kernel
            if not (k.decode_fast_path(True, 9, 3, 64) or k.decode_avx2_path(9, 3, 64)):
                why = "this CPU or compiler has neither AVX-512 BF16 nor AVX2 + FMA"
            elif not fast:
                why = f"the cache is {k_cache.dtype}, the fast kernels read bf16, int8 and fp8 e4m3"
            elif not (k.decode_fast_path(True, num_heads, kvh, head_dim) or k.decode_avx2_path(num_heads, kvh, head_dim)):
                why = f"{shape} is outside the fast kernels' head_dim 64/128 and 1-8 heads per kv head"
            else:
                why = f"block size {block_size} is not a multiple of 16"
        return decode, prefill, why

    def _int4_kernel_paths(self, cache: LayerCache, num_heads: int) -> tuple[str, str, str | None]:
        kvh, _, block_size, head_dim = cache.residual_k.shape  # type: ignore[union-attr]
        bf16 = cache.residual_k.dtype == torch.bfloat16  # type: ignore[union-attr]
        shape = f"head_dim {head_dim}, {num_heads // kvh} query heads per kv head"
        k = self._kernel
        fast = bool(k.decode_int4_fast_path(bf16, num_heads, kvh, head_dim, block_size))
        avx2 = bool(k.decode_int4_avx2_path(bf16, num_heads, kvh, head_dim, block_size))
        isa = "AVX-512 BF16" if fast else "AVX2 + FMA" if avx2 else None
        decode = f"C++ {isa}, int4 KV ({shape})" if isa else "C++ portable loop, int4 KV"
        prefill = f"C++ {isa} flash, int4 KV ({shape})" if isa else "torch reference (int4)"
        why = None
        if not (fast or avx2):
            if not (k.decode_int4_fast_path(True, 9, 3, 64, 16) or k.decode_int4_avx2_path(True, 9, 3, 64, 16)):
                why = "this CPU or compiler has neither AVX-512 BF16 nor AVX2 + FMA"
            elif not bf16:
                why = f"the residual pool is {cache.residual_k.dtype}, the fast int4 decode reads bf16"  # type: ignore[union-attr]
            elif not (k.decode_fast_path(True, num_heads, kvh, head_dim) or k.decode_avx2_path(num_heads, kvh, head_dim)):
                why = f"{shape} is outside the fast kernels' head_dim 64/128 and 1-8 heads per kv head"
            else:
                why = f"block size {block_size} is not a multiple of 16"
        return decode, prefill, why

    def warmup(self, cache: LayerCache, num_heads: int) -> None:
        decode, prefill, why = self.kernel_paths(cache, num_heads)
        if why is None:
            logger.info("attention cpu-paged: decode %s, prefill %s", decode, prefill)
        else:
            logger.warning("attention cpu-paged: decode %s, prefill %s: slow path because %s", decode, prefill, why)

    def decode(self, q: torch.Tensor, cache: LayerCache, g: DecodeGroup, scale: float) -> torch.Tensor:
        if self._plan.decode == "torch":
            return TorchAttention.decode(self, q, cache, g, scale)
        if cache.is_int4:
            return self._kernel.paged_decode_int4(
                q, cache.k, cache.v, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero,
                cache.residual_k, cache.residual_v, cache.residual_slot, g.block_table, g.context_lens, scale,
            )
        # AMX where the plan measured it fastest, which it times on this model's cache (declined unless bf16)
        amx = self._plan.decode == "amx" and q.dtype == cache.k.dtype == torch.bfloat16
        return self._decode_cpp(q, cache, g, scale, "amx" if amx else "auto")

    def _decode_cpp(self, q: torch.Tensor, cache: LayerCache, g: DecodeGroup, scale: float,
                    isa: str = "auto") -> torch.Tensor:
        return self._kernel.paged_decode(
            q, cache.k, cache.v, g.block_table, g.context_lens, scale, cache.k_scale, cache.v_scale, isa=isa
        )

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor) -> None:
        if cache.is_int4:  # into the open blocks' residual rows (the reference's torch ops: ~40 us a layer)
            rk, rv, open_slot = cache.residual_k, cache.residual_v, cache.residual_slot
            assert rk is not None and rv is not None and open_slot is not None
            if k.dtype == rk.dtype:
                self._kernel.write_kv_int4(k, v, rk, rv, open_slot, slots)
            else:
                TorchAttention.write_kv(self, k, v, cache, slots)
            return
        self._kernel.write_kv(k, v, cache.k, cache.v, slots, cache.k_scale, cache.v_scale)

    def prefill(self, q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        m = meta
        if m.prefill_block_table is not None and m.prefill_context_lens is not None:
            assert m.prefill_query_starts is not None and m.prefill_query_lens is not None
            longest = max(p.query_len for p in m.prefills)
            args = (m.prefill_block_table, m.prefill_query_starts, m.prefill_query_lens, m.prefill_context_lens, scale, out)
            kernel = self._plan.prefill_kernel(longest)
            # AMX declines a quantized cache (the plan never picks it there: timed as declined); then the
            # AVX-512 kernel, as the plan's second choice would be.
            if kernel == "amx" and not cache.is_int4 and self._kernel.paged_prefill_amx(q, cache.k, cache.v, *args):
                return
            if kernel in _SDPA:
                super().prefill(q, k, v, cache, meta, scale, out, _SDPA[kernel])
                return
            if (
                self._kernel.paged_prefill_int4(
                    q, cache.k, cache.v, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero,
                    cache.residual_k, cache.residual_v, cache.residual_slot, *args,
                )
                if cache.is_int4
                else self._kernel.paged_prefill(q, cache.k, cache.v, *args, cache.k_scale, cache.v_scale)
            ):
                return
        super().prefill(q, k, v, cache, meta, scale, out)

    # --- choice by measurement (`--attention-backend auto`) ---------------------------------------------

    def autotune(
        self,
        cache: LayerCache,
        num_heads: int,
        dtype: torch.dtype,
        *,
        batch_invariant: bool = False,
        cache_dir: str | None = None,
        timer: autotune.Timer = time.perf_counter,
    ) -> None:
        """Time each phase's kernels on this model's shapes and cache dtype (`measure_attention`), or read
        the tables cached in `cache_dir` for the same host, torch, threads, shapes and kernel source, then
        set the plan and log the tables. `batch_invariant` keeps the C++ kernel for both phases without
        measuring: it computes each request (decode) and each chunk (prefill, tiles of its own rows) alone,
        so a sequence's result does not depend on what else is in the step, while the reference's decode
        pads to the group's longest context and a per-length prefill choice would switch kernels with the
        step's longest chunk."""
        if batch_invariant or cache.is_int4:
            self.plan = AttentionPlan()
            logger.info("attention cpu-paged: C++ decode and prefill at every size (%s)",
                        "int4: not timed" if cache.is_int4 else "batch-invariant")
            return
        key = self._tune_key(cache, num_heads, dtype)
        paths = {k: autotune.cache_path(cache_dir, f"attention-{k}", key) if cache_dir else None for k in ("decode", "prefill")}
        tables = {k: autotune.load_cached(p, key) if p else None for k, p in paths.items()}
        hit = all(t is not None for t in tables.values())
        if not hit:
            t0 = time.perf_counter()
            tables = dict(zip(("decode", "prefill"), measure_attention(self, cache, num_heads, dtype, timer=timer)))
            noise = max(t.noise for t in tables.values())  # type: ignore[union-attr]
            logger.info("attention kernels measured in %.1f s", time.perf_counter() - t0)
            if noise > autotune.NOISY:
                logger.warning("the machine looked busy while timing the attention kernels (median %.1fx the "
                               "best); using the choice for this run only, not caching it", noise)
            else:
                for k, p in paths.items():
                    if p:
                        autotune.save_cached(p, key, tables[k])  # type: ignore[arg-type]
        decode, prefill = tables["decode"], tables["prefill"]
        assert decode is not None and prefill is not None
        self.plan = AttentionPlan.from_tables(decode, prefill)
        src = f"cached {paths['decode']}" if hit else "measured"
        logger.info(
            "attention kernels (%s): decode %s; ms per layer call, decode of %d-token contexts by batch:\n%s\n"
            "prefill of a fresh prompt by length:\n%s",
            src, self.plan.decode, DECODE_CONTEXT, autotune.format_table(decode, "batch"),
            autotune.format_table(prefill, "len"),
        )

    def _tune_key(self, cache: LayerCache, num_heads: int, dtype: torch.dtype) -> dict:
        """What the attention tables depend on: host, torch, threads, the model's attention shape, the
        query and cache dtypes, the timed sizes and the kernel's source."""
        cpu, flags = autotune.cpu_info()
        with open(_SOURCE, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        kvh, _, block_size, head_dim = cache.k.shape
        return {
            "cpu": cpu, "flags": list(flags), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "heads": [num_heads, kvh, head_dim], "block_size": block_size, "dtype": str(dtype),
            "kv_dtype": cache.kv_dtype, "decode": [list(DECODE_BATCHES), DECODE_CONTEXT],
            "prefill": list(PREFILL_LENS), "candidates": [list(DECODE_KERNELS), list(PREFILL_KERNELS)],
            "pdserve_kernel": digest,
        }


def scratch_cache(like: LayerCache, num_blocks: int, seed: int = 0) -> LayerCache:
    """A cache of random rows shaped and stored as `like` (quantized as kv/quant.py does), for timing:
    the real cache may hold anything before the first request (NaN scales included)."""
    kvh, _, bs, d = like.k.shape
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kvh, num_blocks, bs, d, generator=g)
    v = torch.randn(kvh, num_blocks, bs, d, generator=g)
    if like.quantized:
        (kq, ks), (vq, vs) = quantize(k, like.kv_dtype), quantize(v, like.kv_dtype)
        return LayerCache(kq, vq, ks, vs)
    return LayerCache(k.to(like.k.dtype), v.to(like.k.dtype))


@torch.inference_mode()
def measure_attention(
    attn: CpuPagedAttention,
    like: LayerCache,
    num_heads: int,
    dtype: torch.dtype,
    *,
    decode_batches: Sequence[int] = DECODE_BATCHES,
    context: int = DECODE_CONTEXT,
    prefill_lens: Sequence[int] = PREFILL_LENS,
    repeats: int = 3,
    timer: autotune.Timer = time.perf_counter,
) -> tuple[autotune.TuneTable, autotune.TuneTable]:
    """(decode table, prefill table) of seconds per layer call, through `autotune.tune`: decode of
    `decode_batches` requests with `context` tokens each in distinct blocks (as cold as a real step's),
    prefill of one fresh prompt per length (the reference's SDPA reads its fresh K/V, or the cache read
    back where it is quantized). The C++ prefill where it declines the shape counts as inf."""
    kvh, _, bs, d = like.k.shape
    nb_seq = -(-context // bs)
    num_blocks = max(max(decode_batches) * nb_seq, -(-max(prefill_lens) // bs))
    cache = scratch_cache(like, num_blocks)
    scale = d**-0.5
    gen = torch.Generator().manual_seed(1)

    def decode_pass(kernel: str):  # type: ignore[no-untyped-def]
        def pass_for(batch: int) -> autotune.Pass:
            q = torch.randn(batch, num_heads, d, generator=gen).to(dtype)
            table = torch.arange(batch * nb_seq).view(batch, nb_seq)
            lens = torch.full((batch,), context)
            mask = (torch.arange(nb_seq * bs) < context).expand(batch, nb_seq * bs).reshape(batch, 1, 1, -1)
            g = DecodeGroup(0, batch, table, lens, mask)
            if kernel == "torch":
                return [("decode", lambda: TorchAttention.decode(attn, q, cache, g, scale))]
            if kernel == "amx" and not attn._kernel.decode_amx_fast_path(
                dtype == cache.k.dtype == torch.bfloat16, num_heads, kvh, d, bs
            ):
                return []  # no AMX here, or not a bf16 cache: timed as declined
            isa = "amx" if kernel == "amx" else "auto"
            return [("decode", lambda: attn._decode_cpp(q, cache, g, scale, isa))]

        return pass_for

    def prefill_pass(kernel: str):  # type: ignore[no-untyped-def]
        def pass_for(n: int) -> autotune.Pass:
            q = torch.randn(n, num_heads, d, generator=gen).to(dtype)
            k = torch.randn(n, kvh, d, generator=gen).to(dtype)
            v = torch.randn(n, kvh, d, generator=gen).to(dtype)
            table = torch.arange(-(-n // bs))[None, :]
            meta = AttentionMetadata(
                torch.arange(n), 0, [], [PrefillSeq(0, n, n, None, None)], table, torch.tensor([n]),
                torch.tensor([0]), torch.tensor([n]),
            )
            out = torch.empty_like(q)
            if kernel in _SDPA:
                if kernel == "sdpa-f32" and dtype == torch.float32:
                    return []  # the same as "sdpa": timed as declined, never chosen
                return [("prefill", lambda: TorchAttention.prefill(attn, q, k, v, cache, meta, scale, out, _SDPA[kernel]))]
            fast_dtypes = dtype == torch.bfloat16 and cache.k.dtype in _FAST_CACHE_DTYPES
            if kernel == "amx":
                if not attn._kernel.prefill_amx_fast_path(fast_dtypes and cache.k.dtype == torch.bfloat16, num_heads, kvh, d, bs):
                    return []  # no AMX here, or a quantized cache
                return [("prefill", lambda: attn._kernel.paged_prefill_amx(
                    q, cache.k, cache.v, table, meta.prefill_query_starts, meta.prefill_query_lens,
                    meta.prefill_context_lens, scale, out))]
            if not attn.has_cpp_prefill(fast_dtypes, num_heads, kvh, d, bs):
                return []  # declined: the reference would run
            return [("prefill", lambda: attn._kernel.paged_prefill(
                q, cache.k, cache.v, table, meta.prefill_query_starts, meta.prefill_query_lens,
                meta.prefill_context_lens, scale, out, cache.k_scale, cache.v_scale))]

        return pass_for

    decode = autotune.tune(DECODE_KERNELS, decode_pass, ["decode"], decode_batches, repeats=repeats, timer=timer,
                           give_up=float("inf"))
    prefill = autotune.tune(PREFILL_KERNELS, prefill_pass, ["prefill"], prefill_lens, repeats=repeats, timer=timer,
                            give_up=float("inf"))
    return decode, prefill

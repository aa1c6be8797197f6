"""CPU backend: decode attention by a small C++ kernel that reads K/V in place through the block table.

The kernel (`csrc/paged_decode.cpp`) walks each request's real context block by block, once over K for
the scores and once over V for the output, split over (request, kv head) pairs on ATen's thread pool.
It reads each KV row once and never pads, so decodes of any context lengths go in one call (measured on
one AVX-512 core, 150 decodes averaging 300 context tokens: 47 ms gather + bmm, 19 ms inductor, 9.6 ms
here). It is built on first use with the machine's compiler (about 20-40 s, then cached by torch in
~/.cache/torch_extensions).

Both kernels have an AVX-512 BF16 fast path for bf16 with head_dim 64 or 128 and 1-8 query heads per kv
head (SmolLM2: 64 / 3; Qwen2.5-0.5B: 64 / 7; Qwen2.5-1.5B: 128 / 6); `warmup` logs which path the model's
shape takes, with a WARNING naming why when it is not the fast one. Prefill (blocks of a multiple of 16
tokens) goes through the same file's flash-style kernel: every prompt chunk of the step in one call, its context read in place through the block table,
tiles of 16 query rows (one per vector lane) x 16 keys with AVX-512 BF16 dot products for q.k and p.v
and a lane-wise online softmax (measured here, one 9-head prompt: 5.5-6.4x torch's CPU SDPA at
128-1,000 tokens, 3.2-3.9x the previous key-per-lane version). Other shapes and dtypes use the
reference SDPA path.

A quantized cache (`--kv-cache-dtype int8 | fp8_e4m3`, kv/quant.py: one float32 scale per token and kv
head) goes through the same kernels, which read the one-byte values in place and dequantize in
registers (int8 and e4m3 are exact in bf16, so the dot products stay BF16 ones, except decode's int8 q.k:
AVX512-VNNI integer dot products against the query rounded to int16; the K scale multiplies each score,
the V scale is folded into the probabilities): a decode step reads D + 4 bytes per row instead of 2D
(0.53x at head_dim 64). `write_kv` quantizes the new rows on the way, bit for bit as kv/quant.py does.
The prefill kernel reads every token of a chunk back from the cache, so a fresh prompt attends to its own
quantized K/V as later decodes will; where it has no fast path the reference's prefill runs (which must
then dequantize the cache itself).

Both softmaxes flush weights below ~1e-30 of the largest to zero (`kSoftmaxFlush` in the C++): a peaked
head over a long context otherwise makes most weights float denormals, and every multiply touching one
takes a microcode assist (a decode step ~2-3x slower, bf16 included). The flush is in the kernel rather
than FTZ/DAZ in MXCSR, which is per thread (to be set and restored on every pool thread per call) and
would change torch's own float math on those threads.
"""

from __future__ import annotations

import logging
import os

import torch

from pdserve.attention.base import AttentionMetadata, DecodeGroup
from pdserve.attention.torch_ref import TorchAttention
from pdserve.kv.cache import LayerCache

logger = logging.getLogger(__name__)

# Cache dtypes the fast C++ kernels read (with bf16 queries), and how the log names them.
_FAST_CACHE_DTYPES = {torch.bfloat16: "", torch.int8: ", int8 KV", torch.float8_e4m3fn: ", fp8 e4m3 KV"}

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")


def load_kernel():  # type: ignore[no-untyped-def]
    """Build (or load the cached build of) the extension; raises if no compiler can build it."""
    from torch.utils.cpp_extension import load

    return load(
        name="pdserve_paged_decode",
        sources=[_SOURCE],
        # -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers; without it the kernel ran on
        # one core. The extension then resolves libgomp.so.1 to the copy torch has already loaded.
        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


class CpuPagedAttention(TorchAttention):
    name = "cpu-paged"
    pads_decodes = False  # the kernel reads only real context: one call for all decodes

    def __init__(self) -> None:
        self._kernel = load_kernel()

    def supports_kv_dtype(self, kv_dtype: str) -> bool:
        """The kernels read bf16 and float32 caches, and int8 / fp8 e4m3 ones in place (the storage dtype's
        name as the engine resolves it); not float16 (no fp16 queries), where the engine uses the reference."""
        return kv_dtype in ("bfloat16", "float32", "int8", "fp8_e4m3")

    def kernel_paths(self, cache: LayerCache, num_heads: int) -> tuple[str, str, str | None]:
        """(decode path, prefill path, why either is not the fast one or None) for a model's cache (the
        fast paths of a quantized cache assume bf16 queries, as a model with such a cache runs)."""
        k_cache = cache.k
        kvh, _, block_size, head_dim = k_cache.shape
        label = _FAST_CACHE_DTYPES.get(k_cache.dtype)
        fast = label is not None
        fast_decode = bool(self._kernel.decode_fast_path(fast, num_heads, kvh, head_dim))
        fast_prefill = bool(self._kernel.prefill_fast_path(fast, num_heads, kvh, head_dim, block_size))
        shape = f"head_dim {head_dim}, {num_heads // kvh} query heads per kv head"
        label = label or ""
        decode = f"C++ AVX-512 BF16{label} ({shape})" if fast_decode else f"C++ portable loop{label}"
        prefill = f"C++ AVX-512 BF16 flash{label} ({shape})" if fast_prefill else "torch SDPA"
        why = None
        if not (fast_decode and fast_prefill):
            if not self._kernel.decode_fast_path(True, 9, 3, 64):
                why = "this CPU or compiler has no AVX-512 BF16"
            elif not fast:
                why = f"the cache is {k_cache.dtype}, the fast kernels read bf16, int8 and fp8 e4m3"
            elif not fast_decode:
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
        return self._kernel.paged_decode(
            q, cache.k, cache.v, g.block_table, g.context_lens, scale, cache.k_scale, cache.v_scale
        )

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor) -> None:
        self._kernel.write_kv(k, v, cache.k, cache.v, slots, cache.k_scale, cache.v_scale)

    def prefill(self, q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        m = meta
        if m.prefill_block_table is not None and m.prefill_context_lens is not None:
            assert m.prefill_query_starts is not None and m.prefill_query_lens is not None
            if self._kernel.paged_prefill(
                q, cache.k, cache.v, m.prefill_block_table, m.prefill_query_starts, m.prefill_query_lens,
                m.prefill_context_lens, scale, out, cache.k_scale, cache.v_scale,
            ):
                return
        super().prefill(q, k, v, cache, meta, scale, out)

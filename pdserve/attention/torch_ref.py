"""Reference attention in plain torch: runs on any device, the oracle for faster backends.

Decodes: one batched SDPA over the gathered context of every decode request, padded to the longest,
with a mask. Prefills: one SDPA per request (no padding across requests); a chunk with nothing cached
before it attends to its own fresh K/V with a causal mask, otherwise it gathers its context from the
cache and uses a bottom-right-aligned causal mask.

A quantized cache (int8, fp8) is written through `kv.cache.write` (quantized on the way in) and read
through `LayerCache.gather_blocks` (dequantized to the model's dtype on the way out): this backend is
the oracle the quantized kernels are checked against. Every read of a quantized cache sees the stored
values, a prompt's own fresh K/V included (read back after the write, as vLLM's fp8 path and our
kernels do), so prefix caching, chunking and disaggregation do not change what attention sees.

int4 (kv/int4.py, kv/cache.py) reads what a decode would at every query position: the blocks before
the query's own as sealed (`LayerCache.gather_sealed`: open ones quantized on the fly) and its own
block unquantized, as one SDPA over both versions of the context with a mask choosing per query. So
a prompt in one prefill, in chunks, from the prefix cache or token by token attends to the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionMetadata, DecodeGroup
from pdserve.kv.cache import LayerCache, write


class TorchAttention:
    name = "torch"
    pads_decodes = True
    max_decode_rows = 1  # rows as decodes would gather their context once per row

    def forward(self, q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
        self.write_kv(k, v, cache, meta.slot_mapping)
        groups = meta.decode_groups
        if not meta.prefills and len(groups) == 1 and groups[0].num_seqs == q.shape[0]:
            return self.decode(q, cache, groups[0], scale)  # a decode-only step: no copy into `out`
        out = torch.empty_like(q)
        for g in meta.decode_groups:
            s, n = g.query_start, g.num_seqs
            # Gather whole blocks (contiguous rows), not single slots: several times faster on CPU.
            out[s : s + n] = self.decode(q[s : s + n], cache, g, scale)
        if meta.prefills:
            self.prefill(q, k, v, cache, meta, scale, out)
        return out

    def supports_kv_dtype(self, kv_dtype: str) -> bool:
        """Whether this backend reads and writes a cache stored as `kv_dtype` (`--kv-cache-dtype` names).
        The reference reads every dtype; a backend with kernels of its own overrides this, and the engine
        falls back to the reference (with a WARNING) where it says False."""
        return True

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor) -> None:
        """k, v [T, KVH, D] into the caches [KVH, blocks, block_size, D] at slots (block * block_size + offset)."""
        write(cache, k, v, slots)

    def prefill(  # type: ignore[no-untyped-def]
        self, q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """Attention of every prefill chunk, into its rows of `out` (K/V already in the cache).
        `compute_dtype`: run SDPA on q, K, V widened to it (float32 for 16-bit models where torch's 16-bit
        SDPA is the slower one: CPUs without AVX-512 BF16), the result rounded back into `out`."""
        if cache.is_int4:
            self._prefill_int4(q, cache, meta, scale, out)
            return
        kvh, _, bs, d = cache.k.shape
        for j, p in enumerate(meta.prefills):
            s, e = p.query_start, p.query_start + p.query_len
            qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if p.context_blocks is None and cache.quantized and meta.prefill_block_table is not None:
                # Read back what was just written, as every later read does (and the kernels do): the
                # output then does not depend on whether a prompt's start was cached or chunked.
                blocks = meta.prefill_block_table[j, : -(-p.context_len // bs)].to(q.device)
                kc, vc = cache.gather_blocks(blocks, q.dtype)
                kp = kc.reshape(1, kvh, -1, d)[:, :, : p.context_len]
                vp = vc.reshape(1, kvh, -1, d)[:, :, : p.context_len]
                o = _sdpa(qp, kp, vp, compute_dtype, is_causal=True, scale=scale)
            elif p.context_blocks is None:
                kp = k[s:e].transpose(0, 1).unsqueeze(0)
                vp = v[s:e].transpose(0, 1).unsqueeze(0)
                o = _sdpa(qp, kp, vp, compute_dtype, is_causal=True, scale=scale)
            else:
                kc, vc = cache.gather_blocks(p.context_blocks, q.dtype)
                kp, vp = kc.view(1, kvh, -1, d), vc.view(1, kvh, -1, d)
                o = _sdpa(qp, kp, vp, compute_dtype, attn_mask=p.mask, scale=scale)
            out[s:e] = o.squeeze(0).transpose(0, 1)

    def _prefill_int4(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """int4 prefill chunks: each query attends to the blocks before its own as sealed and to its own
        block's tokens up to itself unquantized (keys = both versions of the context, side by side)."""
        assert meta.prefill_block_table is not None
        kvh, bs, d = cache.k.shape[0], cache.k.shape[2], cache.head_dim
        for j, p in enumerate(meta.prefills):
            s, e = p.query_start, p.query_start + p.query_len
            nb = -(-p.context_len // bs)
            blocks = meta.prefill_block_table[j, :nb].to(q.device)
            ks, vs = cache.gather_sealed(blocks, q.dtype)
            ko, vo = cache.gather_blocks(blocks, q.dtype)
            keys = torch.cat([ks.reshape(kvh, -1, d), ko.reshape(kvh, -1, d)], dim=1).unsqueeze(0)
            values = torch.cat([vs.reshape(kvh, -1, d), vo.reshape(kvh, -1, d)], dim=1).unsqueeze(0)
            q_pos = torch.arange(p.context_len - p.query_len, p.context_len).unsqueeze(1)
            k_pos = torch.arange(nb * bs).unsqueeze(0)
            before = k_pos // bs < q_pos // bs
            own = (k_pos // bs == q_pos // bs) & (k_pos <= q_pos)
            mask = torch.cat([before, own], dim=1).to(q.device)
            qp = q[s:e].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)

    def warmup(self, cache: LayerCache, num_heads: int) -> None:
        pass

    def decode(self, q: torch.Tensor, cache: LayerCache, g: DecodeGroup, scale: float) -> torch.Tensor:
        kvh, d = cache.k.shape[0], cache.head_dim
        kb, vb = cache.gather_blocks(g.block_table.reshape(-1), q.dtype)
        kd = kb.view(kvh, g.num_seqs, -1, d)  # [KVH, B, S, D]
        vd = vb.view(kvh, g.num_seqs, -1, d)
        return _decode_attention(q, kd, vd, g.mask, scale)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, compute_dtype: torch.dtype | None, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """SDPA with GQA, on the inputs widened to `compute_dtype` when one is given."""
    if compute_dtype is not None and q.dtype != compute_dtype:
        q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per request: q [B, H, D]; k, v [KVH, B, S, D]; mask [B, 1, 1, S] (True = attend).
    Two batched matmuls over (kv head, request); torch's CPU flash kernel is several times slower for a
    single 16-bit query token."""
    b, h, d = q.shape
    kvh = k.shape[0]
    if q.dtype == torch.float32:  # here the flash kernel wins, and small fp32 bmms are slow
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
        )
        return o.squeeze(2)
    qg = q.view(b, kvh, h // kvh, d).transpose(0, 1)  # [KVH, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(scale)  # [KVH, B, G, S]
    scores.masked_fill_(~mask.view(1, b, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(b, h, d)

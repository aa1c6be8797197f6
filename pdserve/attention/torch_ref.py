"""Reference attention in plain torch: runs on any device, the oracle for faster backends.

Decodes: one batched SDPA over the gathered context of every decode request, padded to the longest,
with a mask. Prefills: one SDPA per request (no padding across requests); a chunk with nothing cached
before it attends to its own fresh K/V with a causal mask, otherwise it gathers its context from the
cache and uses a bottom-right-aligned causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionMetadata, DecodeGroup
from pdserve.kv.cache import LayerCache


class TorchAttention:
    name = "torch"
    pads_decodes = True

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

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor) -> None:
        """k, v [T, KVH, D] into the caches [KVH, blocks, block_size, D] at slots (block * block_size + offset)."""
        kvh, _, _, d = cache.k.shape
        cache.k.view(kvh, -1, d).index_copy_(1, slots, k.transpose(0, 1))
        cache.v.view(kvh, -1, d).index_copy_(1, slots, v.transpose(0, 1))

    def prefill(self, q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        """Attention of every prefill chunk, into its rows of `out` (K/V already in the cache)."""
        k_cache, v_cache = cache.k, cache.v
        kvh, _, _, d = k_cache.shape
        for p in meta.prefills:
            s, e = p.query_start, p.query_start + p.query_len
            qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if p.context_blocks is None:
                kp = k[s:e].transpose(0, 1).unsqueeze(0)
                vp = v[s:e].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
            else:
                kp = k_cache.index_select(1, p.context_blocks).view(1, kvh, -1, d)
                vp = v_cache.index_select(1, p.context_blocks).view(1, kvh, -1, d)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)

    def warmup(self, cache: LayerCache, num_heads: int) -> None:
        pass

    def decode(self, q: torch.Tensor, cache: LayerCache, g: DecodeGroup, scale: float) -> torch.Tensor:
        k_cache, v_cache = cache.k, cache.v
        kvh, _, _, d = k_cache.shape
        table = g.block_table.reshape(-1)
        kd = k_cache.index_select(1, table).view(kvh, g.num_seqs, -1, d)  # [KVH, B, S, D]
        vd = v_cache.index_select(1, table).view(kvh, g.num_seqs, -1, d)
        return _decode_attention(q, kd, vd, g.mask, scale)


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

"""Reference attention in plain torch: runs on any device, the oracle for faster backends.

Decodes: one batched SDPA over the gathered context of every decode request, padded to the longest,
with a mask. Prefills: one SDPA per request (no padding across requests); a chunk with nothing cached
before it attends to its own fresh K/V with a causal mask, otherwise it gathers its context from the
cache and uses a bottom-right-aligned causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionMetadata


class TorchAttention:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            assert meta.decode_slots is not None
            qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
            kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, S, D]
            vd = v_cache[meta.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for p in meta.prefills:
            s, e = p.query_start, p.query_start + p.query_len
            qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if p.context_slots is None:
                kp = k[s:e].transpose(0, 1).unsqueeze(0)
                vp = v[s:e].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
            else:
                kp = k_cache[p.context_slots].transpose(0, 1).unsqueeze(0)
                vp = v_cache[p.context_slots].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out

"""Attention backends behind one interface.

The runner lays a step's tokens out flat: first the decode requests (one query token each), then the
prefill chunks (several query tokens each). `AttentionMetadata` is built once per step and shared by
every layer; a backend writes the new K/V into the paged cache by `slot_mapping`, then attends each
query to its request's whole context (cached tokens plus the new ones, causally).

The torch backend is the reference that runs everywhere; a CUDA backend (flash-attn, flashinfer)
implements the same two methods and is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kv.cache import LayerCache
from pdserve.registry import Registry


@dataclass(slots=True)
class PrefillSeq:
    query_start: int  # first of its query tokens in the flat batch
    query_len: int
    context_len: int  # tokens it attends to, the new ones included
    context_blocks: torch.Tensor | None  # [num_blocks] block ids of its context; None if nothing was cached before
    mask: torch.Tensor | None  # [query_len, num_blocks * block_size] bool causal mask, with context_blocks


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows of similar context length, attended together padded to the longest of them
    (grouping bounds the padding: one group over contexts of 20 and 2,000 tokens would waste 99%). A
    row is a decode request's query, or one of a short request's (`AttentionBackend.max_decode_rows`),
    each with its own context length and its request's table row."""

    query_start: int
    num_seqs: int  # rows
    block_table: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [num_seqs] int64
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] bool: True where a slot is real


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    num_decode_tokens: int  # the first tokens of the batch, one per decode request
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]
    # The prefills' block tables [num_prefills, max_blocks] (int64, padded with 0), context lengths,
    # first query rows and query lengths, on the host, for kernels that read every prefill's context from
    # the cache in one call (built once per step, like everything here).
    prefill_block_table: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_query_starts: torch.Tensor | None = None
    prefill_query_lens: torch.Tensor | None = None


class AttentionBackend(Protocol):
    name: str
    pads_decodes: bool  # decode cost grows with padding: the runner groups decodes by context length
    # A request with at most this many new tokens attends as that many decode rows, each over its own
    # causal prefix (the runner lays them out with the decodes), not as a prefill chunk: 1 for one-token
    # decodes only; more where the decode kernel reads a short query's context faster than the prefill
    # kernel does (speculative verification: its drafts and the token before them).
    max_decode_rows: int

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        cache: LayerCache,  # the layer's paged K/V (kv/cache.py owns their layout)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v to the cache at meta.slot_mapping, then attend."""
        ...

    def supports_kv_dtype(self, kv_dtype: str) -> bool:
        """Whether this backend reads and writes a cache stored as `kv_dtype` ("bfloat16", "int8",
        "fp8_e4m3", ...). The engine uses the torch reference, with a WARNING, where it says False."""
        ...

    def warmup(self, cache: LayerCache, num_heads: int) -> None:
        """Compile or otherwise prepare kernels before the first request (may do nothing)."""
        ...


ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry(
    "attention backend",
    {
        "torch": "pdserve.attention.torch_ref:TorchAttention",
        "cpu-paged": "pdserve.attention.cpu_paged:CpuPagedAttention",
        "torch-compiled": "pdserve.attention.torch_compiled:CompiledTorchAttention",
    },
)


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    return ATTENTION_BACKENDS.load(name)()

"""The paged K/V tensors. One allocation for all layers, `[num_layers, 2, num_kv_heads, num_blocks,
block_size, head_dim]`, so moving a request's blocks (transfer, swap: next issues) is one gather per
block list.
Layers see `[num_kv_heads, num_blocks, block_size, head_dim]` views; a token's slot is
`block_id * block_size + offset`.

Heads come first so that gathering a batch's blocks yields `[kv_heads, batch, context, head_dim]`, which
batched matmuls consume without another copy (measured: the copy cost as much as the attention)."""

from __future__ import annotations

import torch

from pdserve.config import ModelConfig


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(
            cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim, dtype=dtype, device=device
        )
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [(self.data[i, 0], self.data[i, 1]) for i in range(cfg.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

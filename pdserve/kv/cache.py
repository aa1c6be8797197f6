"""The paged K/V tensors. One allocation for all layers, `[num_layers, 2, num_kv_heads, num_blocks,
block_size, head_dim]`, so moving a request's blocks (transfer, swap to the host tier) is one gather per
block list.
Layers see `[num_kv_heads, num_blocks, block_size, head_dim]` views; a token's slot is
`block_id * block_size + offset`.

Heads come first so that gathering a batch's blocks yields `[kv_heads, batch, context, head_dim]`, which
batched matmuls consume without another copy (measured: the copy cost as much as the attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import ModelConfig


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


@dataclass(slots=True)
class LayerCache:
    """One layer's paged K/V as the attention backends see it: `k`, `v` are
    `[num_kv_heads, num_blocks, block_size, head_dim]` in the storage dtype; a quantized cache also has
    `k_scale`, `v_scale` `[num_kv_heads, num_blocks, block_size]` float32 (one scale per token and kv head;
    the stored value times its scale is the real one). None for an unquantized cache."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
    ) -> None:
        """`num_host_blocks` > 0 adds the host tier that swapped-out requests' blocks are copied to (in
        pinned memory when the cache is on a GPU, so the copies run at full PCIe speed)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.data = torch.zeros(
            cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim, dtype=dtype, device=device
        )
        self.layers: list[LayerCache] = [LayerCache(self.data[i, 0], self.data[i, 1]) for i in range(cfg.num_layers)]
        self._pinned = device.type == "cuda"
        self.host: torch.Tensor | None = None
        if num_host_blocks:
            # empty, not zeros: pages are only touched when something is swapped out.
            self.host = torch.empty(
                cfg.num_layers, 2, cfg.num_kv_heads, num_host_blocks, block_size, cfg.head_dim, dtype=dtype,
                pin_memory=self._pinned,
            )

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def swap(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        """Copy blocks host -> device for `swap_in` ((host, device) pairs), then device -> host for
        `swap_out` ((device, host) pairs): in that order, because a block may be read by one and
        reused by the other in the same step. One gather and one scatter per direction."""
        if not (swap_in or swap_out):
            return
        assert self.host is not None, "this cache has no host tier"
        if swap_in:
            src, dst = _index(swap_in)
            staged = torch.empty(
                (*self.host.shape[:3], len(swap_in), *self.host.shape[4:]), dtype=self.host.dtype,
                pin_memory=self._pinned,
            )
            torch.index_select(self.host, 3, src, out=staged)
            self.data.index_copy_(3, dst.to(self.device), staged.to(self.device, non_blocking=True))
        if swap_out:
            src, dst = _index(swap_out)
            gathered = self.data.index_select(3, src.to(self.device))
            if self._pinned:
                staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                gathered = staged.copy_(gathered)  # synchronous: the host tier is read right after
            self.host.index_copy_(3, dst, gathered.cpu())


def _index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(pairs, dtype=torch.int64)
    return t[:, 0], t[:, 1]

"""The paged K/V tensors, and the only place that knows their physical layout.

One allocation for all layers, `data` `[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]`
in the storage dtype, so moving a request's blocks (transfer, swap to the host tier) is one gather per
block list. A quantized cache (`--kv-cache-dtype int8 | fp8_e4m3`, kv/quant.py) adds `scales`
`[num_layers, 2, num_kv_heads, num_blocks, block_size]` float32: one scale per token and kv head, indexed
exactly like `data` without its last dimension, so every block move applies the same index to both.
Layers see `LayerCache` views (`[num_kv_heads, num_blocks, block_size, head_dim]`); a token's slot is
`block_id * block_size + offset`.

Heads come first so that gathering a batch's blocks yields `[kv_heads, batch, context, head_dim]`, which
batched matmuls consume without another copy (measured: the copy cost as much as the attention).

What else touches the layout goes through here: `write` (the reference write, quantizing on the way in),
`LayerCache.gather_blocks` (the reference read, dequantizing on the way out), `KVCache.gather_tokens` /
`scatter_tokens` (a transfer's payload, values and scales together) and `KVCache.swap`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.memory import zeros_huge_pages
from pdserve.config import ModelConfig
from pdserve.kv.quant import QUANT_DTYPES, dequantize, quantize

# `--kv-cache-dtype` names of the unquantized storage dtypes ("auto" resolves to the model's dtype).
_PLAIN_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_SCALE_BYTES = 4  # one float32 per token and kv head


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a `--kv-cache-dtype` stores K/V in ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in QUANT_DTYPES:
        return QUANT_DTYPES[kv_cache_dtype][0]
    return _PLAIN_DTYPES[kv_cache_dtype]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The `--kv-cache-dtype` name of a storage dtype (the inverse of `storage_dtype`)."""
    for name, (quant_dtype, _) in QUANT_DTYPES.items():
        if quant_dtype == dtype:
            return name
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How K/V sit in memory: what a cache allocates and what both ends of a transfer must agree on.
    `dtype` is the storage dtype; the kv dtype name and the scale layout follow from it (int8 and fp8
    carry one float32 scale per token and kv head, the others none)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, block_size: int, kv_cache_dtype: str, model_dtype: torch.dtype
    ) -> KVLayout:
        """The layout of `cfg`'s cache stored as `kv_cache_dtype` ("auto": `model_dtype`)."""
        dtype = storage_dtype(kv_cache_dtype, model_dtype)
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, block_size)

    @property
    def kv_dtype(self) -> str:
        """The `--kv-cache-dtype` name of the storage dtype."""
        return kv_dtype_name(self.dtype)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in QUANT_DTYPES

    @property
    def scales(self) -> str:
        """The scale layout: "per-token-head" (float32, one per token and kv head) or "none"."""
        return "per-token-head" if self.quantized else "none"

    @property
    def token_row_bytes(self) -> int:
        """One token's K (or V) for one kv head: its values, plus its scale when quantized."""
        return self.head_dim * self.dtype.itemsize + (_SCALE_BYTES if self.quantized else 0)

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token, scales included."""
        return 2 * self.num_layers * self.num_kv_heads * self.token_row_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    # A transfer's payload for one layer and n tokens: `[2, kv_heads, n, head_dim]` in the storage dtype,
    # or for a quantized layout `[2, kv_heads, n, token_row_bytes]` uint8 (each row: the values' bytes,
    # then the scale's), so transports move one tensor and never learn about scales.
    @property
    def chunk_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        last = self.token_row_bytes if self.quantized else self.head_dim
        return (2, self.num_kv_heads, num_tokens, last)

    def key(self) -> str:
        """A compact fingerprint for the transfer handshake: equal keys, compatible caches."""
        return f"{self.kv_dtype}/L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}/B{self.block_size}"

    def describe(self) -> str:
        return (
            f"kv dtype {self.kv_dtype} (scales {self.scales}), block size {self.block_size}, "
            f"{self.num_layers} layers x {self.num_kv_heads} kv heads x head_dim {self.head_dim}"
        )


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

    @property
    def kv_dtype(self) -> str:
        return kv_dtype_name(self.k.dtype)

    def gather_blocks(self, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `block_ids` (any shape, flattened), `[num_kv_heads, n, block_size, head_dim]` each, in
        `dtype`: dequantized when the cache is quantized (the reference read the kernels are checked
        against), a cast when the storage dtype differs, the gather itself otherwise."""
        k = self.k.index_select(1, block_ids)
        v = self.v.index_select(1, block_ids)
        if self.k_scale is not None and self.v_scale is not None:
            k = dequantize(k, self.k_scale.index_select(1, block_ids), dtype)
            v = dequantize(v, self.v_scale.index_select(1, block_ids), dtype)
        elif k.dtype != dtype:
            k, v = k.to(dtype), v.to(dtype)
        return k, v


def write(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """The reference write: k, v `[T, num_kv_heads, head_dim]` into the layer's cache at `slots`
    (block * block_size + offset), quantized on the way in for a quantized cache (kv/quant.py)."""
    kvh, _, _, d = cache.k.shape
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, T, D]
    if cache.k_scale is not None and cache.v_scale is not None:
        kv_dtype = cache.kv_dtype
        k, k_scale = quantize(k, kv_dtype)
        v, v_scale = quantize(v, kv_dtype)
        cache.k_scale.view(kvh, -1).index_copy_(1, slots, k_scale)
        cache.v_scale.view(kvh, -1).index_copy_(1, slots, v_scale)
    _bits(cache.k).view(kvh, -1, d).index_copy_(1, slots, _bits(k.to(cache.k.dtype)))
    _bits(cache.v).view(kvh, -1, d).index_copy_(1, slots, _bits(v.to(cache.v.dtype)))


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device, num_host_blocks: int = 0) -> None:
        """`num_host_blocks` > 0 adds the host tier that swapped-out requests' blocks are copied to (in
        pinned memory when the cache is on a GPU, so the copies run at full PCIe speed)."""
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.device = device
        lay = layout
        shape = (lay.num_layers, 2, lay.num_kv_heads, num_blocks, lay.block_size, lay.head_dim)
        self.data = zeros_huge_pages(shape, lay.dtype, device)
        self.scales: torch.Tensor | None = None
        if lay.quantized:
            self.scales = zeros_huge_pages(shape[:-1], torch.float32, device)
        scales = self.scales
        self.layers: list[LayerCache] = [
            LayerCache(self.data[i, 0], self.data[i, 1], *((scales[i, 0], scales[i, 1]) if scales is not None else ()))
            for i in range(lay.num_layers)
        ]
        self._pinned = device.type == "cuda"
        self.host: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        if num_host_blocks:
            # empty, not zeros: pages are only touched when something is swapped out.
            host_shape = (*shape[:3], num_host_blocks, *shape[4:])
            self.host = torch.empty(host_shape, dtype=lay.dtype, pin_memory=self._pinned)
            if self.scales is not None:
                self.host_scales = torch.empty(host_shape[:-1], dtype=torch.float32, pin_memory=self._pinned)

    @property
    def nbytes(self) -> int:
        scales = self.scales.numel() * self.scales.element_size() if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + scales

    # ---- transfer: one layer's tokens by slot, values and scales in one payload ---------------------
    def gather_tokens(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The K/V of `slots` in `layer` as a transfer payload (`KVLayout.chunk_shape(len(slots))`, a copy)."""
        d = self.data[layer]  # [2, KVH, NB, BS, D]
        values = d.view(2, d.shape[1], -1, d.shape[4]).index_select(2, slots)
        if self.scales is None:
            return values
        s = self.scales[layer]
        scales = s.view(2, s.shape[1], -1).index_select(2, slots)
        return torch.cat([values.view(torch.uint8), scales.unsqueeze(-1).view(torch.uint8)], dim=-1)

    def scatter_tokens(self, layer: int, slots: torch.Tensor, payload: torch.Tensor) -> None:
        """Write a payload of `gather_tokens`' form into `layer` at `slots`."""
        lay = self.layout
        if tuple(payload.shape) != lay.chunk_shape(slots.numel()) or payload.dtype != lay.chunk_dtype:
            raise ValueError(
                f"KV payload {tuple(payload.shape)} {payload.dtype} does not fit this cache's layout "
                f"({lay.chunk_shape(slots.numel())} {lay.chunk_dtype})"
            )
        payload = payload.to(self.device)
        d = self.data[layer]
        values_view = _bits(d).view(2, d.shape[1], -1, d.shape[4])
        if self.scales is None:
            values_view.index_copy_(2, slots, payload)
            return
        nv = lay.head_dim * lay.dtype.itemsize
        values = payload[..., :nv].contiguous().view(values_view.dtype)
        scales = payload[..., nv:].contiguous().view(torch.float32).squeeze(-1)
        values_view.index_copy_(2, slots, values)
        s = self.scales[layer]
        s.view(2, s.shape[1], -1).index_copy_(2, slots, scales)

    # ---- swap: blocks between the device and the host tier, scales by the same index ------------------
    def swap(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        """Copy blocks host -> device for `swap_in` ((host, device) pairs), then device -> host for
        `swap_out` ((device, host) pairs): in that order, because a block may be read by one and
        reused by the other in the same step. One gather and one scatter per direction and tensor."""
        if not (swap_in or swap_out):
            return
        assert self.host is not None, "this cache has no host tier"
        pairs = [(self.data, self.host)]
        if self.scales is not None:
            assert self.host_scales is not None
            pairs.append((self.scales, self.host_scales))
        if swap_in:
            src, dst = _index(swap_in)
            for device_t, host_t in pairs:
                shape = (*host_t.shape[:3], len(swap_in), *host_t.shape[4:])
                staged = torch.empty(shape, dtype=host_t.dtype, pin_memory=self._pinned)
                torch.index_select(host_t, 3, src, out=staged)
                moved = staged.to(self.device, non_blocking=True)
                _bits(device_t).index_copy_(3, dst.to(self.device), _bits(moved))
        if swap_out:
            src, dst = _index(swap_out)
            for device_t, host_t in pairs:
                gathered = device_t.index_select(3, src.to(self.device))
                if self._pinned:
                    staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                    gathered = staged.copy_(gathered)  # synchronous: the host tier is read right after
                _bits(host_t).index_copy_(3, dst, _bits(gathered.cpu()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or for fp8 its bytes as uint8: torch's CPU `index_copy_` has no fp8 kernel, and a
    copy of bytes is a copy of values."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(pairs, dtype=torch.int64)
    return t[:, 0], t[:, 1]

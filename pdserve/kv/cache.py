"""The paged K/V tensors, and the only place that knows their physical layout.

One allocation for all layers, `data` `[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]`
in the storage dtype, so moving a request's blocks (transfer, swap to the host tier) is one gather per
block list. A quantized cache (`--kv-cache-dtype int8 | fp8_e4m3`, kv/quant.py) adds `scales`
`[num_layers, 2, num_kv_heads, num_blocks, block_size]` float32: one 4-byte slot of row parameters per
token and kv head, indexed exactly like `data` without its last dimension, so every block move applies
the same index to both. fp8's slot is its float32 scale; int8's holds a float16 (scale, zero) pair in the
same bytes, which layers see as `[..., block_size, 2]` float16 views (`_row_params`): what moves blocks
(swap, transfer payloads, prefix sharing) moves bytes and never learns which. Layers see `LayerCache`
views (`[num_kv_heads, num_blocks, block_size, head_dim]`); a token's slot is
`block_id * block_size + offset`.

Heads come first so that gathering a batch's blocks yields `[kv_heads, batch, context, head_dim]`, which
batched matmuls consume without another copy (measured: the copy cost as much as the attention).

What else touches the layout goes through here: `write` (the reference write, quantizing on the way in),
`LayerCache.gather_blocks` (the reference read, dequantizing on the way out), `KVCache.gather_tokens` /
`scatter_tokens` (a transfer's payload, values and scales together) and `KVCache.swap`.

int4 (`--kv-cache-dtype int4`, the KIVI layout, kv/int4.py) is the one layout with state: a block is
*open* while it fills (its K/V live unquantized in a small residual pool, `residual`
`[num_layers, 2, num_kv_heads, num_residual_slots, block_size, head_dim]` in the model's dtype, with
`residual_slot[block]` naming its slot) and *sealed* once every token in it is committed (packed 4-bit
`data` `[..., block_size, head_dim / 2]` uint8, keys with a float16 scale and zero per channel
`k_qparams` `[num_layers, 2 (scale, zero), num_kv_heads, num_blocks, head_dim]`, values per token
`v_qparams` `[..., num_blocks, block_size]`). The runner drives the state once per step
(`begin_step`: forget freed blocks, seal the committed ones nobody writes now, open those written for
the first time; `end_step`: note the blocks this step filled with committed tokens), the block manager reports frees
(`note_freed`), and every read sees what a decode would: a query attends to the blocks before its own
as sealed (dequantized, or an open block quantized on the fly by the same function) and to its own
block unquantized, so chunking, prefix caching, speculation and preemption do not change the output."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.memory import zeros_huge_pages
from pdserve.config import ModelConfig
from pdserve.kv import int4
from pdserve.kv.quant import FORMATS, QUANT_DTYPES, dequantize, quantize

# `--kv-cache-dtype` names of the unquantized storage dtypes ("auto" resolves to the model's dtype).
_PLAIN_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_SCALE_BYTES = 4  # per token and kv head: fp8's float32 scale, int8's float16 scale and zero


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a `--kv-cache-dtype` stores K/V in ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in QUANT_DTYPES:
        return QUANT_DTYPES[kv_cache_dtype]
    if kv_cache_dtype == "int4":
        return int4.STORAGE_DTYPE
    return _PLAIN_DTYPES[kv_cache_dtype]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The `--kv-cache-dtype` name of a storage dtype (the inverse of `storage_dtype`)."""
    for name, quant_dtype in QUANT_DTYPES.items():
        if quant_dtype == dtype:
            return name
    if dtype == int4.STORAGE_DTYPE:
        return "int4"
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How K/V sit in memory: what a cache allocates and what both ends of a transfer must agree on.
    `dtype` is the storage dtype; the kv dtype name and the scale layout follow from it (int8 carries a
    float16 scale and zero per token and kv head, fp8 a float32 scale, both in 4 bytes; int4 float16
    scales and zeros per key channel and per value token; the others none). `residual_dtype`: what
    int4's open blocks are kept in (the model's). `key_scales`: the digest of the per-channel powers of
    two the keys are stored divided by (model/key_scales.py; "" for none): keys scaled otherwise are
    other values, so it is part of `key()`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    residual_dtype: torch.dtype = field(default=torch.bfloat16, compare=False)  # int4 only
    key_scales: str = ""

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, block_size: int, kv_cache_dtype: str, model_dtype: torch.dtype, key_scales: str = ""
    ) -> KVLayout:
        """The layout of `cfg`'s cache stored as `kv_cache_dtype` ("auto": `model_dtype`), its keys divided
        by the powers `key_scales` digests ("": none)."""
        dtype = storage_dtype(kv_cache_dtype, model_dtype)
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, block_size, model_dtype, key_scales)

    @property
    def kv_dtype(self) -> str:
        """The `--kv-cache-dtype` name of the storage dtype."""
        return kv_dtype_name(self.dtype)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in QUANT_DTYPES

    @property
    def is_int4(self) -> bool:
        return self.dtype == int4.STORAGE_DTYPE

    @property
    def scales(self) -> str:
        """The scale layout: "per-token-head" (fp8: a float32 scale per token and kv head), int8's
        "per-token-head-zero" (a float16 scale and zero per token and kv head), int4's
        "per-channel-keys/per-token-values" (float16 scale and zero) or "none"."""
        if self.is_int4:
            return "per-channel-keys/per-token-values"
        if not self.quantized:
            return "none"
        return "per-token-head-zero" if self.kv_dtype == "int8" else "per-token-head"

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
        """One block of every layer, scales included (int4: what a sealed block takes)."""
        if self.is_int4:
            bs, d, s = self.block_size, self.head_dim, int4.SCALE_DTYPE.itemsize
            # packed K and V (half a byte each), K's scale and zero per channel, V's per token
            per_head = bs * d + 2 * d * s + 2 * bs * s
            return self.num_layers * self.num_kv_heads * per_head
        return self.block_size * self.bytes_per_token

    @property
    def residual_slot_bytes(self) -> int:
        """int4: one open block of every layer, unquantized (a slot of the residual pool)."""
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * self.residual_dtype.itemsize

    # A transfer's payload for one layer and n tokens: `[2, kv_heads, n, head_dim]` in the storage dtype,
    # or for int8/fp8 `[2, kv_heads, n, token_row_bytes]` uint8 (each row: the values' bytes, then its
    # 4-byte parameter slot's), so transports move one tensor and never learn about scales. int4 moves
    # what it stores, which is not a row per token: `[2, kv_heads, chunk_len(n)]` uint8 (`gather_tokens`
    # says what the bytes are). A transport only slices dim 2, by `chunk_len`, and counts tokens by
    # `chunk_num_tokens`.
    @property
    def chunk_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized or self.is_int4 else self.dtype

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        if self.is_int4:
            return (2, self.num_kv_heads, self.chunk_len(num_tokens))
        last = self.token_row_bytes if self.quantized else self.head_dim
        return (2, self.num_kv_heads, num_tokens, last)

    @property
    def int4_block_row_bytes(self) -> int:
        """int4: one sealed block of one kv head in a payload, for K (payload[0]) or V (payload[1]): its
        packed values, then the block's scales (payload[0]) or zeros (payload[1]), K's per channel and V's
        per token, as the cache's `k_qparams` / `v_qparams` index them."""
        return self.block_size * self.head_dim // 2 + (self.head_dim + self.block_size) * int4.SCALE_DTYPE.itemsize

    def chunk_len(self, num_tokens: int) -> int:
        """The extent along a payload's dim 2 of `num_tokens` tokens. int4: tokens from a block boundary,
        whole blocks sealed, then the open block's tokens as their unquantized rows (the residual dtype's)."""
        if not self.is_int4:
            return num_tokens
        full, tail = divmod(num_tokens, self.block_size)
        return full * self.int4_block_row_bytes + tail * self.head_dim * self.residual_dtype.itemsize

    def chunk_num_tokens(self, length: int, max_tokens: int) -> int:
        """How many tokens a payload of `length` along dim 2 holds, for a chunk that may hold at most
        `max_tokens` (the rest of its transfer). int4: a chunk is whole blocks unless it ends the
        transfer, and whole blocks that fit in `max_tokens` are shorter than the chunk that ends it
        (k <= floor(max_tokens / block_size) blocks), so the length tells which. Raises ValueError for a
        length no such chunk has."""
        if not self.is_int4:
            return length
        if length == self.chunk_len(max_tokens):
            return max_tokens
        full, rest = divmod(length, self.int4_block_row_bytes)
        if rest or full * self.block_size > max_tokens:
            raise ValueError(f"an int4 KV payload of {length} bytes per row is no chunk of at most {max_tokens} tokens")
        return full * self.block_size

    def key(self) -> str:
        """A compact fingerprint for the transfer handshake: equal keys, compatible caches (int4: its
        open blocks travel unquantized, so the residual dtype is part of it; int8 names its row format,
        `int8-asym`, so a peer of the older symmetric int8 refuses to pair; keys stored divided by
        per-channel powers of two add `/K` and their digest)."""
        dtype = f"{self.kv_dtype}+{kv_dtype_name(self.residual_dtype)}" if self.is_int4 else self.kv_dtype
        dtype = FORMATS.get(dtype, dtype)
        keys = f"/K{self.key_scales}" if self.key_scales else ""
        return f"{dtype}/L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}/B{self.block_size}{keys}"

    def describe(self) -> str:
        keys = f", keys divided by per-channel powers of two {self.key_scales}" if self.key_scales else ""
        return (
            f"kv dtype {self.kv_dtype} (scales {self.scales}{keys}), block size {self.block_size}, "
            f"{self.num_layers} layers x {self.num_kv_heads} kv heads x head_dim {self.head_dim}"
        )


@dataclass(slots=True)
class LayerCache:
    """One layer's paged K/V as the attention backends see it: `k`, `v` are
    `[num_kv_heads, num_blocks, block_size, head_dim]` in the storage dtype; a quantized cache also has
    `k_scale`, `v_scale`, each row's parameters as kv/quant.py's `quantize` returns them: fp8
    `[num_kv_heads, num_blocks, block_size]` float32 (stored value times scale is the real one), int8
    `[num_kv_heads, num_blocks, block_size, 2]` float16 (scale, zero: (stored + 128) * scale + zero). None
    for an unquantized cache.

    int4 (the module docstring): `k`, `v` are packed `[num_kv_heads, num_blocks, block_size, head_dim / 2]`
    uint8; `k_scale`, `k_zero` `[num_kv_heads, num_blocks, head_dim]` and `v_scale`, `v_zero`
    `[num_kv_heads, num_blocks, block_size]` float16; `residual_k`, `residual_v`
    `[num_kv_heads, num_residual_slots, block_size, head_dim]` hold open blocks, `residual_slot` `[num_blocks]`
    int32 names a block's slot (-1: sealed). These five are None for every other dtype."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    residual_k: torch.Tensor | None = None
    residual_v: torch.Tensor | None = None
    residual_slot: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def is_int4(self) -> bool:
        return self.residual_slot is not None

    @property
    def kv_dtype(self) -> str:
        return "int4" if self.is_int4 else kv_dtype_name(self.k.dtype)

    @property
    def head_dim(self) -> int:
        return self.residual_k.shape[-1] if self.residual_k is not None else self.k.shape[-1]

    def gather_blocks(self, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `block_ids` (any shape, flattened), `[num_kv_heads, n, block_size, head_dim]` each, in
        `dtype`: dequantized when the cache is quantized (the reference read the kernels are checked
        against), a cast when the storage dtype differs, the gather itself otherwise. int4: sealed
        blocks dequantized, open ones as they are in the residual pool (what a decode reads)."""
        if self.is_int4:
            return self._gather_int4(block_ids.reshape(-1), dtype, as_sealed=False)
        k = self.k.index_select(1, block_ids)
        v = self.v.index_select(1, block_ids)
        if self.k_scale is not None and self.v_scale is not None:
            k = dequantize(k, self.k_scale.index_select(1, block_ids), dtype)
            v = dequantize(v, self.v_scale.index_select(1, block_ids), dtype)
        elif k.dtype != dtype:
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    def gather_sealed(self, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """int4: K and V of `block_ids` as they read once sealed: open blocks quantized on the fly by the
        function sealing uses (a prefill's queries see the blocks before their own this way)."""
        return self._gather_int4(block_ids.reshape(-1), dtype, as_sealed=True)

    def _gather_int4(self, ids: torch.Tensor, dtype: torch.dtype, as_sealed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.k_scale is not None and self.v_scale is not None and self.k_zero is not None
        assert self.v_zero is not None and self.residual_k is not None and self.residual_v is not None
        assert self.residual_slot is not None
        k = int4.dequantize_keys(self.k.index_select(1, ids), self.k_scale.index_select(1, ids),
                                 self.k_zero.index_select(1, ids), dtype)
        v = int4.dequantize_values(self.v.index_select(1, ids), self.v_scale.index_select(1, ids),
                                   self.v_zero.index_select(1, ids), dtype)
        slot = self.residual_slot.index_select(0, ids).long()
        is_open = (slot >= 0).view(1, -1, 1, 1)
        rk = self.residual_k.index_select(1, slot.clamp(min=0))
        rv = self.residual_v.index_select(1, slot.clamp(min=0))
        if as_sealed:
            rk, rv = int4.fake_quantize(rk, rv, dtype)
        return torch.where(is_open, rk.to(dtype), k), torch.where(is_open, rv.to(dtype), v)


def write(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """The reference write: k, v `[T, num_kv_heads, head_dim]` into the layer's cache at `slots`
    (block * block_size + offset), quantized on the way in for a quantized cache (kv/quant.py); for int4
    into the residual pool, unquantized (a block is quantized when it is sealed)."""
    if cache.residual_slot is not None:  # int4: into the open blocks' residual slots (begin_step opened them)
        assert cache.residual_k is not None and cache.residual_v is not None
        kvh, _, bs, d = cache.residual_k.shape
        rows = cache.residual_slot.index_select(0, slots // bs).long() * bs + slots % bs
        cache.residual_k.view(kvh, -1, d).index_copy_(1, rows, k.transpose(0, 1).to(cache.residual_k.dtype))
        cache.residual_v.view(kvh, -1, d).index_copy_(1, rows, v.transpose(0, 1).to(cache.residual_v.dtype))
        return
    kvh, _, _, d = cache.k.shape
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, T, D]
    if cache.k_scale is not None and cache.v_scale is not None:
        kv_dtype = cache.kv_dtype
        k, k_scale = quantize(k, kv_dtype)
        v, v_scale = quantize(v, kv_dtype)
        rows = (kvh, -1, *cache.k_scale.shape[3:])  # int8: [KVH, NB * BS, 2] (scale, zero) pairs
        cache.k_scale.view(rows).index_copy_(1, slots, k_scale)
        cache.v_scale.view(rows).index_copy_(1, slots, v_scale)
    _bits(cache.k).view(kvh, -1, d).index_copy_(1, slots, _bits(k.to(cache.k.dtype)))
    _bits(cache.v).view(kvh, -1, d).index_copy_(1, slots, _bits(v.to(cache.v.dtype)))


class KVCache:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device,
        num_host_blocks: int = 0,
        num_residual_slots: int = 0,
    ) -> None:
        """`num_host_blocks` > 0 adds the host tier that swapped-out requests' blocks are copied to (in
        pinned memory when the cache is on a GPU, so the copies run at full PCIe speed).
        `num_residual_slots`: int4 only, how many blocks can be open at once (`int4_residual_slots`)."""
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.device = device
        lay = layout
        d = lay.head_dim // 2 if lay.is_int4 else lay.head_dim
        shape = (lay.num_layers, 2, lay.num_kv_heads, num_blocks, lay.block_size, d)
        self.data = zeros_huge_pages(shape, lay.dtype, device)
        self.scales: torch.Tensor | None = None
        if lay.quantized:
            self.scales = zeros_huge_pages(shape[:-1], torch.float32, device)
        self._pinned = device.type == "cuda"
        self.host: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        if num_host_blocks:
            # empty, not zeros: pages are only touched when something is swapped out.
            host_shape = (*shape[:3], num_host_blocks, *shape[4:])
            self.host = torch.empty(host_shape, dtype=lay.dtype, pin_memory=self._pinned)
            if self.scales is not None:
                self.host_scales = torch.empty(host_shape[:-1], dtype=torch.float32, pin_memory=self._pinned)
        if lay.is_int4:
            self._init_int4(num_residual_slots, num_host_blocks)
            self.layers = [self._int4_layer(i) for i in range(lay.num_layers)]
            return
        scales, n = self.scales, lay.num_layers
        params = [_row_params(scales[i], lay.kv_dtype) if scales is not None else () for i in range(n)]
        self.layers: list[LayerCache] = [LayerCache(self.data[i, 0], self.data[i, 1], *params[i])
                                         for i in range(n)]

    @property
    def is_int4(self) -> bool:
        return self.layout.is_int4

    @property
    def nbytes(self) -> int:
        tensors = [self.data, self.scales, *((self.k_qparams, self.v_qparams, self.residual) if self.is_int4 else ())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # ---- int4: open and sealed blocks, driven by the runner once per step -----------------------------
    def _init_int4(self, num_residual_slots: int, num_host_blocks: int) -> None:
        lay, nb, dev = self.layout, self.num_blocks, self.device
        if num_residual_slots < 1:
            raise ValueError("an int4 KV cache needs residual slots for its open blocks")
        head = (lay.num_layers, 2, lay.num_kv_heads)  # dim 1: K/V for data, (scale, zero) for qparams
        self.k_qparams = torch.zeros((*head, nb, lay.head_dim), dtype=int4.SCALE_DTYPE, device=dev)
        self.v_qparams = torch.zeros((*head, nb, lay.block_size), dtype=int4.SCALE_DTYPE, device=dev)
        self.residual = torch.zeros(
            (*head, num_residual_slots, lay.block_size, lay.head_dim), dtype=lay.residual_dtype, device=dev
        )
        self.residual_slot = torch.full((nb,), -1, dtype=torch.int32, device=dev)
        self._sealable = torch.zeros(nb, dtype=torch.bool, device=dev)  # open, every token committed
        self._free_slots = list(range(num_residual_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._freed: dict[int, bool] = {}  # blocks freed since the last step -> whether they stay cached
        self.host_k_qparams: torch.Tensor | None = None
        self.host_v_qparams: torch.Tensor | None = None
        # Open blocks of swapped-out requests, by host block: their unquantized K/V `[L, 2, KVH, BS, D]`.
        self.host_residual: dict[int, torch.Tensor] = {}
        if num_host_blocks:
            self.host_k_qparams = torch.empty((*head, num_host_blocks, lay.head_dim), dtype=int4.SCALE_DTYPE)
            self.host_v_qparams = torch.empty((*head, num_host_blocks, lay.block_size), dtype=int4.SCALE_DTYPE)

    def _int4_layer(self, i: int) -> LayerCache:
        kq, vq = self.k_qparams[i], self.v_qparams[i]
        return LayerCache(
            self.data[i, 0], self.data[i, 1], kq[0], vq[0], kq[1], vq[1],
            self.residual[i, 0], self.residual[i, 1], self.residual_slot,
        )

    @property
    def num_open_blocks(self) -> int:
        return int(self.residual.shape[3]) - len(self._free_slots) if self.is_int4 else 0

    def note_freed(self, block: int, cached: bool) -> None:
        """The block manager freed `block` (`cached`: it stays findable by its hash, so it is full of
        committed tokens). Remembered until the next step or swap: the block's content may still be
        copied to the host tier before then."""
        self._freed[block] = cached

    def begin_step(self, slot_mapping: torch.Tensor, block_table: torch.Tensor, num_committed_blocks: torch.Tensor) -> None:
        """int4, before a step's forward: forget freed blocks (a cached one is sealed, the others give
        their slot back); seal every open block known to hold only committed tokens (marked by the last
        `end_step`, or among each request's first `num_committed_blocks[i]` of `block_table[i]`: blocks
        drafts filled and that have since been accepted) unless this step writes it; open every block
        `slot_mapping` writes to for the first time. Every layer then finds each block it reads either
        sealed or open. A block is never sealed in the step that writes it, so running a step again (the
        engine replays a failed step request by request) rewrites open blocks only."""
        self._forget_freed()
        written = torch.unique(slot_mapping.to(self.device) // self.block_size)
        self._mark_committed(block_table, num_committed_blocks)
        self._sealable[written] = False
        self._seal(self._sealable.nonzero().squeeze(1))
        fresh = written[self.residual_slot.index_select(0, written) < 0]
        self._open(fresh.tolist())

    def end_step(self, block_table: torch.Tensor, num_committed_blocks: torch.Tensor) -> None:
        """int4, after a step's forward: the open blocks among each request's first
        `num_committed_blocks[i]` hold only committed tokens (draft tokens are not, until accepted); the
        next step seals them, all layers in one batched quantization."""
        self._mark_committed(block_table, num_committed_blocks)

    def _mark_committed(self, block_table: torch.Tensor, num_committed_blocks: torch.Tensor) -> None:
        cols = torch.arange(block_table.shape[1])
        candidates = block_table[cols < num_committed_blocks.unsqueeze(1)].to(self.device)
        self._sealable[candidates[self.residual_slot.index_select(0, candidates) >= 0]] = True

    def _forget_freed(self) -> None:
        if not self._freed:
            return
        blocks = torch.tensor(list(self._freed), dtype=torch.int64, device=self.device)
        cached = torch.tensor(list(self._freed.values()), dtype=torch.bool, device=self.device)
        self._freed.clear()
        is_open = self.residual_slot.index_select(0, blocks) >= 0
        self._seal(blocks[is_open & cached])
        self._release(blocks[is_open & ~cached])

    def _open(self, blocks: list[int]) -> None:
        if not blocks:
            return
        if len(blocks) > len(self._free_slots):
            raise RuntimeError(
                f"int4 KV cache: {len(blocks)} blocks to open but only {len(self._free_slots)} residual slots free "
                f"({self.residual.shape[3]} in all); a bug in the slot accounting (int4_residual_slots)"
            )
        slots = [self._free_slots.pop() for _ in blocks]
        self.residual_slot[torch.tensor(blocks, device=self.device)] = torch.tensor(
            slots, dtype=torch.int32, device=self.device
        )

    def _release(self, blocks: torch.Tensor) -> None:
        if blocks.numel() == 0:
            return
        self._free_slots.extend(self.residual_slot.index_select(0, blocks).tolist())
        self.residual_slot[blocks] = -1
        self._sealable[blocks] = False

    def _seal(self, blocks: torch.Tensor) -> None:
        """Quantize open `blocks` (int64 tensor) of every layer from their residual slots, then free the slots."""
        if blocks.numel() == 0:
            return
        slots = self.residual_slot.index_select(0, blocks).long()
        res = self.residual.index_select(3, slots)  # [L, 2, KVH, n, BS, D]
        for j, (packed, scale, zero) in enumerate((int4.quantize_keys(res[:, 0]), int4.quantize_values(res[:, 1]))):
            self.data[:, j].index_copy_(2, blocks, packed)
            qparams = self.k_qparams if j == 0 else self.v_qparams
            qparams[:, 0].index_copy_(2, blocks, scale)
            qparams[:, 1].index_copy_(2, blocks, zero)
        self._release(blocks)

    # ---- transfer: one layer's tokens by slot, values and scales in one payload ---------------------
    def gather_tokens(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The K/V of `slots` in `layer` as a transfer payload (`KVLayout.chunk_shape(len(slots))`, a copy).
        int4: the slots start at a block boundary; see `_gather_int4_tokens`."""
        if self.is_int4:
            return self._gather_int4_tokens(layer, slots)
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
        if self.is_int4:
            self._scatter_int4_tokens(layer, slots, payload)
            return
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

    def _chunk_blocks(self, slots: torch.Tensor) -> tuple[torch.Tensor, int | None, int]:
        """int4: the whole blocks a chunk's slots cover, the block of its open tail (None if it ends on a
        boundary) and the tail's token count."""
        bs = self.block_size
        if slots.numel() == 0 or int(slots[0]) % bs:
            raise ValueError("an int4 KV chunk starts at a block boundary and holds a token")
        full, tail = divmod(slots.numel(), bs)
        blocks = slots[::bs] // bs
        return blocks[:full], (int(blocks[full]) if tail else None), tail

    def _gather_int4_tokens(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """int4 moves what it stores, so that the receiver ends with the state this cache will have: per
        K (payload[0]) and V (payload[1]) and kv head, every whole block sealed (packed values, then the
        block's scales in payload[0] and its zeros in payload[1]: `KVLayout.int4_block_row_bytes`), then
        the open last block's tokens as they sit in the residual pool. A whole block still open (written
        this step, sealed by the next) is quantized here by the function sealing uses: the same bytes."""
        lay = self.layout
        sealed, open_block, tail = self._chunk_blocks(slots)
        packed = self.data[layer].index_select(2, sealed)  # [2, KVH, n, BS, D / 2]
        k_qp = self.k_qparams[layer].index_select(2, sealed)  # [2 (scale, zero), KVH, n, D]
        v_qp = self.v_qparams[layer].index_select(2, sealed)  # [2 (scale, zero), KVH, n, BS]
        slot = self.residual_slot.index_select(0, sealed).long()
        is_open = (slot >= 0).nonzero().squeeze(1)
        if is_open.numel():
            res = self.residual[layer].index_select(2, slot.index_select(0, is_open))  # [2, KVH, m, BS, D]
            for j, (p, scale, zero) in enumerate((int4.quantize_keys(res[0]), int4.quantize_values(res[1]))):
                qp = k_qp if j == 0 else v_qp
                packed[j].index_copy_(1, is_open, p)
                qp[0].index_copy_(1, is_open, scale)
                qp[1].index_copy_(1, is_open, zero)
        kvh, n = lay.num_kv_heads, sealed.numel()
        packed_bytes = packed.reshape(2, kvh, n, lay.block_size * lay.head_dim // 2)
        rows = torch.cat([packed_bytes, k_qp.view(torch.uint8), v_qp.view(torch.uint8)], dim=-1)
        parts = [rows.reshape(2, kvh, n * lay.int4_block_row_bytes)]
        if open_block is not None:
            rslot = int(self.residual_slot[open_block])
            assert rslot >= 0, "the last block of an int4 chunk that ends inside it is open"
            parts.append(self.residual[layer, :, :, rslot, :tail].reshape(2, kvh, -1).contiguous().view(torch.uint8))
        return torch.cat(parts, dim=2)

    def _scatter_int4_tokens(self, layer: int, slots: torch.Tensor, payload: torch.Tensor) -> None:
        """The inverse of `_gather_int4_tokens`: whole blocks written sealed, the tail into its block's
        residual slot (the block opened first). Blocks arrive reserved for this request; whatever state
        an earlier owner left (open, or a free not yet forgotten) is dropped so it cannot undo this."""
        lay = self.layout
        sealed, open_block, tail = self._chunk_blocks(slots)
        self._take_received(sealed, open_block)
        kvh, n, bs, d = lay.num_kv_heads, sealed.numel(), lay.block_size, lay.head_dim
        nb, nv = n * lay.int4_block_row_bytes, bs * d // 2
        rows = payload[:, :, :nb].reshape(2, kvh, n, lay.int4_block_row_bytes)
        self.data[layer].index_copy_(2, sealed, rows[..., :nv].reshape(2, kvh, n, bs, d // 2))
        self.k_qparams[layer].index_copy_(2, sealed, rows[..., nv : nv + 2 * d].contiguous().view(int4.SCALE_DTYPE))
        self.v_qparams[layer].index_copy_(2, sealed, rows[..., nv + 2 * d :].contiguous().view(int4.SCALE_DTYPE))
        if open_block is not None:
            rslot = int(self.residual_slot[open_block])
            tail_rows = payload[:, :, nb:].contiguous().view(lay.residual_dtype).view(2, kvh, tail, d)
            self.residual[layer, :, :, rslot, :tail] = tail_rows

    def _take_received(self, sealed: torch.Tensor, open_block: int | None) -> None:
        """int4: make `sealed` blocks sealed and `open_block` open, for a received chunk (every layer's
        chunk calls this; only the first changes anything)."""
        for b in sealed.tolist() + ([open_block] if open_block is not None else []):
            self._freed.pop(b, None)
        self._release(sealed[self.residual_slot.index_select(0, sealed) >= 0])
        if open_block is not None and int(self.residual_slot[open_block]) < 0:
            self._open([open_block])

    # ---- swap: blocks between the device and the host tier, scales by the same index ------------------
    def swap(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        """Copy blocks host -> device for `swap_in` ((host, device) pairs), then device -> host for
        `swap_out` ((device, host) pairs): in that order, because a block may be read by one and
        reused by the other in the same step. One gather and one scatter per direction and tensor.
        int4: sealed blocks move as bytes; an open block's unquantized K/V go with it and it is open
        again after a swap-in. Freed blocks are forgotten here too (this runs every step)."""
        if not self.is_int4:
            self._swap_blocks(swap_in, swap_out, [(self.data, self.host), (self.scales, self.host_scales)])
            return
        # The order matters: a host block that swap_in reads may be reused by swap_out; a device block
        # swapped out was freed this step, and is forgotten only once its open K/V are copied.
        incoming = {dev: self.host_residual.pop(host) for host, dev in swap_in if host in self.host_residual}
        for dev, host in swap_out:
            slot = int(self.residual_slot[dev])
            if slot >= 0:
                self.host_residual[host] = self.residual[:, :, :, slot].cpu().clone()
            else:
                self.host_residual.pop(host, None)
        self._forget_freed()
        self._swap_blocks(swap_in, swap_out, [
            (self.data, self.host), (self.k_qparams, self.host_k_qparams), (self.v_qparams, self.host_v_qparams)
        ])
        for _, dev in swap_in:
            is_open = int(self.residual_slot[dev]) >= 0
            if dev in incoming:
                if not is_open:
                    self._open([dev])
                self.residual[:, :, :, int(self.residual_slot[dev])] = incoming[dev].to(self.device)
            elif is_open:
                self._release(torch.tensor([dev], device=self.device))

    def _swap_blocks(
        self,
        swap_in: list[tuple[int, int]],
        swap_out: list[tuple[int, int]],
        tensors: list[tuple[torch.Tensor | None, torch.Tensor | None]],
    ) -> None:
        """Move blocks (dim 3 of every tensor) between each device tensor and its host twin."""
        if not (swap_in or swap_out):
            return
        assert self.host is not None, "this cache has no host tier"
        pairs = [(d, h) for d, h in tensors if d is not None]
        assert all(h is not None for _, h in pairs)
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


def _row_params(slots: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's per-row 4-byte slots `[2 (K, V), ..., block_size]` float32 as kv/quant.py's qparams for K
    and V, views: fp8's scales as they are, int8's as float16 (scale, zero) pairs `[..., block_size, 2]`."""
    if kv_dtype == "int8":
        slots = slots.view(torch.float16).unflatten(-1, (-1, 2))
    return slots[0], slots[1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or for fp8 its bytes as uint8: torch's CPU `index_copy_` has no fp8 kernel, and a
    copy of bytes is a copy of values."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(pairs, dtype=torch.int64)
    return t[:, 0], t[:, 1]

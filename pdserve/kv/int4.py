"""Reference 4-bit quantization of a sealed KV block in the KIVI layout: the oracle kernels are checked
against, and the one function both sealing and every read of a not-yet-sealed block go through.

KIVI (Liu et al. 2024) quantizes keys per *channel* and values per *token*: keys have outlier channels
(a few dimensions are large for every token), so a scale per channel keeps the others' resolution;
values have no such structure and are consumed per token by the probability-weighted sum. Both are
asymmetric min/max: q = round((x - zero) / scale) in [0, 15], x ~ q * scale + zero, zero = min,
scale = (max - min) / 15. Here the group a key channel's scale covers is one block (block_size tokens);
a value's scale covers one token's head_dim values. Scales and zeros are float16 (they are a quarter of
a block's bytes already; float32 would make them half). Two 4-bit values share a byte along head_dim:
element 2i in the low nibble, 2i + 1 in the high one.

Shapes: a block's K or V for some leading dims is `[..., block_size, head_dim]`; keys give scale and
zero `[..., head_dim]`, values `[..., block_size]`; the packed bytes are `[..., block_size, head_dim / 2]`
uint8. The maths runs in float32 from the rounded float16 scale and zero, so quantizing the same block
twice gives the same bytes whatever the batch around it (sealing is batched over layers; a read that
quantizes an open block on the fly does one layer)."""

from __future__ import annotations

import torch

QMAX = 15.0  # 4 bits, unsigned
SCALE_DTYPE = torch.float16
STORAGE_DTYPE = torch.uint8  # what `--kv-cache-dtype int4` stores: packed pairs of 4-bit values


def pack(q: torch.Tensor) -> torch.Tensor:
    """[..., D] integers in [0, 15] (any integer or float dtype) -> [..., D / 2] uint8, two per byte."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`: [..., D / 2] uint8 -> [..., D] uint8 in [0, 15]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization of x with one (scale, zero) per slice along `dim` -> (packed,
    scale, zero), scale and zero with `dim` reduced, float16."""
    xf = x.float()
    lo, hi = xf.amin(dim=dim), xf.amax(dim=dim)
    zero = lo.to(SCALE_DTYPE)
    scale = ((hi - zero.float()) / QMAX).to(SCALE_DTYPE)
    s = scale.float().unsqueeze(dim)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))  # a constant slice: scale 0, stores zeros
    q = ((xf - zero.float().unsqueeze(dim)) * inv).round_().clamp_(0, QMAX)
    return pack(q), scale, zero


def quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [..., block_size, D] -> (packed [..., block_size, D / 2], scale [..., D], zero [..., D]): one
    scale and zero per channel over the block's tokens."""
    return _quantize(k, dim=-2)


def quantize_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [..., block_size, D] -> (packed [..., block_size, D / 2], scale [..., block_size], zero
    [..., block_size]): one scale and zero per token."""
    return _quantize(v, dim=-1)


def dequantize_keys(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_keys`, in `dtype`."""
    q = unpack(packed).float()
    return (q * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)).to(dtype)


def dequantize_values(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_values`, in `dtype`."""
    q = unpack(packed).float()
    return (q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).to(dtype)


def fake_quantize(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What blocks k, v [..., block_size, D] read as once sealed: quantized and dequantized, in `dtype`."""
    return dequantize_keys(*quantize_keys(k), dtype), dequantize_values(*quantize_values(v), dtype)

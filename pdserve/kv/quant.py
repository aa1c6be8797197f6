"""Reference quantization of K/V rows: the oracle the kernels are checked against.

A row is one token's vector for one kv head (`head_dim` values). It is stored as int8 or fp8 (e4m3)
with one float32 scale per row, symmetric: stored * scale is the value, scale = max|row| / qmax. A row
of zeros gets scale 0 (and stores zeros), so dequantizing never divides."""

from __future__ import annotations

import torch

# The storage dtype of each `--kv-cache-dtype` that is quantized, and its largest representable magnitude.
QUANT_DTYPES: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
}


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (stored [..., D] in the storage dtype, scale [...] float32)."""
    dtype, qmax = QUANT_DTYPES[kv_dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = xf * inv.unsqueeze(-1)
    if dtype == torch.int8:
        y = y.round_().clamp_(-qmax, qmax)
    return y.to(dtype), scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize`, in `dtype`."""
    return (stored.float() * scale.unsqueeze(-1)).to(dtype)

"""Reference quantization of K/V rows: the oracle the kernels are checked against.

A row is one token's vector for one kv head (`head_dim` values). It is stored in one byte per value plus
4 bytes of parameters (`qparams`), quantized with its own parameters when it is written:

- int8, asymmetric: 256 levels over the row's [min, max]. zero = fp16(min), scale = fp16((max - zero) /
  255), q = clamp(round((x - zero) / scale), 0, 255) (to even, in float32), value = q * scale + zero
  (float32). `qparams` [..., 2] float16 holds (scale, zero); the stored byte is the int8 q - 128, so the
  kernels widen it as a signed int8 and read value = stored * scale + (zero + 128 * scale). A constant
  row (min == max, zeros included) gets scale 0, stores q = 0 and reads as its zero, and nothing divides
  by the 0. Each value is off by at most half a step plus the float16 roundings of zero and scale (a
  relative 2^-11 of |min| and of max - min). min is clamped to float16's +-65504 before rounding (the
  bits are unchanged below that; beyond it a row saturates instead of turning into NaN), and so is scale.
- fp8_e4m3, symmetric: `qparams` [...] float32 is scale = max|row| / 448, the stored value x / scale in
  e4m3, value = stored * scale. A row of zeros gets scale 0 (and stores zeros).

The int8 quantizer is benchmarks/kv_int8_split.py's `int8_asymmetric`, bit for bit (issue: int8 KV's KL).
"""

from __future__ import annotations

import torch

# The storage dtype of each `--kv-cache-dtype` that this module quantizes (int4: kv/int4.py).
QUANT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# The row format each names in a layout key: two caches pair only with the same format.
FORMATS: dict[str, str] = {"int8": "int8-asym", "fp8_e4m3": "fp8_e4m3"}

INT8_OFFSET = 128  # stored int8 = q - INT8_OFFSET for q in [0, 255]
_FP16_MAX = 65504.0
_FP8_MAX = 448.0


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (stored [..., D] in the storage dtype, qparams: int8 [..., 2] float16 (scale, zero);
    fp8 [...] float32 scale)."""
    xf = x.float()
    if kv_dtype == "int8":
        zero = xf.amin(dim=-1).clamp_(-_FP16_MAX, _FP16_MAX).half().float()
        scale = ((xf.amax(dim=-1) - zero) / 255.0).clamp_(max=_FP16_MAX).half().float()
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = ((xf - zero.unsqueeze(-1)) * inv.unsqueeze(-1)).round_().clamp_(0, 255)
        return (q - INT8_OFFSET).to(torch.int8), torch.stack([scale, zero], dim=-1).half()
    if kv_dtype != "fp8_e4m3":
        raise ValueError(f"no reference quantization for a {kv_dtype} cache")
    scale = xf.abs().amax(dim=-1) / _FP8_MAX
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (xf * inv.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def dequantize(stored: torch.Tensor, qparams: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize`, in `dtype` (the format follows from the storage dtype)."""
    if stored.dtype == torch.int8:
        scale, zero = qparams.float().unbind(-1)
        return ((stored.float() + INT8_OFFSET) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).to(dtype)
    return (stored.float() * qparams.unsqueeze(-1)).to(dtype)

"""The Llama layer's small elementwise steps, in two implementations with the same results:

- `TorchOps`: plain torch, any device and dtype: the reference.
- `FusedCpuOps`: a C++ extension (`csrc/fused_ops.cpp`) that does each step in one call. On CPU a
  decode step at small batch is dominated by per-op dispatch (30 layers x ~40 torch ops); its calls
  (add + RMSNorm, RoPE on q and k in place, SiLU-and-multiply) replace ~16 ops per layer. They reproduce
  the torch sequence's bf16 roundings, so outputs agree bit for bit except for rare 1-ulp differences
  where RMSNorm sums in another order or SiLU's exp (its own, AVX-512) differs from torch's in the last
  float32 bit on a bf16 rounding boundary (none in 3.3M random elements).

The residual stream is passed as (x, delta): a layer returns its last projection without adding it, and
the next layer's first norm adds it (`add_rms_norm`), so the add and the norm are one call.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "fused_ops.cpp")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, round to the input dtype, then scale (the order Hugging Face's Llama uses)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class TorchOps:
    name = "torch"

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta) * weight); delta None: nothing to add."""
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, eps)

    @staticmethod
    def rope_qkv(
        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v, [T, heads, head_dim] each, from the fused projection's output. RoPE on q
        and k together: one set of ops for both."""
        t = qkv.shape[0]
        qk_size = (num_heads + num_kv_heads) * head_dim
        qk = apply_rope(qkv[:, :qk_size].view(t, -1, head_dim), cos, sin)
        return qk[:, :num_heads], qk[:, num_heads:], qkv[:, qk_size:].view(t, num_kv_heads, head_dim)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedCpuOps:
    name = "fused-cpu"

    def __init__(self) -> None:
        from torch.utils.cpp_extension import load

        self._ext = load(
            name="pdserve_fused_ops",
            sources=[_SOURCE],
            # No -ffast-math, no FMA contraction: the kernels reproduce torch's roundings step by step.
            # -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers; without it, it runs serially.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        self._has_silu_mul = bool(self._ext.has_silu_mul())
        if not self._has_silu_mul:
            logger.warning("fused SiLU-and-multiply needs AVX-512 (this build has none): torch's two ops instead")

    @property
    def silu_mul_path(self) -> str:
        return "SiLU*up (AVX-512)" if self._has_silu_mul else "SiLU*up (torch)"

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds delta into x in place (x is the forward's own residual stream)."""
        return x, self._ext.add_rms_norm(x, delta, weight, eps)

    def rope_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotates q and k in place inside qkv and returns views."""
        t = qkv.shape[0]
        self._ext.rope_(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        return (
            qkv[:, :q_size].view(t, num_heads, head_dim),
            qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size :].view(t, num_kv_heads, head_dim),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """One pass over the gate/up output with an AVX-512 exp (bf16); torch's two ops otherwise."""
        if self._has_silu_mul and gate_up.dtype == torch.bfloat16:
            return self._ext.silu_mul(gate_up)
        return TorchOps.silu_mul(gate_up)


def fused_cpu_ops() -> FusedCpuOps | None:
    """The fused ops if the extension builds here (a C++ compiler is needed), else None."""
    try:
        return FusedCpuOps()
    except Exception as e:  # noqa: BLE001 - no compiler, or it failed: the torch ops still work
        logger.warning("fused CPU ops unavailable (%s); using plain torch ops", e)
        return None

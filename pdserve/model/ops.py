"""The Llama layer's small elementwise steps, in two implementations with the same results:

- `TorchOps`: plain torch, any device and dtype: the reference.
- `FusedCpuOps`: a C++ extension (`csrc/fused_ops.cpp`) that does each step in one call. On CPU a
  decode step at small batch is dominated by per-op dispatch (30 layers x ~40 torch ops); its calls
  (add + RMSNorm, RoPE on q and k in place, SiLU-and-multiply) replace ~16 ops per layer. They reproduce
  the torch sequence's bf16 roundings, so outputs agree bit for bit except for rare 1-ulp differences
  where RMSNorm sums in another order or SiLU's exp (its own, AVX-512 or AVX2) differs from torch's in the last
  float32 bit on a bf16 rounding boundary (none in 3.3M random elements).

Which is faster depends on the host and the row count, so the engine times both on the model's shapes
(`choose_ops`, autotune's timing and cache) and uses the faster per op and row bucket (`MeasuredOps`).

The residual stream is passed as (x, delta): a layer returns its last projection without adding it, and
the next layer's first norm adds it (`add_rms_norm`), so the add and the norm are one call.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdserve.model import autotune

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
        from pdserve.extensions import load_extension

        self._ext = load_extension(
            "pdserve_fused_ops",
            [_SOURCE],
            # No -ffast-math, no FMA contraction: the kernels reproduce torch's roundings step by step.
            # -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers; without it, it runs serially.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"],
        )
        self._has_silu_mul = bool(self._ext.has_silu_mul())
        if not self._has_silu_mul:
            logger.warning("fused SiLU-and-multiply needs AVX-512 or AVX2 (this build has neither): torch's two ops instead")

    @property
    def silu_mul_path(self) -> str:
        return "SiLU*up (vector exp)" if self._has_silu_mul else "SiLU*up (torch)"

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds delta into x in place (x is the forward's own residual stream)."""
        return x, self._ext.add_rms_norm(x, delta, weight, eps)

    def rope_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotates q and k in place inside qkv and returns views (made in C++: cheaper than from Python)."""
        return self._ext.rope_qkv_(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """One pass over the gate/up output with a vector exp (bf16, AVX-512 or AVX2); torch's two ops otherwise."""
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


# --- choice by measurement ----------------------------------------------------------------------------

OPS_ROWS: tuple[int, ...] = (1, 8, 64, 512)  # row counts (tokens per step) the two implementations are timed at
OP_NAMES = ("add_rms_norm", "rope_qkv", "silu_mul")


class MeasuredOps:
    """Per op and row bucket, whichever of `FusedCpuOps` and `TorchOps` measured faster (`measure_ops`).
    Both are row-wise (a row's result never depends on the others), so a step uses one implementation
    per op for all its rows; the choice is one bisect on the row count per call."""

    name = "measured"

    def __init__(self, fused: FusedCpuOps, table: autotune.TuneTable) -> None:
        impls = {"fused-cpu": fused, "torch": TorchOps()}
        self._buckets = table.buckets
        self._picks = {op: [impls[c] for c in table.winners(op)] for op in OP_NAMES}

    def _impl(self, op: str, rows: int) -> TorchOps | FusedCpuOps:
        return self._picks[op][autotune.bucket_index(rows, self._buckets)]

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._impl("add_rms_norm", x.shape[0]).add_rms_norm(x, delta, weight, eps)

    def rope_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._impl("rope_qkv", qkv.shape[0]).rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._impl("silu_mul", gate_up.shape[0]).silu_mul(gate_up)


@torch.inference_mode()
def measure_ops(
    fused: FusedCpuOps,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate: int,
    layers: int,
    rows: Sequence[int] = OPS_ROWS,
    repeats: int = 3,
    timer: autotune.Timer = time.perf_counter,
) -> autotune.TuneTable:
    """Seconds per forward (`layers` times each op, bf16, the model's shapes) of each implementation at
    each row count, through `autotune.tune`. The fused ops work in place; their inputs only drift
    (a growing residual, rotated q/k), which changes no timing."""
    impls: dict[str, TorchOps | FusedCpuOps] = {"fused-cpu": fused, "torch": TorchOps()}
    gen = torch.Generator().manual_seed(0)
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim

    def prepare(name: str):  # type: ignore[no-untyped-def]
        ops = impls[name]

        def pass_for(n: int) -> autotune.Pass:
            x = torch.randn(n, hidden, generator=gen).bfloat16()
            delta = torch.randn(n, hidden, generator=gen).bfloat16() * 1e-3
            weight = torch.ones(hidden).bfloat16()
            qkv = torch.randn(n, qkv_width, generator=gen).bfloat16()
            angles = torch.rand(n, 1, head_dim, generator=gen)
            cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
            gate_up = torch.randn(n, 2 * intermediate, generator=gen).bfloat16()
            calls: list = []
            for _ in range(layers):
                calls += [
                    ("add_rms_norm", lambda: ops.add_rms_norm(x, delta, weight, 1e-5)),
                    ("rope_qkv", lambda: ops.rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)),
                    ("silu_mul", lambda: ops.silu_mul(gate_up)),
                ]
            return calls

        return pass_for

    return autotune.tune(list(impls), prepare, OP_NAMES, rows, repeats=repeats, timer=timer, give_up=float("inf"))


def ops_key(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, layers: int) -> dict:
    """What the ops table depends on: host, torch, threads, the model's shapes and the fused source."""
    cpu, flags = autotune.cpu_info()
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return {
        "cpu": cpu, "flags": list(flags), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "shapes": [hidden, num_heads, num_kv_heads, head_dim, intermediate, layers], "rows": list(OPS_ROWS),
        "candidates": ["fused-cpu", "torch"], "pdserve_kernel": digest,
    }


def choose_ops(
    fused: FusedCpuOps,
    shapes: tuple[int, int, int, int, int, int],
    *,
    batch_invariant: bool = False,
    cache_dir: str | None = None,
    timer: autotune.Timer = time.perf_counter,
) -> TorchOps | FusedCpuOps | MeasuredOps:
    """The fused ops, the torch ops, or a per-bucket mix, as measured on `shapes` (hidden, heads, kv
    heads, head_dim, intermediate, layers) or read from the cache; logs the table. `batch_invariant`
    keeps the fused ops at every row count without measuring: the two agree except for rare 1-ulp
    differences, and a request's rows must not change with the batch's size."""
    if batch_invariant:
        return fused
    key = ops_key(*shapes)
    path = autotune.cache_path(cache_dir, "ops", key) if cache_dir else None
    table = autotune.load_cached(path, key) if path else None
    hit = table is not None
    if table is None:
        t0 = time.perf_counter()
        table = measure_ops(fused, *shapes, timer=timer)
        logger.info("fused CPU ops measured in %.1f s", time.perf_counter() - t0)
        if table.noise > autotune.NOISY:
            logger.warning("the machine looked busy while timing the fused ops (median %.1fx the best); using the "
                           "choice for this run only, not caching it", table.noise)
        elif path:
            autotune.save_cached(path, key, table)
    winners = {c for op in OP_NAMES for c in table.winners(op)}
    ops: TorchOps | FusedCpuOps | MeasuredOps
    ops = fused if winners == {"fused-cpu"} else TorchOps() if winners == {"torch"} else MeasuredOps(fused, table)
    src = f"cached {path}" if hit else "measured"
    logger.info("elementwise ops by row count (%s): %s; ms per forward:\n%s", src, ops.name,
                autotune.format_table(table))
    return ops

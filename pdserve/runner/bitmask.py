"""Structured outputs' token masks in the sampler: the rows under a grammar and their packed bits
(`BatchRequest.allowed`, llguidance's layout: bit t % 32 of 32-bit word t // 32 allows token t), applied
by torch's ops or by the C++ kernels of `csrc/bitmask.cpp`, whichever measured faster at engine start.

torch: each byte of the mask is looked up in a 256 x 8 table of 0 / -inf (one pass where `masked_fill`
and `where` over a bool mask took 3.5-5 ms at 64 rows of SmolLM2's vocabulary on host G), the row is
widened to float32 and the table row added, then the argmax: four passes over [rows, vocab] float32.
C++ (AVX-512): one pass over the logits as they are, 16 tokens per mask register straight from the bits.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "bitmask.cpp")

# Byte value -> its 8 tokens' additive mask (bit j of the byte: token j of the 8 allowed -> 0, else -inf).
_BYTE_MASKS = torch.where(
    torch.tensor(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"), dtype=torch.bool),
    0.0,
    float("-inf"),
)


@dataclass(frozen=True, slots=True)
class TokenMasks:
    """The rows of a step's logits that are under a grammar ([R] int64) and their masks ([R, W] int32,
    W = ceil(vocab / 32) words; tokens past the vocabulary's end are ignored)."""

    rows: torch.Tensor
    packed: torch.Tensor

    @classmethod
    def from_rows(cls, masks: Sequence[bytes | None], vocab_size: int, device: torch.device) -> TokenMasks | None:
        """From each row's packed mask or None (a row without a grammar); tokens past a shorter mask's
        end are not allowed. None when no row has a mask."""
        rows = [i for i, m in enumerate(masks) if m is not None]
        if not rows:
            return None
        nbytes = 4 * ((vocab_size + 31) // 32)
        packed = np.zeros((len(rows), nbytes), dtype=np.uint8)
        for n, i in enumerate(rows):
            m = masks[i]
            assert m is not None
            k = min(len(m), nbytes)
            packed[n, :k] = np.frombuffer(m, dtype=np.uint8, count=k)
        return cls(torch.tensor(rows, device=device), torch.from_numpy(packed.view(np.int32)).to(device))

    def bias(self, vocab_size: int) -> torch.Tensor:
        """[R, vocab] float32: 0 where a row's mask allows the token, -inf elsewhere."""
        nbytes = (vocab_size + 7) // 8
        as_bytes = self.packed.view(torch.uint8)[:, :nbytes]
        table = _BYTE_MASKS.to(self.packed.device)
        out = table.index_select(0, as_bytes.reshape(-1).long()).view(len(self.rows), nbytes * 8)
        return out if nbytes * 8 == vocab_size else out[:, :vocab_size].contiguous()


class MaskKernels:
    """How the sampler applies `TokenMasks`: the C++ kernels (`ext`) or torch's ops (`ext` None)."""

    def __init__(self, ext: Any | None = None) -> None:
        self.ext = ext

    @property
    def name(self) -> str:
        return "C++ (AVX-512)" if self.ext is not None else "torch"

    def argmax(self, logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
        """Per masked row, its best allowed token (first on ties), as greedy over -inf-masked logits;
        `logits` ([N, V], float32 or the model's 16-bit dtype) is not modified."""
        if self.ext is not None and logits.is_cpu and logits.is_contiguous():
            return self.ext.masked_argmax(logits, masks.rows, masks.packed)
        rows = logits if masks.rows.numel() == logits.shape[0] else logits.index_select(0, masks.rows)
        return rows.to(torch.float32, copy=True).add_(masks.bias(logits.shape[-1])).max(dim=-1).indices

    def apply_(self, logits: torch.Tensor, masks: TokenMasks) -> None:
        """-inf in place at every token a masked row may not take (`logits` float32, contiguous)."""
        if self.ext is not None and logits.is_cpu:
            self.ext.apply_bitmask_(logits, masks.rows, masks.packed)
        else:
            logits.index_add_(0, masks.rows, masks.bias(logits.shape[-1]))


def load_kernels() -> Any | None:
    """The C++ kernels if they build here with their AVX-512 path, else None."""
    try:
        from pdserve.extensions import load_extension

        ext = load_extension("pdserve_bitmask", [_SOURCE], ["-O3", "-march=native", "-fopenmp"], ["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - no compiler: torch's ops still work
        logger.warning("token-mask kernels unavailable (%s); torch's ops apply structured-output masks", e)
        return None
    return ext if ext.has_vec() else None


def choose_mask_kernels(vocab_size: int, dtype: torch.dtype, device: torch.device, rows: int = 32) -> MaskKernels:
    """Whichever of the C++ kernels and torch's ops takes greedy tokens under masks faster here, timed on
    `rows` rows of this vocabulary with half of each mask set (a few milliseconds)."""
    torch_ops = MaskKernels(None)
    if device.type != "cpu":
        return torch_ops
    ext = load_kernels()
    if ext is None:
        return torch_ops
    cpp = MaskKernels(ext)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab_size, generator=g).to(dtype)
    words = (vocab_size + 31) // 32
    packed = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    masks = TokenMasks(torch.arange(rows), packed)
    if not torch.equal(cpp.argmax(logits, masks), torch_ops.argmax(logits, masks)):
        logger.warning("token-mask kernels disagree with torch's ops; using torch's")
        return torch_ops

    def best_of(k: MaskKernels) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            k.argmax(logits, masks)
            times.append(time.perf_counter() - t)
        return min(times)

    t_cpp, t_torch = best_of(cpp), best_of(torch_ops)
    chosen = cpp if t_cpp < t_torch else torch_ops
    logger.info("structured-output masks: %s (%d rows x %d tokens: C++ %.2f ms, torch %.2f ms)",
                chosen.name, rows, vocab_size, 1e3 * t_cpp, 1e3 * t_torch)
    return chosen

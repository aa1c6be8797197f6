"""The sampler's three heavy ops, each by torch's ops or by the C++ kernels of `csrc/sampling.cpp`,
whichever measured faster at engine start (`choose_sampling_kernels`).

- Greedy: the argmax of each row. torch's `max(dim=-1).indices` over the bf16 logits (its `argmax` is a
  scalar loop) took 8.7 ms at 96 rows of Qwen2.5's 151,936 tokens on host H; C++: one vector pass over
  the rows as they are, 2.0 ms there.

- Structured outputs' token masks: the rows under a grammar and their packed bits (`TokenMasks`, from
  `BatchRequest.allowed`: llguidance's layout, bit t % 32 of 32-bit word t // 32 allows token t). torch:
  each byte is looked up in a 256 x 8 table of 0 / -inf (one pass where `masked_fill` and `where` over a
  bool mask took 3.5-5 ms at 64 rows of SmolLM2's vocabulary on host G), the row widened to float32 and
  the table row added, then the argmax: four passes over [rows, vocab] float32. C++ (AVX-512, or AVX2 +
  FMA on CPUs without it): one pass over the logits as they are, 16 (8) tokens per vector, the lanes
  straight from the bits.
- Temperature draws by inverse CDF, one uniform number per row (so a seeded row's draw depends only on
  its own generator): torch's softmax, cumsum and searchsorted write [rows, vocab] float32 tensors
  (11 ms at 64 rows of SmolLM2's vocabulary on host G, 60 ms at Qwen2.5's); C++: the row's max, the sum
  of exp((x - max) / T) per block of tokens, and the running sum over the blocks and inside the one
  block where it passes u x that sum, with no tensor of the row's size.
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

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "sampling.cpp")

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


ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2"}


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row in torch, first index on ties (as `argmax`). torch's CPU `argmax` over a
    vocabulary row is a scalar loop: 6.6 ms for 96 x 49,152 float32 logits on one core against 2.2 ms for
    `max(dim).indices`, which returns the same index (tests/unit/test_sampler.py holds them equal on ties
    and NaNs). `SamplingKernels.greedy` uses this or the C++ pass, whichever measured faster."""
    return logits.max(dim=-1).indices


class SamplingKernels:
    """How the sampler applies `TokenMasks` and draws temperature samples: per op, torch's ops (None) or
    the C++ kernels of `ext` in one of its instruction sets (`ext.isas()`: "avx512", "avx2"); by default
    the widest the build has. `choose_sampling_kernels` sets them by measurement."""

    def __init__(
        self, ext: Any | None = None, masks: str | None = "widest", draws: str | None = "widest",
        greedy: str | None = "widest",
    ) -> None:
        self.ext = ext
        have: list[str] = list(ext.isas()) if ext is not None else []

        def pick(isa: str | None) -> str | None:
            if isa == "widest":
                return have[0] if have else None
            if isa is not None and isa not in have:
                raise ValueError(f"no {isa} sampling kernels in this build (it has {have or 'none'})")
            return isa

        self.masks_isa = pick(masks)
        self.draws_isa = pick(draws)
        self.greedy_isa = pick(greedy)

    @property
    def masks_in_cpp(self) -> bool:
        return self.masks_isa is not None

    @property
    def draws_in_cpp(self) -> bool:
        return self.draws_isa is not None

    @property
    def name(self) -> str:
        def which(isa: str | None) -> str:
            return f"C++ ({ISA_NAMES[isa]})" if isa else "torch"

        return (f"greedy {which(self.greedy_isa)}, masks {which(self.masks_isa)}, "
                f"temperature draws {which(self.draws_isa)}")

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The argmax of each row of `logits` ([N, V], float32 or the model's 16-bit dtype), first index on
        ties, the first NaN where a row has one: `greedy` (torch) or one C++ pass over the rows as they are."""
        if self.greedy_isa and logits.is_cpu and logits.is_contiguous() and logits.dim() == 2:
            return self.ext.argmax(logits, self.greedy_isa)
        return greedy(logits)

    def argmax(self, logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
        """Per masked row, its best allowed token (first on ties), as greedy over -inf-masked logits;
        `logits` ([N, V], float32 or the model's 16-bit dtype) is not modified."""
        if self.masks_isa and logits.is_cpu and logits.is_contiguous():
            return self.ext.masked_argmax(logits, masks.rows, masks.packed, self.masks_isa)
        rows = logits if masks.rows.numel() == logits.shape[0] else logits.index_select(0, masks.rows)
        return rows.to(torch.float32, copy=True).add_(masks.bias(logits.shape[-1])).max(dim=-1).indices

    def apply_(self, logits: torch.Tensor, masks: TokenMasks) -> None:
        """-inf in place at every token a masked row may not take (`logits` float32, contiguous)."""
        if self.masks_isa and logits.is_cpu and logits.is_contiguous():
            self.ext.apply_bitmask_(logits, masks.rows, masks.packed, self.masks_isa)
        else:
            logits.index_add_(0, masks.rows, masks.bias(logits.shape[-1]))

    def draw(self, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row from softmax(row / temperature) by inverse CDF with the row's uniform number
        u (the token whose running probability first exceeds u): torch's softmax, cumsum and
        searchsorted, or one C++ pass that keeps no [rows, vocab] tensor. Rows of temperature 0 get a
        draw at temperature 1 (the caller keeps their argmax)."""
        t = torch.where(temperature == 0.0, 1.0, temperature)
        if self.draws_isa and logits.is_cpu and logits.is_contiguous():
            return self.ext.sample_temperature(logits, t.contiguous(), u.reshape(-1).contiguous(), self.draws_isa)
        probs = torch.softmax(logits.to(torch.float32) / t.unsqueeze(-1), dim=-1)
        return inverse_cdf(probs, u)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative (unnormalised) probability exceeds u x the row's total;
    strict ">" never picks a zero-probability token."""
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u.reshape(-1, 1) * cdf[:, -1:], right=True)
    return idx.clamp_max_(probs.shape[-1] - 1).squeeze(-1)


def load_kernels() -> Any | None:
    """The C++ kernels if they build here with an AVX-512 or AVX2 + FMA path, else None."""
    try:
        from pdserve.extensions import load_extension

        ext = load_extension("pdserve_sampling", [_SOURCE], ["-O3", "-march=native", "-fopenmp"], ["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - no compiler: torch's ops still work
        logger.warning("sampling kernels unavailable (%s); torch's ops mask and draw", e)
        return None
    return ext if ext.isas() else None


def choose_sampling_kernels(
    vocab_size: int, dtype: torch.dtype, device: torch.device, rows: int = 32, ext: Any | None = None
) -> SamplingKernels:
    """Per op, the fastest of torch's ops and the C++ kernels in each instruction set this build has,
    timed on `rows` rows of this vocabulary (masks: greedy under masks with half of each mask set; draws:
    temperature 1 from the model's dtype), after checking each kernel's answers (a few milliseconds at
    engine start). `ext`: the kernels to weigh (default `load_kernels()`)."""
    if device.type != "cpu":
        return SamplingKernels(None)
    ext = ext or load_kernels()
    if ext is None:
        return SamplingKernels(None)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab_size, generator=g).to(dtype)
    words = (vocab_size + 31) // 32
    packed = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    masks = TokenMasks(torch.arange(rows), packed)
    temperature = torch.ones(rows)
    u = torch.rand(rows, generator=g)
    peaked = logits.clone()
    peaked[torch.arange(rows), torch.arange(rows) % vocab_size] = 100.0  # the draw must take this token
    ref = SamplingKernels(None)
    want = ref.argmax(logits, masks)

    def best_of(f: Any) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)

    t_greedy: dict[str | None, float] = {None: best_of(lambda: ref.greedy(logits))}
    want_greedy = ref.greedy(logits)
    t_masks: dict[str | None, float] = {None: best_of(lambda: ref.argmax(logits, masks))}
    t_draws: dict[str | None, float] = {None: best_of(lambda: ref.draw(logits, temperature, u))}
    for isa in ext.isas():
        k = SamplingKernels(ext, isa, isa, isa)
        if torch.equal(k.greedy(logits), want_greedy):
            t_greedy[isa] = best_of(lambda: k.greedy(logits))
        else:
            logger.warning("the %s argmax kernel disagrees with torch's max; not used", isa)
        if torch.equal(k.argmax(logits, masks), want):
            t_masks[isa] = best_of(lambda: k.argmax(logits, masks))
        else:
            logger.warning("the %s mask kernel disagrees with torch's ops; not used", isa)
        if torch.equal(k.draw(peaked, temperature, u), torch.arange(rows) % vocab_size):
            t_draws[isa] = best_of(lambda: k.draw(logits, temperature, u))
        else:
            logger.warning("the %s draw kernel disagrees with torch's ops; not used", isa)
    chosen = SamplingKernels(ext, min(t_masks, key=t_masks.__getitem__), min(t_draws, key=t_draws.__getitem__),
                             min(t_greedy, key=t_greedy.__getitem__))

    def table(times: dict[str | None, float]) -> str:
        return ", ".join(f"{ISA_NAMES[k] if k else 'torch'} {1e3 * t:.2f}" for k, t in times.items())

    logger.info("sampling: %s (%d rows x %d tokens, ms: greedy %s; masked greedy %s; temperature draw %s)",
                chosen.name, rows, vocab_size, table(t_greedy), table(t_masks), table(t_draws))
    return chosen

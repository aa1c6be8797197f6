"""An online model of how long one engine step takes, fitted from the steps the engine measures.

    step time ~= base + per_prefill_token * prefill_tokens + per_decode_seq * decode_seqs
                 + per_context_token * context_tokens

`context_tokens` is the sum, over the step's requests, of the tokens their attention reads (computed
ones plus this step's), as in `StepRecord.num_context_tokens`. The `slo` policy asks it how many prompt
tokens fit beside the running decodes under an inter-token-latency target.

Fit: least squares with exponential forgetting (each new step counts 1, the one before `forgetting`, ...),
kept as the 4x4 normal equations so `observe` is O(1); they are solved every `refit_interval` steps.
Before the data says anything the coefficients are the prior: it enters as `prior_weight` pseudo-steps
that pin each coefficient to its prior value, scaled to the typical size of its feature so the pull is
the same whatever the units. A feature that never varies (no prompt ever seen) therefore keeps its prior
coefficient, and forgetting, which scales old data and prior alike, never washes out what was learned.
Coefficients are non-negative (a step never gets faster with more work): the solve is an exact
non-negative least squares over the 16 subsets of active coefficients, which is cheap at size 4.
Pure Python plus numpy, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

TERMS = ("base", "prefill_token", "decode_seq", "context_token")

# Seconds: base, per prefill token, per decode sequence, per context token. The bundled SmolLM2-135M in
# bf16 on this repo's 2-core CPU (README): ~13 ms at batch 1, ~2,200 prompt tok/s, ~0.9 ms per extra
# decode at ~300 tokens of context. Only a starting point: a few dozen steps replace it.
DEFAULT_PRIOR = (0.010, 0.00045, 0.0005, 0.000002)


class StepTimeModel:
    def __init__(
        self,
        prior: Sequence[float] = DEFAULT_PRIOR,
        *,
        prior_weight: float = 1.0,
        forgetting: float = 0.99,
        refit_interval: int = 8,
    ) -> None:
        """`prior`: the four coefficients in seconds (see `TERMS`), used until data replaces them.
        `prior_weight`: how many steps' worth of evidence the prior is worth. `forgetting` in (0, 1]:
        weight of a step one step older (0.99: the last ~100 steps dominate)."""
        if len(prior) != len(TERMS) or any(not math.isfinite(p) or p < 0 for p in prior):
            raise ValueError(f"prior must be {len(TERMS)} finite non-negative coefficients, got {prior!r}")
        if not prior_weight > 0:
            raise ValueError("prior_weight must be > 0")
        if not 0 < forgetting <= 1:
            raise ValueError("forgetting must be in (0, 1]")
        if refit_interval < 1:
            raise ValueError("refit_interval must be >= 1")
        self.prior = tuple(float(p) for p in prior)
        self.prior_weight = prior_weight
        self.forgetting = forgetting
        self.refit_interval = refit_interval
        self._xtx = np.zeros((4, 4))  # sum of weight * x x^T
        self._xty = np.zeros(4)  # sum of weight * x * time
        self._weight = 0.0  # sum of weights: the effective number of steps
        self._coef = self.prior
        self.num_observations = 0
        self.last_predicted: float | None = None  # for the last observed step, before it was learned
        self.last_measured: float | None = None

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """Seconds: base, per prefill token, per decode sequence, per context token (see `TERMS`)."""
        return self._coef  # type: ignore[return-value]

    def predict(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Predicted duration in seconds of a step of this shape."""
        a, b, c, d = self._coef
        return a + b * prefill_tokens + c * decode_seqs + d * context_tokens

    def observe(self, duration: float, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> None:
        """Learn from one measured step (seconds). Steps with no work or a non-finite time are ignored."""
        if not (math.isfinite(duration) and duration >= 0) or prefill_tokens + decode_seqs <= 0:
            return
        self.last_predicted = self.predict(prefill_tokens, decode_seqs, context_tokens)
        self.last_measured = duration
        x = np.array((1.0, prefill_tokens, decode_seqs, context_tokens))
        lam = self.forgetting
        self._xtx *= lam
        self._xtx += np.outer(x, x)
        self._xty *= lam
        self._xty += duration * x
        self._weight = self._weight * lam + 1.0
        self.num_observations += 1
        if self.num_observations % self.refit_interval == 0:
            self.refit()

    def refit(self) -> None:
        """Solve the normal equations now (`observe` does it every `refit_interval` steps)."""
        if self._weight <= 0:
            return
        prior = np.array(self.prior)
        mean_sq = np.diag(self._xtx) / self._weight  # typical squared size of each feature
        # Each coefficient is pinned to its prior by `prior_weight` pseudo-steps at that typical size.
        # (1e-30: a feature that was always 0 decouples and keeps its prior exactly.)
        pin = self.prior_weight * np.maximum(mean_sq, 1e-30)
        h = self._xtx + np.diag(pin)
        g = self._xty + pin * prior
        coef = _nonnegative_quadratic_min(h, g)
        self._coef = tuple(float(v) for v in coef)


def _nonnegative_quadratic_min(h: np.ndarray, g: np.ndarray) -> np.ndarray:
    """argmin over theta >= 0 of theta^T h theta - 2 g^T theta, for symmetric positive definite `h`.

    The minimum is the unconstrained minimum over its support; every support's restricted minimum that is
    feasible is a candidate, so the best candidate is exact. At size 4 that is at most 15 small solves."""
    n = len(g)
    scale = 1.0 / np.sqrt(np.diag(h))  # Jacobi scaling: features differ by orders of magnitude
    hs = h * scale[:, None] * scale[None, :]
    gs = g * scale
    full = np.linalg.solve(hs, gs)
    if (full >= 0).all():
        return full * scale
    best = np.zeros(n)
    best_value = 0.0  # theta = 0
    for mask in range(1, (1 << n) - 1):
        idx = [i for i in range(n) if mask >> i & 1]
        sub = np.linalg.solve(hs[np.ix_(idx, idx)], gs[idx])
        if (sub < 0).any():
            continue
        value = -float(gs[idx] @ sub)  # at a restricted minimum theta^T h theta = g^T theta
        if value < best_value:
            best_value = value
            best = np.zeros(n)
            best[idx] = sub
    return best * scale

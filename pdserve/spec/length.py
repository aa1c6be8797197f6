"""How many drafts each request gets next step: from its measured acceptance, and none once the step is
large enough to be compute-bound (verifying k more tokens per request then costs about k more tokens)."""

from __future__ import annotations

import math


class SpecLengthController:
    """Per request, an estimate of the chance `a` that one draft is accepted given the ones before it
    were. A step with k drafts accepting m of them saw m acceptances and, when m < k, one rejection; `a`
    is EMA(accepted) / (EMA(accepted) + EMA(rejections)), the geometric model's estimate. The k-th
    draft of a step is accepted with probability about a**k, so a request gets the largest k (at most
    `max_tokens`) with a**k >= threshold, and at least 1 so its estimate can recover.

    threshold = max(min_acceptance, draft_cost): `draft_cost` is a draft step's time in target steps
    (0 for n-gram lookups; a draft model's own forward otherwise). The k-th draft yields a**k expected
    tokens for that cost, and plain decoding yields one token per target step, so a draft below
    a**k = draft_cost slows the request down even when verification is free."""

    def __init__(
        self,
        max_tokens: int,
        *,
        ema: float = 0.3,
        min_acceptance: float = 0.25,
        adaptive: bool = True,
        draft_cost: float = 0.0,
    ) -> None:
        self.max_tokens = max_tokens
        self.threshold = max(min_acceptance, draft_cost)
        self.ema = ema
        self.min_acceptance = min_acceptance
        self.adaptive = adaptive
        self._stats: dict[str, tuple[float, float]] = {}  # req_id -> (EMA accepted, EMA rejections)

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        acc, rej = self._stats.get(req_id, (1.0, 0.0))  # optimistic start: full length first
        w = self.ema
        rejected = 1.0 if num_accepted < num_drafts else 0.0
        self._stats[req_id] = ((1 - w) * acc + w * num_accepted, (1 - w) * rej + w * rejected)

    def acceptance(self, req_id: str) -> float:
        acc, rej = self._stats.get(req_id, (1.0, 0.0))
        return acc / (acc + rej) if acc + rej > 0 else 0.0

    def length(self, req_id: str) -> int:
        if not self.adaptive:
            return self.max_tokens
        a = self.acceptance(req_id)
        if a >= 1.0:
            return self.max_tokens
        if a <= 0.0:
            return 1
        k = math.floor(math.log(self.threshold) / math.log(a))
        return max(1, min(self.max_tokens, k))

    def release(self, req_id: str) -> None:
        self._stats.pop(req_id, None)

"""How many drafts each request gets next step.

`SpecLengthController` keeps each request's measured acceptance and its acceptance-only length (today's
rule, also the upper bound of the slack rule). `choose_lengths` is the slack rule: given the step-time
model's cost of a verified draft token and every request's latency budgets for the next step (its own
ITL target, which the whole step must fit, and its own TPOT slack, which bounds its own drafts), it
picks the lengths that maximize expected tokens per second of the step (0 for all once the batch is
compute-bound, fewer when the step's tightest ITL is at risk, fewer for a request behind its TPOT).
`choose_lengths_by_cost` is the cost rule, for every other policy: the same goodput, priced by the
models' own measured kernel tables (`RowCurve`: a forward's projections at n query rows, target and
draft model) plus the measured rest of the step, with no latency targets.
`SpeculativeExecutor` calls them."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass


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


@dataclass(frozen=True, slots=True)
class StepCost:
    """The next step's time as the step-time model sees it: `base` seconds with no drafts, plus
    `per_token` seconds for every draft token it verifies (a verified draft is one more decode token)."""

    base: float
    per_token: float


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step yields for a request with k drafts under the geometric model (each draft accepted
    with probability a given the ones before it were, plus the token the step always samples):
    1 + a + ... + a**k = (1 - a**(k+1)) / (1 - a)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_lengths(
    caps: Sequence[int],
    acceptances: Sequence[float],
    cost: StepCost,
    step_budgets: Sequence[float | None],
    own_budgets: Sequence[float | None] | None = None,
) -> list[int]:
    """Each request's drafts for the next step, k_i in 0..caps[i], maximizing the step's goodput

        sum_i expected_tokens(a_i, k_i) / (cost.base + cost.per_token * sum_i k_i)

    subject to two kinds of per-request budget (seconds; None: no target):
    - `step_budgets[i]`: the longest step request i tolerates from anyone's drafts (its ITL target: every
      request of the step waits for the whole step), so the step must fit the smallest;
    - `own_budgets[i]`: the longest step request i's *own* drafts may make, `base + per_token * k_i`
      (its TPOT slack: a request behind its TPOT bets none of it on drafts; one with slack may).
    Pure; `docs/speculative.md` ("Speculation length from latency slack") has the derivation. The j-th
    draft of request i adds a_i**j expected tokens for `per_token` seconds and these gains shrink with j,
    so the best allocation of K draft tokens takes the K largest gains over all requests (an own budget
    only shortens request i's list of gains); goodput rises with K while the next gain g satisfies
    g > per_token * goodput, and once it does not it never will again (sorted gains fall, goodput stays
    above g / per_token), so adding gains in order and stopping there is exact. A budget below `base`
    (at risk even without drafts) allows none: for everyone (a step budget) or for that request (own)."""
    n = len(caps)
    caps = [_own_cap(cap, b, cost) for cap, b in zip(caps, own_budgets or [None] * n)]
    budgets = [b for b in step_budgets if b is not None]
    max_total = sum(caps)
    if budgets:
        room = min(budgets) - cost.base
        if room <= 0:
            return [0] * n
        if cost.per_token > 0:
            max_total = min(max_total, math.floor(room / cost.per_token))
    # (gain of request i's j-th draft, i), best first
    gains = [(min(a, 1.0) ** j, i) for i, (cap, a) in enumerate(zip(caps, acceptances)) for j in range(1, cap + 1)]
    gains.sort(key=lambda g: -g[0])
    lengths = [0] * n
    tokens, step_time = float(n), cost.base
    for gain, i in gains[:max_total]:
        if gain <= 0.0 or gain * step_time <= cost.per_token * tokens:  # g <= per_token * goodput
            break
        lengths[i] += 1
        tokens += gain
        step_time += cost.per_token
    return lengths


def _own_cap(cap: int, own_budget: float | None, cost: StepCost) -> int:
    """The drafts `own_budget` leaves request i: none when even the draft-free step passes it."""
    if own_budget is None:
        return cap
    room = own_budget - cost.base
    if room <= 0:
        return 0
    return cap if cost.per_token <= 0 else min(cap, math.floor(room / cost.per_token))


@dataclass(frozen=True, slots=True)
class RowCurve:
    """Seconds of one forward's projections and output head at n query rows: the linear autotune's
    measured full passes with the chosen kernels (`TuneTable.chosen_seconds`, each weight cold as in a
    real step), linear between its row counts and along the last segment beyond them. Flat at decode
    sizes (the weights' bytes), then rising as the GEMMs turn compute-bound: the curve says how much a
    step's extra draft rows really cost on this host."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        rows = list(self.rows)
        if len(rows) < 2 or len(rows) != len(self.seconds) or rows != sorted(set(rows)):
            raise ValueError("a RowCurve needs >= 2 increasing row counts, one time each")
        if any(not (math.isfinite(t) and t >= 0) for t in self.seconds) or self.rows[0] < 1:
            raise ValueError("a RowCurve's times must be finite and >= 0, its row counts >= 1")

    @classmethod
    def from_table(cls, buckets: Sequence[int], seconds: Sequence[float]) -> RowCurve | None:
        """From a tune table's buckets and chosen seconds; None where a time is missing (not measured)."""
        if len(buckets) < 2 or any(not math.isfinite(t) for t in seconds):
            return None
        return cls(tuple(buckets), tuple(seconds))

    def __call__(self, n: float) -> float:
        if n <= 0:
            return 0.0
        r, t = self.rows, self.seconds
        if n <= r[0]:
            return t[0]
        i = min(bisect_left(r, n), len(r) - 1)  # the segment [r[i-1], r[i]] holds n (or extends past r[-1])
        slope = (t[i] - t[i - 1]) / (r[i] - r[i - 1])
        return max(0.0, t[i - 1] + slope * (n - r[i - 1]))


class ResidualFit:
    """What a step takes beyond its projections' curve, as `a + b * rows` seconds: attention over the
    extra query rows, the elementwise ops, the output head's softmax and the verification grow with the
    rows (b), the loop's fixed work does not (a). Least squares over the steps seen, each older step
    weighted `forgetting` times less; both coefficients kept >= 0. Until the rows have varied (a spread of
    under one row) it is the weighted mean with b = 0."""

    def __init__(self, forgetting: float = 0.95) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        self.forgetting = forgetting
        self._w = self._x = self._xx = self._y = self._xy = 0.0
        self.num_observations = 0

    def observe(self, rows: int, seconds: float) -> None:
        if not (math.isfinite(seconds) and rows > 0):
            return
        f = self.forgetting
        self._w = f * self._w + 1.0
        self._x = f * self._x + rows
        self._xx = f * self._xx + rows * rows
        self._y = f * self._y + seconds
        self._xy = f * self._xy + rows * seconds
        self.num_observations += 1

    @property
    def coefficients(self) -> tuple[float, float]:
        """(a, b): seconds per step and per query row."""
        if self._w <= 0.0:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < 1.0:
            return max(0.0, my), 0.0
        b = max(0.0, (self._xy / self._w - mx * my) / var)
        a = my - b * mx
        if a < 0.0:  # through the origin instead
            return 0.0, max(0.0, self._xy / self._xx)
        return a, b

    def __call__(self, rows: int) -> float:
        a, b = self.coefficients
        return a + b * rows


def choose_lengths_by_cost(
    caps: Sequence[int],
    acceptances: Sequence[float],
    *,
    rows: int,
    target: RowCurve,
    overhead: float,
    per_row: float = 0.0,
    draft: RowCurve | None = None,
    draft_overhead: float = 0.0,
    first_costs: Sequence[float] | None = None,
) -> list[int]:
    """Each request's drafts for the next step, k_i in 0..caps[i] (caps[i] 0: the request does not run
    again), maximizing expected tokens per second

        sum_i expected_tokens(a_i, k_i) / (overhead + per_row (rows + K) + target(rows + K) + draft part)

    with K = sum_i k_i, where `rows` is the next step's query rows without drafts (its decodes and prompt
    chunks), `target` the target model's projections at that many rows, `overhead + per_row * rows` the
    rest of a step (`ResidualFit`: attention, elementwise ops, sampling, the loop) and, for a draft
    model, the draft part sum_j (draft_overhead + draft(n_j)) over its sequential forwards j = 1..max k_i,
    n_j being the requests drafting at least j tokens (none when K = 0), plus `first_costs[i]` (seconds)
    when request i drafts at all: what its draft has to catch up first, e.g. its prompt, as the caller
    prices it. Pure; one pass over the sum(caps) candidate drafts after a sort.

    The j-th draft of request i adds a_i**j expected tokens; the allocations tried are the prefixes of
    all drafts sorted by that gain (for any K the K largest gains are the best for the target's part)
    and the best one wins, the empty one included: where the curve has turned compute-bound, or a draft
    model's forwards cost more than the tokens they buy, every length is 0. (Exact without first costs,
    tested against exhaustive search; a request with a first cost joins only if its whole length,
    catch-up included, raises the rate where its first draft comes up, else it sits the step out.)"""
    n = len(caps)
    acc = [min(max(a, 0.0), 1.0) for a in acceptances]
    gains = sorted(
        ((acc[i] ** j, j, i) for i, cap in enumerate(caps) for j in range(1, cap + 1)),
        key=lambda g: (-g[0], g[1], g[2]),
    )
    tokens = float(sum(1 for c in caps if c > 0))

    def target_step(k: int) -> float:
        return overhead + per_row * (rows + k) + target(rows + k)

    base = target_step(0)
    best_rate = tokens / base if base > 0 else math.inf
    drafting = [0] * (max(caps, default=0) + 1)  # n_j: requests with at least j drafts
    draft_time = 0.0
    taken: list[int] = []  # the request of each draft added, in order
    best_k, skipped = 0, set()

    def draft_step(j: int) -> float:  # what one more request drafting a j-th token adds to the draft
        if draft is None:
            return 0.0
        nj = drafting[j]
        return draft(nj + 1) - draft(nj) + (draft_overhead if nj == 0 else 0.0)

    for gain, j, i in gains:
        if gain <= 0.0:
            break
        if i in skipped:
            continue
        first = first_costs[i] if first_costs is not None and j == 1 else 0.0
        if first > 0.0:  # a catch-up is all or nothing: worth it only with the request's whole length
            k = len(taken)
            step = target_step(k) + draft_time
            extra_t = first + target_step(k + caps[i]) - target_step(k)
            extra_t += sum(draft_step(jj) for jj in range(1, caps[i] + 1))
            extra = sum(acc[i] ** jj for jj in range(1, caps[i] + 1))
            if (tokens + extra) * step <= tokens * (step + extra_t):
                skipped.add(i)
                continue
        tokens += gain
        draft_time += draft_step(j) + first
        drafting[j] += 1
        taken.append(i)
        step = target_step(len(taken)) + draft_time
        rate = tokens / step if step > 0 else math.inf
        if rate > best_rate:
            best_rate, best_k = rate, len(taken)
    lengths = [0] * n
    for i in taken[:best_k]:
        lengths[i] += 1
    return lengths

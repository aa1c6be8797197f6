"""An executor that speculates: it runs the wrapped executor's step (which verifies the drafts the step
carries), then picks each request's next speculation length (`pdserve.spec.length`) and proposes that
many drafts for every request that sampled."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.batch import ModelOutput
from pdserve.config import SpeculativeConfig
from pdserve.engine.executor import Executor
from pdserve.request import Request
from pdserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.spec.length import (
    ResidualFit,
    RowCurve,
    SpecLengthController,
    StepCost,
    choose_lengths,
    choose_lengths_by_cost,
    expected_tokens,
)
from pdserve.spec.ngram import NgramProposer
from pdserve.spec.proposer import DraftRequest, Proposer
from pdserve.spec.stats import SpecDecodeStats


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for speculative method {config.method!r}")


# The acceptance rule's compute-bound caps when the config sets none and no cost curve is known
# (requests, tokens per step).
ACCEPTANCE_RULE_CAPS = (32, 512)
OVERHEAD_EMA = 0.2  # weight of the newest draft forward in the estimate of its time outside the curve


class SpeculativeExecutor:
    """`inner` verifies; this wrapper proposes. The scheduler still caps each request's drafts (none past
    max_tokens or the context length) and fits them into the step's token budget.

    Lengths: each request's acceptance-only length (`SpecLengthController`), then, where the slack rule
    runs (`length_rule` "slack", adaptive, and a `step_model` given), `choose_lengths` over the whole
    step with the model's cost of a verified draft token and each request's latency budget; elsewhere,
    given the target's measured `target_curve` (adaptive, no fixed caps in the config), the cost rule
    `choose_lengths_by_cost` over the whole step: the curves price the extra rows of the target's
    verification and of the draft model's forwards (`draft_curve`), and what the curves leave out of a
    step (attention, elementwise ops, sampling, the loop) is measured here: a fit of each decode step's
    wall time minus its curve time against its rows (`ResidualFit`), and for the draft an EMA per
    forward. Without a curve: the fixed caps."""

    def __init__(
        self,
        inner: Executor,
        config: SpeculativeConfig,
        proposer: Proposer | None = None,
        draft_cost: float = 0.0,
        *,
        step_model: StepTimeModel | None = None,
        itl_target: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        target_curve: RowCurve | None = None,
        draft_curve: RowCurve | None = None,
    ) -> None:
        """`draft_cost`: one proposal step's time in target steps (a draft model's; see SpecLengthController).
        `step_model`: the scheduler's (`Scheduler.step_model`, the `slo` policy's), None without one;
        `itl_target`: the longest step (seconds) a request without its own `slo_itl_ms` tolerates, None
        for none; `clock`: that of `Request.first_token_time`, for TPOT budgets. `target_curve`,
        `draft_curve`: the models' projections by row count (`RowCurve`; None where not measured)."""
        self.inner = inner
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.lengths = SpecLengthController(
            config.num_speculative_tokens,
            ema=config.acceptance_ema,
            min_acceptance=config.min_draft_acceptance,
            adaptive=config.adaptive,
            draft_cost=draft_cost,
        )
        self.stats = SpecDecodeStats()
        slack = config.length_rule == "slack" and config.adaptive and step_model is not None
        self.step_model = step_model if slack else None
        self.itl_target = itl_target
        self.tpot_target = config.slo_tpot_ms / 1e3 if config.slo_tpot_ms is not None else None
        self.clock = clock
        fixed_caps = config.disable_by_batch_size is not None or config.disable_by_num_tokens is not None
        by_cost = not slack and config.adaptive and target_curve is not None and not fixed_caps
        self.target_curve = target_curve if by_cost else None
        self.draft_curve = draft_curve if by_cost else None
        self.residual = ResidualFit()  # seconds of a decode step outside its curve, by its rows
        self.draft_overhead: float | None = None  # seconds of a draft forward outside its curve (EMA)
        default_caps = (None, None) if slack or by_cost else ACCEPTANCE_RULE_CAPS
        self.max_batch_size = config.disable_by_batch_size or default_caps[0]
        self.max_num_tokens = config.disable_by_num_tokens or default_caps[1]

    @property
    def length_rule(self) -> str:
        """The rule in force: "slack", "cost" or "acceptance" (fixed caps)."""
        if self.step_model is not None:
            return "slack"
        return "cost" if self.target_curve is not None else "acceptance"

    def execute(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None) -> ModelOutput:
        t0 = time.perf_counter()
        result = self.inner.execute(out, after_layer)
        if self.target_curve is not None and out.num_batched_tokens > 0 and out.num_prefill_tokens == 0:
            rows = out.num_batched_tokens  # decodes and drafts only: prompt chunks' rows cost otherwise
            self.residual.observe(rows, time.perf_counter() - t0 - self.target_curve(rows))
        sampling = [s for s in out.scheduled if s.samples]
        for s, tokens in zip(sampling, result.token_ids):
            k = s.num_spec_tokens
            if k:
                self.stats.observe(k, len(tokens) - 1)
                self.lengths.observe(s.req.req_id, k, len(tokens) - 1)
        if self._compute_bound(len(out.scheduled), out.num_batched_tokens):
            result.spec_token_ids = None
            return result
        lengths = [self._length(s.req) for s in sampling]
        if self.step_model is not None and sampling:
            lengths = self._slack_lengths(out, sampling, result.token_ids, lengths)
        elif self.target_curve is not None and sampling:
            lengths = self._cost_lengths(out, sampling, result.token_ids, lengths)
        self.stats.observe_lengths([k for s, k in zip(sampling, lengths) if self._continues(s.req)])
        asks = [
            DraftRequest(s.req.req_id, s.req.all_token_ids() + tokens, k)
            for s, tokens, k in zip(sampling, result.token_ids, lengths)
        ]
        t0 = time.perf_counter()
        result.spec_token_ids = self.proposer.propose(asks)
        self._observe_draft(time.perf_counter() - t0)
        return result

    def _cost_lengths(
        self,
        out: SchedulerOutput,
        sampling: list[ScheduledRequest],
        sampled: list[list[int]],
        caps: list[int],
    ) -> list[int]:
        """The cost rule. The next step is taken to be this one with every sampling request that continues
        at one decode token and every request still in its prompt at another chunk of this step's size.

        A draft model that is behind on a request (its prompt the first time; everything since it last
        drafted for it) runs those tokens before the first draft: that catch-up, priced on the draft curve
        beyond the usual 1 + accepted tokens, is paid once and buys drafts for the rest of the request,
        so it is spread over the steps the request has left (its remaining max_tokens over the tokens
        a step yields at its length). A request near its end is not worth catching up; a fresh one is."""
        assert self.target_curve is not None
        rows = sum(1 for s in sampling if self._continues(s.req))
        rows += sum(s.num_new_tokens for s in out.scheduled if not s.samples)
        acceptances = [self.lengths.acceptance(s.req.req_id) for s in sampling]
        lag = getattr(self.proposer, "lag", None)
        first_costs = None
        if lag is not None and self.draft_curve is not None:
            curve = self.draft_curve
            first_costs = []
            for s, tokens, cap, a in zip(sampling, sampled, caps, acceptances):
                behind = lag(s.req.req_id, s.req.num_tokens + len(tokens)) - (cap + 1)
                if cap == 0 or behind <= 0:
                    first_costs.append(0.0)
                    continue
                left = s.req.params.max_tokens - s.req.num_output_tokens - len(tokens)
                steps = max(1.0, left / expected_tokens(a, cap))
                first_costs.append((curve(behind + 1) - curve(1)) / steps)
        overhead, per_row = self.residual.coefficients
        return choose_lengths_by_cost(
            caps, acceptances, rows=rows, target=self.target_curve, overhead=overhead, per_row=per_row,
            draft=self.draft_curve, draft_overhead=self.draft_overhead or 0.0, first_costs=first_costs,
        )

    def _observe_draft(self, seconds: float) -> None:
        """Learn a draft forward's time outside the draft curve from the proposer's last call (its
        `last_rows`: query rows per sequential forward; n-gram lookups have none)."""
        rows = getattr(self.proposer, "last_rows", None)
        if self.draft_curve is None or not rows:
            return
        rest = max(0.0, seconds - sum(self.draft_curve(r) for r in rows)) / len(rows)
        old = rest if self.draft_overhead is None else self.draft_overhead
        self.draft_overhead = (1.0 - OVERHEAD_EMA) * old + OVERHEAD_EMA * rest

    def propose_received(self, reqs: Sequence[Request], num_running: int) -> list[list[int]]:
        """First drafts of requests whose prompt and first token came from a prefill instance: the same
        lookup a colocated request gets after its prefill step (acceptance-only lengths: the step these
        drafts join is not known here)."""
        if self._compute_bound(num_running, 0):
            return [[] for _ in reqs]
        asks = [DraftRequest(r.req_id, r.all_token_ids(), self._length(r)) for r in reqs]
        return self.proposer.propose(asks)

    def _compute_bound(self, num_seqs: int, num_tokens: int) -> bool:
        """A step this size would carry its drafts as extra compute, not as free memory-bound work (the
        fixed caps; where the slack rule runs the step-time model says so too, per step)."""
        return (self.max_batch_size is not None and num_seqs > self.max_batch_size) or (
            self.max_num_tokens is not None and num_tokens > self.max_num_tokens
        )

    def _length(self, req: Request) -> int:
        return self.lengths.length(req.req_id) if self._continues(req) else 0

    @staticmethod
    def _continues(req: Request) -> bool:
        """Whether `req` runs another step here (not finished, not handed to a decode instance)."""
        return not (req.is_finished or req.remote_decode)

    def _slack_lengths(
        self,
        out: SchedulerOutput,
        sampling: list[ScheduledRequest],
        sampled: list[list[int]],
        caps: list[int],
    ) -> list[int]:
        """The slack rule. The next step is taken to be this one with every sampling request at one
        decode token and every request still in its prompt at another chunk of this step's size; each
        verified draft adds the model's per-decode-token coefficient. Request i's step budget is its ITL
        target (`SamplingParams.slo_itl_ms`, else the engine's): the step must fit the tightest. Its own
        budget, with a TPOT target (its own `slo_tpot_ms`, else the config's), is the longest next step
        after which its TPOT so far (first token to the next one) stays within it: that bounds only its
        own drafts (`choose_lengths`)."""
        assert self.step_model is not None
        live = [self._continues(s.req) for s in sampling]
        num_decodes = sum(live)
        prompt_tokens = sum(s.num_new_tokens for s in out.scheduled if not s.samples)  # chunks to come
        context = sum(s.req.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
        base = self.step_model.predict(prompt_tokens, num_decodes, context)
        cost = StepCost(base, self.step_model.coefficients[2])
        now = self.clock()
        step_budgets: list[float | None] = []
        own_budgets: list[float | None] = []
        for s, tokens, alive in zip(sampling, sampled, live):
            params = s.req.params
            itl = self.itl_target if params.slo_itl_ms is None else params.slo_itl_ms / 1e3
            tpot = self.tpot_target if params.slo_tpot_ms is None else params.slo_tpot_ms / 1e3
            own = None
            if alive and tpot is not None:
                first = s.req.first_token_time if s.req.first_token_time is not None else now
                n = s.req.num_output_tokens + len(tokens)  # its outputs once this step's are in
                own = tpot * n - (now - first)
            step_budgets.append(itl if alive else None)
            own_budgets.append(own)
        acceptances = [self.lengths.acceptance(s.req.req_id) for s in sampling]
        return choose_lengths(caps, acceptances, cost, step_budgets, own_budgets)

    def apply_swaps(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        self.inner.apply_swaps(swap_in, swap_out)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)
        self.proposer.release(req_id)
        self.lengths.release(req_id)

    def skip_draws(self, req: Request, num_draws: int) -> None:
        self.inner.skip_draws(req, num_draws)

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
from pdserve.spec.length import SpecLengthController, StepCost, choose_lengths
from pdserve.spec.ngram import NgramProposer
from pdserve.spec.proposer import DraftRequest, Proposer
from pdserve.spec.stats import SpecDecodeStats


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for speculative method {config.method!r}")


# The acceptance rule's compute-bound caps when the config sets none (requests, tokens per step).
ACCEPTANCE_RULE_CAPS = (32, 512)


class SpeculativeExecutor:
    """`inner` verifies; this wrapper proposes. The scheduler still caps each request's drafts (none past
    max_tokens or the context length) and fits them into the step's token budget.

    Lengths: each request's acceptance-only length (`SpecLengthController`), then, where the slack rule
    runs (`length_rule` "slack", adaptive, and a `step_model` given), `choose_lengths` over the whole
    step with the model's cost of a verified draft token and each request's latency budget."""

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
    ) -> None:
        """`draft_cost`: one proposal step's time in target steps (a draft model's; see SpecLengthController).
        `step_model`: the scheduler's (`Scheduler.step_model`, the `slo` policy's), None without one;
        `itl_target`: the longest step (seconds) a request without its own `slo_itl_ms` tolerates, None
        for none; `clock`: that of `Request.first_token_time`, for TPOT budgets."""
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
        default_caps = (None, None) if slack else ACCEPTANCE_RULE_CAPS
        self.max_batch_size = config.disable_by_batch_size or default_caps[0]
        self.max_num_tokens = config.disable_by_num_tokens or default_caps[1]

    def execute(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None) -> ModelOutput:
        result = self.inner.execute(out, after_layer)
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
        self.stats.observe_lengths([k for s, k in zip(sampling, lengths) if self._continues(s.req)])
        asks = [
            DraftRequest(s.req.req_id, s.req.all_token_ids() + tokens, k)
            for s, tokens, k in zip(sampling, result.token_ids, lengths)
        ]
        result.spec_token_ids = self.proposer.propose(asks)
        return result

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

"""An executor that speculates: it runs the wrapped executor's step (which verifies the drafts the step
carries), then proposes the next drafts of every request that sampled."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.batch import ModelOutput
from pdserve.config import SpeculativeConfig
from pdserve.engine.executor import Executor
from pdserve.request import Request
from pdserve.scheduler.scheduler import SchedulerOutput
from pdserve.spec.length import SpecLengthController
from pdserve.spec.ngram import NgramProposer
from pdserve.spec.proposer import DraftRequest, Proposer
from pdserve.spec.stats import SpecDecodeStats


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for speculative method {config.method!r}")


class SpeculativeExecutor:
    """`inner` verifies; this wrapper proposes. The scheduler still caps each request's drafts (none past
    max_tokens or the context length) and fits them into the step's token budget."""

    def __init__(
        self, inner: Executor, config: SpeculativeConfig, proposer: Proposer | None = None, draft_cost: float = 0.0
    ) -> None:
        """`draft_cost`: one proposal step's time in target steps (a draft model's; see SpecLengthController)."""
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

    def execute(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None) -> ModelOutput:
        result = self.inner.execute(out, after_layer)
        sampling = [s for s in out.scheduled if s.samples]
        for s, tokens in zip(sampling, result.token_ids):
            k = s.num_spec_tokens
            if k:
                self.stats.observe(k, len(tokens) - 1)
                self.lengths.observe(s.req.req_id, k, len(tokens) - 1)
        if self._compute_bound(out):
            result.spec_token_ids = None
            return result
        asks = [
            DraftRequest(s.req.req_id, s.req.all_token_ids() + tokens, self._length(s.req))
            for s, tokens in zip(sampling, result.token_ids)
        ]
        result.spec_token_ids = self.proposer.propose(asks)
        return result

    def propose_received(self, reqs: Sequence[Request], num_running: int) -> list[list[int]]:
        """First drafts of requests whose prompt and first token came from a prefill instance: the same
        lookup a colocated request gets after its prefill step."""
        if num_running > self.config.disable_by_batch_size:
            return [[] for _ in reqs]
        asks = [DraftRequest(r.req_id, r.all_token_ids(), self._length(r)) for r in reqs]
        return self.proposer.propose(asks)

    def _compute_bound(self, out: SchedulerOutput) -> bool:
        """A step this size would carry its drafts as extra compute, not as free memory-bound work."""
        c = self.config
        return len(out.scheduled) > c.disable_by_batch_size or out.num_batched_tokens > c.disable_by_num_tokens

    def _length(self, req: Request) -> int:
        if req.is_finished or req.remote_decode:  # nothing runs after this step here
            return 0
        return self.lengths.length(req.req_id)

    def apply_swaps(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        self.inner.apply_swaps(swap_in, swap_out)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)
        self.proposer.release(req_id)
        self.lengths.release(req_id)

    def skip_draws(self, req: Request, num_draws: int) -> None:
        self.inner.skip_draws(req, num_draws)

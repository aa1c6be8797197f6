"""The one token-budget scheduler. Pure Python: no torch (the simulator drives this same class).

Each step every scheduled request gets `min(tokens it still has to compute, budget left)` tokens. A
prompt is not a separate code path: it is a request whose `num_computed_tokens` trails by many tokens, so
a long prompt simply takes several steps (chunked prefill) and a decode is the case of one token. The
policy decides the order in which requests are offered the budget and whether new ones are admitted.

Flow of a request: `add_request` -> waiting -> (admitted: blocks allocated, prefix cache consulted) ->
running -> `update_from_output` appends sampled tokens and checks token-level stops -> finished (blocks
freed). With speculative decoding a running request also carries draft tokens: it is scheduled up to
`num_tokens_with_spec`, and `update_from_output` keeps the accepted ones, rolls `num_computed_tokens`
back over the rejected ones and frees their slots (`BlockManager.truncate`); only verified tokens are
ever hashed into the prefix cache.

When blocks run out, the most recently admitted running request is preempted. With
`preemption_mode="recompute"` its blocks are freed and it goes back to the front of the queue to be
recomputed (its full blocks usually survive in the prefix cache, so recomputation is cheap). With "swap"
its computed KV is copied to host blocks (`SchedulerOutput.swap_out`) and it waits in `swapped`; at the
start of a later step, oldest first and before any new admission, it gets device blocks again and its KV
is copied back (`swap_in`), keeping every computed token. The executor applies `swap_in` before
`swap_out` and both before the forward: host blocks freed by a swap-in and device blocks freed by a
swap-out may be handed out again in the same step.

Disaggregation adds two waiting rooms outside `running`, both holding blocks: `sending` (a prefill
instance computed the prompt and first token; the KV is on its way to a decode instance) and `receiving`
(a decode instance reserved blocks for a prompt computed elsewhere; the KV is on its way here). The
engine reports how each transfer ends (`finish_sending`, `kv_received`, `finish_request`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pdserve.batch import Batch, BatchRequest, ModelOutput
from pdserve.config import SchedulerConfig
from pdserve.errors import SLORejectedError
from pdserve.kv.block_manager import BlockManager, HostBlockPool
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.scheduler.policies import Policy, StepPlan
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.structured import bitmasks_with_drafts


@dataclass(slots=True)
class ScheduledRequest:
    req: Request
    num_new_tokens: int  # tokens computed this step, starting at req.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step produces the request's next token (all its known tokens are then computed)."""
        return self.req.num_computed_tokens + self.num_new_tokens >= self.req.num_tokens

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens this step runs (and verifies): those scheduled past the request's known tokens."""
        return max(0, self.req.num_computed_tokens + self.num_new_tokens - self.req.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0  # tokens of requests still in their prompt (or recomputing)
    num_decode_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    # KV copies to run before the forward, swap_in first: (host block, device block) and
    # (device block, host block) pairs.
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to run (there may still be KV copies to apply)."""
        return not self.scheduled

    def to_batch(self) -> Batch:
        """A snapshot of what runs this step, for the executor (token ids, positions, block tables)."""
        requests = []
        constrained = [s for s in self.scheduled if s.req.grammar is not None and s.samples]
        masks = {}
        if constrained:  # the masks after 0..k drafts (cut to what the grammar takes when proposed)
            items = [(s.req.grammar, s.req.spec_token_ids[: s.num_spec_tokens]) for s in constrained]
            masks = dict(zip((id(s.req) for s in constrained), bitmasks_with_drafts(items)))  # type: ignore[arg-type]
        for s in self.scheduled:  # (the properties of ScheduledRequest inlined: this runs every step)
            req = s.req
            start = req.num_computed_tokens
            end = start + s.num_new_tokens
            known = req.num_tokens
            num_spec = end - known if end > known else 0
            token_ids = req.token_ids_between(start, end - num_spec)
            if num_spec:
                token_ids = token_ids + req.spec_token_ids[:num_spec]
            samples = end >= known
            params = req.params
            history = stop_ids = targets = None
            if samples and params.has_penalties:
                history = (req.prompt_token_ids, tuple(req.output_token_ids))
                if len(req.output_token_ids) < params.min_tokens:
                    stop_ids = (*(() if params.ignore_eos else req.eos_token_ids), *params.stop_token_ids)
            if params.prompt_logprobs is not None and start < len(req.prompt_token_ids) - 1:
                targets = req.prompt_token_ids[start + 1 : end + 1]
            allowed = masks.get(id(req)) if masks else None
            requests.append(BatchRequest(
                req.req_id, token_ids, start, list(req.block_ids), samples, num_spec, params, history, stop_ids,
                targets, allowed,
            ))
        return Batch(requests, self.num_batched_tokens)


def _add_prompt_logprobs(req: Request, start: int, scored: list[dict[int, float]]) -> None:
    """`scored` rates prompt tokens start + 1, start + 2, ...; keep those not rated before (a prompt
    recomputed after preemption is rated again)."""
    have = req.prompt_logprobs if req.prompt_logprobs is not None else []
    assert start <= len(have), "prompt positions are computed in order, none from the prefix cache"
    have.extend(scored[len(have) - start :])
    req.prompt_logprobs = have


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        policy: Policy,
        host_pool: HostBlockPool | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`host_pool`: the host tier's blocks, required when `config.preemption_mode` is "swap".
        `clock`: where request time stamps come from (the clock of `Request.arrival_time`; a simulator
        passes its simulated one)."""
        if config.preemption_mode == "swap" and host_pool is None:
            raise ValueError('preemption_mode "swap" needs a host tier (swap space > 0)')
        self.config = config
        self.clock = clock
        self.block_manager = block_manager
        self.policy = policy
        self.host_pool = host_pool if config.preemption_mode == "swap" else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # oldest swap first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0  # cumulative
        self.num_swapped_in_blocks = 0
        self._swapped_in_now: set[int] = set()  # ids of the requests this step swapped in
        self.sending: dict[str, Request] = {}  # prefilled here, blocks held until the KV transfer ends
        self.receiving: dict[str, Request] = {}  # blocks reserved, KV and first token on their way here
        self.to_reserve: deque[Request] = deque()  # remote-prefill requests waiting for blocks to reserve

    # ---- queue ---------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a validated request (see `LLMEngine.add_request` for validation)."""
        self.requests[req.req_id] = req
        if req.remote_prefill:
            req.status = RequestStatus.WAITING_FOR_KV
            self.to_reserve.append(req)
        else:
            req.status = RequestStatus.WAITING
            self.waiting.append(req)

    def check_admission(self, req: Request) -> None:
        """Raise `SLORejectedError` if the policy refuses `req` now (only `slo` with `slo_reject` does);
        changes nothing. Call before `add_request`."""
        reason = self.policy.admission_error(req, self.running, self.waiting)
        if reason is not None:
            raise SLORejectedError(reason)

    def finish_request(self, req_id: str, reason: FinishReason, stop_reason: str | int | None = None) -> Request | None:
        """Finish a request wherever it is (abort, stop string, error) and free its blocks."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.SENDING_KV:
            del self.sending[req_id]
        elif req.status is RequestStatus.WAITING_FOR_KV:
            if self.receiving.pop(req_id, None) is None:
                self.to_reserve.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, reason, stop_reason)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(
            self.waiting or self.running or self.swapped or self.sending or self.receiving or self.to_reserve
        )

    # ---- disaggregation ------------------------------------------------------------------------
    def reserve(self) -> list[Request]:
        """Reserve blocks for the whole prompt of requests whose KV comes from a prefill instance, oldest
        first, while blocks and sequence slots last. Prefix-cache hits count as computed (their KV is not
        sent). Returns the requests reserved now."""
        bm = self.block_manager
        reserved = []
        while self.to_reserve and len(self.running) + len(self.receiving) < self.config.max_num_seqs:
            req = self.to_reserve[0]
            computed = bm.get_computed_blocks(req)
            if not bm.allocate_slots(req, req.num_prompt_tokens, computed):
                break
            self.to_reserve.popleft()
            req.num_computed_tokens = req.num_cached_tokens = len(computed) * bm.block_size
            self.receiving[req.req_id] = req
            reserved.append(req)
        return reserved

    def kv_received(
        self, req_id: str, first_token: int, logprobs: dict[int, float] | None = None
    ) -> Request | None:
        """Every layer's KV of the prompt and its first token (with its logprobs, if the request asked)
        arrived: the request decodes from here on like any other (or finishes at once if that token ends
        it)."""
        req = self.receiving.pop(req_id, None)
        if req is None:
            return None
        req.num_computed_tokens = req.num_prompt_tokens
        req.first_token_time = self.clock()
        wanted = req.params.logprobs is not None and logprobs is not None
        reason, stop_reason = self._append(req, [first_token], [logprobs] if wanted else None)  # type: ignore[list-item]
        self.block_manager.cache_full_blocks(req)
        if reason is not None:
            self._finish(req, reason, stop_reason)
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return req

    def set_drafts(self, req: Request, drafts: Sequence[int]) -> None:
        """Drafts proposed outside a step (a request whose KV and first token just arrived) for the
        request's next step, capped as those that come with a step's output."""
        req.spec_token_ids = self._capped_drafts(req, drafts)

    def finish_sending(self, req_id: str, error: str | None = None) -> Request | None:
        """The KV transfer of a prefilled request ended (error None: delivered); free its blocks."""
        req = self.sending.pop(req_id, None)
        if req is None:
            return None
        req.error = error
        self._finish(req, FinishReason.LENGTH if error is None else FinishReason.ERROR)
        return req

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def step_model(self) -> StepTimeModel | None:
        """The policy's step-time model, if it keeps one (`slo`)."""
        return self.policy.step_model

    def observe_step(
        self, duration: float, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int
    ) -> None:
        """One executed step's measured duration (seconds) and shape, for a policy that learns from it."""
        self.policy.observe_step(duration, num_prefill_tokens, num_decode_seqs, num_context_tokens)

    # ---- step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._swapped_in_now = set()
        swap_in = self._swap_in() if self.swapped else []
        for plan in self.policy.plan(self.running, self.waiting):
            out = self._schedule(plan, swap_in)
            if out.scheduled or out.preempted:
                return out
        return SchedulerOutput(swap_in=swap_in)

    def _swap_in(self) -> list[tuple[int, int]]:
        """Bring swapped requests back, oldest first, while sequence slots last and device blocks cover
        their KV and next token and still leave every running request the blocks of its next step: a
        decode's next token, a prompt's next chunk (otherwise the request would be swapped straight out
        again, or an older prompt left short would preempt itself and restart: found by the random
        workloads, two long prompts trading places forever). They rejoin `running` in arrival order, so
        the newest request stays the next victim. Returns the (host block, device block) copies to make."""
        bm = self.block_manager
        assert self.host_pool is not None
        copies: list[tuple[int, int]] = []
        chunk = self.config.chunk_size or self.config.max_num_batched_tokens
        headroom = sum(
            max(0, bm.num_blocks_for(min(r.num_tokens, r.num_computed_tokens + chunk)) - len(r.block_ids))
            for r in self.running
        )
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if bm.num_blocks_for(req.num_computed_tokens + 1) + headroom > bm.num_free_blocks:
                break
            if not bm.allocate_slots(req, req.num_computed_tokens + 1):
                break
            self.swapped.popleft()
            self._swapped_in_now.add(id(req))
            copies.extend(zip(req.host_block_ids, req.block_ids))
            self.num_swapped_in_blocks += len(req.host_block_ids)
            self.host_pool.free(req.host_block_ids)
            req.host_block_ids = []
            req.status = RequestStatus.RUNNING
            i = len(self.running)
            while i > 0 and self.running[i - 1].arrival_time > req.arrival_time:
                i -= 1
            self.running.insert(i, req)
            bm.cache_full_blocks(req)
        return copies

    def _schedule(self, plan: StepPlan, swap_in: list[tuple[int, int]]) -> SchedulerOutput:
        budget = plan.token_budget if plan.token_budget is not None else self.config.max_num_batched_tokens
        out = SchedulerOutput(swap_in=list(swap_in))
        chunk_cap = self.config.chunk_size or budget
        if plan.max_prefill_tokens is not None:
            budget = self._schedule_running(replace(plan, run_prefills=False), budget, chunk_cap, out)
            budget = min(budget, plan.max_prefill_tokens)
        if plan.running_first:
            budget = self._schedule_running(plan, budget, chunk_cap, out)
        if plan.admit and not self.swapped:  # swapped requests come back before anything new
            if plan.admit_order is not None:
                self._reorder_waiting(plan.admit_order)
            budget = self._admit_waiting(plan, budget, chunk_cap, out)
        if not plan.running_first:
            self._schedule_running(plan, budget, chunk_cap, out)
        now = self.clock()
        for s in out.scheduled:
            if s.req.first_scheduled_time is None:
                s.req.first_scheduled_time = now
        return out

    def _schedule_running(self, plan: StepPlan, budget: int, chunk_cap: int, out: SchedulerOutput) -> int:
        bm = self.block_manager
        scheduled_ids = {id(s.req) for s in out.scheduled}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if id(req) in scheduled_ids:
                i += 1
                continue
            remaining = req.num_tokens_with_spec - req.num_computed_tokens
            if not (plan.run_decodes if req.is_decode else plan.run_prefills):
                i += 1
                continue
            n = min(remaining, budget, chunk_cap)  # recomputing past the prompt is chunked like a prompt
            while not bm.allocate_slots(req, req.num_computed_tokens + n):
                victim: Request | None = self.running[-1]
                # Never take back what this step already gave out (tokens, or blocks to swap back into:
                # swapping a request straight out again could repeat every step while nothing runs).
                if id(victim) in scheduled_ids or id(victim) in self._swapped_in_now:
                    victim = req
                if victim is req and any(
                    r is not req and id(r) not in scheduled_ids and r.is_decode for r in self.running
                ):
                    # Decodes this step stalls hold the blocks: wait for them (a decode step runs them).
                    # Preempting `req` would readmit it and restart its prompt at once, forever.
                    victim = None
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._add(out, req, n)
                scheduled_ids.add(id(req))
                budget -= n
                i += 1
                continue
            if victim is None:
                i += 1
            # Otherwise `req` itself was preempted; the list shifted, keep the same index.
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int, chunk_cap: int, out: SchedulerOutput) -> int:
        bm = self.block_manager
        full_budget = budget
        step_budget = self.config.max_num_batched_tokens if plan.token_budget is None else plan.token_budget
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            computed = bm.get_computed_blocks(req)
            num_cached = len(computed) * bm.block_size
            remaining = req.num_tokens - num_cached
            if plan.whole_prompts:
                # A prompt larger than a whole step's budget can only ever run in chunks.
                if remaining > budget and not (budget == full_budget and remaining > step_budget):
                    break
                n = min(remaining, budget)
            else:
                n = min(remaining, budget, chunk_cap)
            if not bm.allocate_slots(req, num_cached + n, computed):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add(out, req, n)
            budget -= n
        return budget

    def _reorder_waiting(self, order: Sequence[Request]) -> None:
        """Adopt the policy's order of the queue. Requests preempted since the plan was made are not in it:
        they stay in front, as always."""
        listed = {id(r) for r in order}
        preempted = [r for r in self.waiting if id(r) not in listed]
        assert len(preempted) + len(order) == len(self.waiting), "admit_order is not the waiting queue"
        self.waiting = deque(preempted + list(order))

    def _add(self, out: SchedulerOutput, req: Request, n: int) -> None:
        out.scheduled.append(ScheduledRequest(req, n))
        out.num_batched_tokens += n
        if req.is_decode:
            out.num_decode_tokens += n
        else:
            out.num_prefill_tokens += n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take `req`'s device blocks: swap its computed KV out when the host tier has room, otherwise
        recompute it later."""
        bm = self.block_manager
        self.running.remove(req)
        req.spec_token_ids = []  # proposed for a step that will not run; the next ones come after it
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        num_kv_blocks = bm.num_blocks_for(req.num_computed_tokens)
        host = self.host_pool.allocate(num_kv_blocks) if self.host_pool is not None and num_kv_blocks else None
        if host is not None:
            out.swap_out.extend(zip(req.block_ids, host))
            self.num_swapped_out_blocks += num_kv_blocks
            req.host_block_ids = host
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
        else:
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(req)
        bm.free(req)

    # ---- after the forward ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, model_output: ModelOutput) -> list[Request]:
        """Advance counters by what ran; append each sampling request's accepted tokens (`model_output`
        is in the order of the sampling requests of `out.scheduled`) with their logprobs and, for the
        first, its time stamp; roll back over rejected draft tokens; finish requests on EOS, stop token
        ids, max_tokens or the context length (tokens accepted past a stop are dropped); take the drafts
        proposed for the next step. Returns the requests that got new tokens, finished ones included."""
        bm = self.block_manager
        drafts_of = model_output.spec_token_ids or [None] * len(model_output.token_ids)
        sampled = iter(zip(model_output.token_ids, model_output.logprobs, drafts_of))
        now = self.clock()
        updated: list[Request] = []
        for s in out.scheduled:
            req = s.req
            samples, num_spec = s.samples, s.num_spec_tokens  # (both read the counters moved below)
            if req.is_finished:  # finished while its step was in flight (abort): its blocks are gone
                if samples:
                    next(sampled)
                continue
            if model_output.prompt_logprobs and (scored := model_output.prompt_logprobs.get(req.req_id)):
                _add_prompt_logprobs(req, req.num_computed_tokens, scored)
            req.num_computed_tokens += s.num_new_tokens
            if not samples:
                bm.cache_full_blocks(req)
                continue
            tokens, logprobs, drafts = next(sampled)
            assert 1 <= len(tokens) <= num_spec + 1, "a step accepts 1..k+1 tokens with k drafts"
            req.spec_token_ids = []
            if req.first_token_time is None:
                req.first_token_time = now
            updated.append(req)
            reason, stop_reason = self._append(req, tokens, logprobs)
            # Every token but the last appended is computed. What the step ran past that (the drafts it
            # rejected, accepted ones after a stop) is rolled back: those slots are rewritten from here on.
            req.num_computed_tokens = req.num_tokens - 1
            bm.cache_full_blocks(req)  # after the rollback: never an unverified token
            if req.remote_decode:  # the decode instance checks stops; hold the blocks until it has the KV
                self.running.remove(req)
                req.status = RequestStatus.SENDING_KV
                self.sending[req.req_id] = req
                continue
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason, stop_reason)
                continue
            bm.truncate(req, req.num_tokens)  # slots of rejected drafts
            if drafts:
                req.spec_token_ids = self._capped_drafts(req, drafts)
        return updated

    def _append(
        self, req: Request, tokens: list[int], logprobs: list[dict[int, float]] | None
    ) -> tuple[FinishReason | None, str | int | None]:
        """Append accepted tokens up to the first that stops the request; returns the stop, if any."""
        reason: FinishReason | None = None
        stop_reason: int | None = None
        for i, token in enumerate(tokens):
            req.output_token_ids.append(token)
            if logprobs is not None:
                if req.logprobs is None:
                    req.logprobs = []
                req.logprobs.append(logprobs[i])
            if req.grammar is not None and not req.grammar.accept(token):
                req.error = f"token {token} breaks the structured output constraint: {req.grammar.error}"
                return FinishReason.ERROR, None
            reason, stop_reason = self._check_stop(req, token)
            if reason is not None:
                break
        return reason, stop_reason

    def _capped_drafts(self, req: Request, drafts: Sequence[int]) -> list[int]:
        """The drafts worth running: a step accepts at most drafts + 1 tokens, none past max_tokens or the
        context length, and under a structured-output grammar none past the first it refuses."""
        drafts = list(drafts[: self._max_spec_tokens(req)])
        if req.grammar is not None and drafts:
            drafts = drafts[: req.grammar.valid_prefix(drafts)]
        return drafts

    def _max_spec_tokens(self, req: Request) -> int:
        """How many drafts fit before max_tokens and the context length."""
        n = req.params.max_tokens - req.num_output_tokens - 1
        if req.max_model_len:
            n = min(n, req.max_model_len - req.num_tokens)
        return max(0, n)

    def _check_stop(self, req: Request, token: int) -> tuple[FinishReason | None, int | None]:
        p = req.params
        if not p.ignore_eos and token in req.eos_token_ids:
            return FinishReason.STOP, None
        if token in p.stop_token_ids:
            return FinishReason.STOP, token
        if req.grammar is not None and req.grammar.is_complete:
            return FinishReason.STOP, None
        if req.num_output_tokens >= p.max_tokens:
            return FinishReason.LENGTH, None
        if req.max_model_len and req.num_tokens >= req.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finished_time = self.clock()
        self.block_manager.free(req)
        if req.host_block_ids:
            assert self.host_pool is not None
            self.host_pool.free(req.host_block_ids)
            req.host_block_ids = []
        self.requests.pop(req.req_id, None)

"""Scheduling policies: they decide the order in which work is offered to the step's token budget and
whether new requests are admitted; the budget arithmetic itself lives only in `Scheduler`.

A policy returns a `StepPlan` from the queue state. Later policies (SLO-aware budgets) add fields here,
not branches in the scheduler. `Scheduler.schedule()` calls `plan()` exactly once per step, so a policy
may keep per-step counters on its instance (never in module globals: two engines must not share them).

Every policy subclasses `Policy`, whose hooks do nothing unless a policy overrides them (only `slo` does):
`observe_step(...)` after every executed step, `admission_error(...)` before a new request is queued,
`step_model` (a `StepTimeModel`, or None), and `stats()`, numbers the server exports as Prometheus
series without knowing which policy produced them. The scheduler and the engine process call the hooks
unconditionally: no probing for attributes, no `isinstance`.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import ClassVar

from pdserve.config import SchedulerConfig
from pdserve.registry import Registry
from pdserve.request import Request
from pdserve.scheduler.step_model import DEFAULT_PRIOR, TERMS, StepTimeModel


@dataclass(frozen=True, slots=True)
class StepPlan:
    running_first: bool  # offer the budget to running requests before admitting waiting ones
    run_decodes: bool  # running requests whose prompt is done get their next token this step
    admit: bool  # admit waiting requests
    whole_prompts: bool  # admit a prompt only if all of it fits this step's remaining budget
    token_budget: int | None = None  # override of max_num_batched_tokens for this step
    run_prefills: bool = True  # running requests still in their prompt (or recomputing) get a chunk
    # Every running decode is offered the budget first; then prompt work (running chunks and admissions
    # together) gets at most this many tokens. None: no separate limit, running requests in list order.
    max_prefill_tokens: int | None = None
    # The whole waiting queue in the order to admit from (the scheduler adopts it); None: as queued.
    admit_order: tuple[Request, ...] | None = None


class Policy(abc.ABC):
    """A scheduling policy. Subclasses implement `plan` and override the hooks they need. Every policy is
    built the same way (`make_policy`): from the scheduler's config and its clock."""

    name: ClassVar[str]
    # The policy's online step-time model, if it keeps one; the engine process reports its prediction
    # for each step beside the measured duration.
    step_model: StepTimeModel | None = None

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # time.monotonic, the clock of `Request.arrival_time`

    @abc.abstractmethod
    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[StepPlan]:
        """Plans to try in order; the scheduler takes the first that schedules any work."""

    def observe_step(
        self, duration: float, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int
    ) -> None:
        """One executed step's measured duration (seconds) and shape, for a policy that learns from it."""

    def admission_error(
        self, req: Request, running: Sequence[Request], waiting: Sequence[Request]
    ) -> str | None:
        """Why `req` should be refused now (the scheduler raises `SLORejectedError` with it), or None."""
        return None

    def stats(self) -> dict[str, float]:
        """The policy's numbers for /metrics, read after every step. A key is a Prometheus series name
        without the `pdserve:` prefix, optionally with labels (`name{label="value"}`); a name ending in
        `_total` is a cumulative counter, any other a gauge."""
        return {}


class PrefillFirst(Policy):
    """Classic continuous batching: whenever prompts wait, a step runs only prompts (whole), and every
    running decode stalls until they are done."""

    name = "prefill-first"

    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[StepPlan]:
        prefill = StepPlan(running_first=True, run_decodes=False, admit=True, whole_prompts=True)
        decode = StepPlan(
            running_first=True, run_decodes=True, admit=False, whole_prompts=True, run_prefills=False
        )
        return [prefill, decode]


class Chunked(Policy):
    """Stall-free batching (Sarathi-Serve): every running decode gets its token first, then prompt
    chunks fill what is left of the budget."""

    name = "chunked"

    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[StepPlan]:
        return [StepPlan(running_first=True, run_decodes=True, admit=True, whole_prompts=False)]


class DecodePriority(Policy):
    """Chunked, but prefills pause while decodes are under pressure: when at least
    `decode_priority_max_decodes` decodes run, or the oldest running decode has gone more than
    `decode_priority_max_wait_steps` steps without a token, a step runs only decodes (no admission, no
    prompt chunks). After `decode_priority_max_decode_steps` such decode-only steps in a row while prompts
    wait, one step runs the chunked plan, which bounds TTFT.

    `Request` keeps no per-token timestamp, so a decode's wait is counted in steps: the steps since its
    output count last changed."""

    name = "decode-priority"

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, clock)
        self.max_decodes = config.decode_priority_max_decodes
        self.max_wait_steps = config.decode_priority_max_wait_steps
        self.max_decode_steps = config.decode_priority_max_decode_steps
        self.num_steps = 0
        self.num_decode_only_steps = 0  # consecutive paused steps while prompts wait
        self._token_seen: dict[str, tuple[int, int]] = {}  # req_id -> (num_output_tokens, step first seen)

    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[StepPlan]:
        self.num_steps += 1
        seen: dict[str, tuple[int, int]] = {}
        num_decodes = max_wait = 0
        for req in running:
            if not req.is_decode:
                continue
            num_decodes += 1
            last = self._token_seen.get(req.req_id)
            if last is None or last[0] != req.num_output_tokens:
                last = (req.num_output_tokens, self.num_steps)
            seen[req.req_id] = last
            max_wait = max(max_wait, self.num_steps - last[1])
        self._token_seen = seen  # rebuilt each step: finished and preempted requests drop out

        chunked = StepPlan(running_first=True, run_decodes=True, admit=True, whole_prompts=False)
        prompts_wait = bool(waiting) or num_decodes < len(running)
        pressure = num_decodes >= self.max_decodes or max_wait > self.max_wait_steps
        if not (pressure and prompts_wait) or self.num_decode_only_steps >= self.max_decode_steps:
            self.num_decode_only_steps = 0
            return [chunked]
        self.num_decode_only_steps += 1
        decode_only = StepPlan(
            running_first=True, run_decodes=True, admit=False, whole_prompts=False, run_prefills=False
        )
        # The chunked fallback only runs if the decode-only plan finds nothing to do, so nothing stalls.
        return [decode_only, chunked]


class SLOAware(Policy):
    """Chunked with a budget sized against latency targets. Each step every running decode goes first;
    then prompts get as many tokens as the step-time model (`step_model.py`, fitted online from the
    engine's measured steps) says fit before the step reaches `slo_itl_ms`, but never fewer than
    `slo_min_chunk`, so prompts always progress even when the decodes alone take longer than the target.
    Waiting prompts are admitted earliest deadline first (deadline: arrival + the request's TTFT target;
    with one target for all requests that is arrival order, which differs from the queue's order after
    preemptions and for requests queued with their own arrival times).

    Targets are per request: `SamplingParams.slo_ttft_ms` / `slo_itl_ms` where set, the config's
    `slo_ttft_ms` / `slo_itl_ms` otherwise. A step's ITL budget is the tightest ITL target among the
    running decodes (the requests that wait on this step for a token), so a batch request with a loose
    target never shrinks the chunks, and an interactive one shrinks them only while it decodes; a step
    with no decode takes the config's target.

    Each step it also predicts when every prompt not yet past its first token will finish, from the prompt
    tokens ahead of it in that order, the step's prompt budget and predicted step time (prefix-cache hits
    and the decodes that finishing prompts add are not foreseen), and counts a request in
    `num_ttft_violations_predicted` the first time the prediction passes its deadline. With `slo_reject`,
    `admission_error` refuses a new request whose own predicted TTFT passes the target, or with which the
    decode step of all accepted requests (up to `max_num_seqs` at once) would take longer than the
    tightest ITL target among them. An idle engine accepts anything: a target out of this machine's
    reach must not refuse all."""

    name = "slo"

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, clock)
        self.ttft = config.slo_ttft_ms / 1e3
        self.itl = config.slo_itl_ms / 1e3
        self.min_chunk = config.slo_min_chunk
        self.reject = config.slo_reject
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.step_model: StepTimeModel = StepTimeModel(config.slo_step_model_prior or DEFAULT_PRIOR)
        self.num_ttft_violations_predicted = 0
        self.num_rejected = 0
        self._late: set[str] = set()  # req_ids predicted to miss their TTFT, until their first token

    def observe_step(
        self, duration: float, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int
    ) -> None:
        self.step_model.observe(duration, num_prefill_tokens, num_decode_seqs, num_context_tokens)

    def ttft_of(self, req: Request) -> float:
        """`req`'s time-to-first-token target in seconds: its own, else the config's."""
        own = req.params.slo_ttft_ms
        return self.ttft if own is None else own / 1e3

    def itl_of(self, req: Request) -> float:
        """`req`'s inter-token-latency target in seconds: its own, else the config's."""
        own = req.params.slo_itl_ms
        return self.itl if own is None else own / 1e3

    def deadline(self, req: Request) -> float:
        """When `req`'s first token is due (the EDF key)."""
        return req.arrival_time + self.ttft_of(req)

    def prefill_budget(self, running: Iterable[Request]) -> tuple[int, float, int]:
        """(prompt tokens for this step, predicted step time with all of them, prompt tokens that running
        requests still have to compute). The step's context is that of every running request: decodes
        read theirs plus the new token, running prompts theirs plus their chunk. A decode's draft tokens
        (speculative decoding) are decode tokens too, as the model learns them (`observe_step`). The step
        must fit the tightest ITL target of the running decodes (the config's when none decodes)."""
        num_decodes = context = prompt_left = 0
        itl = math.inf
        for req in running:
            if req.is_decode:
                num_decodes += 1 + len(req.spec_token_ids)
                context += req.num_computed_tokens + 1
                itl = min(itl, self.itl_of(req))
            else:
                context += req.num_computed_tokens
                prompt_left += req.num_tokens - req.num_computed_tokens
        if itl == math.inf:
            itl = self.itl
        a, b, c, d = self.step_model.coefficients
        fixed = a + c * num_decodes + d * context
        per_token = b + d  # a prompt token also adds itself to the context
        room = itl - fixed
        if room <= 0:
            fit = 0
        elif room >= per_token * self.max_num_batched_tokens:
            fit = self.max_num_batched_tokens
        else:
            fit = math.floor(room / per_token)
        budget = min(max(self.min_chunk, fit), self.max_num_batched_tokens)
        return budget, fixed + per_token * budget, prompt_left

    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[StepPlan]:
        budget, step_time, _ = self.prefill_budget(running)
        order = tuple(sorted(waiting, key=self.deadline))  # earliest deadline first (stable on ties)
        self._count_late(chain((r for r in running if not r.is_decode), order), budget, step_time)
        plan = StepPlan(
            running_first=True, run_decodes=True, admit=True, whole_prompts=False,
            max_prefill_tokens=budget, admit_order=order,
        )
        return [plan]

    def _count_late(self, prompts: Iterable[Request], budget: int, step_time: float) -> None:
        """`prompts`: in the order they will be served; each finishes once the prompt tokens up to and
        including its own have run at `budget` per step."""
        now = self.clock()
        late: set[str] = set()
        ahead = 0
        for req in prompts:
            ahead += req.num_tokens - req.num_computed_tokens
            if req.num_output_tokens:  # recomputing after a preemption: its first token came already
                continue
            if req.req_id in self._late:
                late.add(req.req_id)
            elif now + math.ceil(ahead / budget) * step_time > self.deadline(req):
                late.add(req.req_id)
                self.num_ttft_violations_predicted += 1
        self._late = late  # rebuilt each step: requests past their first token, or gone, drop out

    def admission_error(
        self, req: Request, running: Sequence[Request], waiting: Sequence[Request]
    ) -> str | None:
        """Why `req` should be refused (with `slo_reject`), or None to accept it."""
        if not self.reject or not (running or waiting):
            return None
        budget, step_time, prompt_left = self.prefill_budget(running)
        deadline, ttft_target = self.deadline(req), self.ttft_of(req)
        ahead = prompt_left + req.num_tokens
        ahead += sum(r.num_tokens for r in waiting if self.deadline(r) <= deadline)  # EDF: ahead of it
        ttft = self.clock() + math.ceil(ahead / budget) * step_time - req.arrival_time
        if ttft > ttft_target:
            self.num_rejected += 1
            return (
                f"the server cannot meet the time-to-first-token target now: predicted {ttft * 1e3:.0f} ms "
                f"(target {ttft_target * 1e3:.0f} ms, {ahead} prompt tokens queued); retry later"
            )
        num_accepted = len(running) + len(waiting) + 1
        context = sum(r.num_tokens for r in running) + sum(r.num_tokens for r in waiting) + req.num_tokens
        num_decodes = min(num_accepted, self.max_num_seqs)
        decode_time = self.step_model.predict(0, num_decodes, context * num_decodes / num_accepted)
        itl_target = min(self.itl_of(r) for r in chain(running, waiting, (req,)))
        if decode_time > itl_target:
            self.num_rejected += 1
            return (
                f"the server cannot meet the inter-token latency target now: a decode step of "
                f"{num_decodes} requests is predicted to take {decode_time * 1e3:.0f} ms "
                f"(target {itl_target * 1e3:.0f} ms); retry later"
            )
        return None

    def stats(self) -> dict[str, float]:
        coefficients = zip(TERMS, self.step_model.coefficients)
        out = {f'step_model_coefficient_seconds{{term="{t}"}}': c for t, c in coefficients}
        out["slo_ttft_violations_predicted_total"] = self.num_ttft_violations_predicted
        out["slo_rejected_requests_total"] = self.num_rejected
        return out


# name -> the policy class; every one is built as `cls(config, clock)`. `config.SCHEDULER_POLICIES` spells
# the same names for validation (tests/unit/test_layering.py holds them equal).
POLICIES: Registry[type[Policy]] = Registry(
    "scheduler policy",
    {
        "prefill-first": "pdserve.scheduler.policies:PrefillFirst",
        "chunked": "pdserve.scheduler.policies:Chunked",
        "decode-priority": "pdserve.scheduler.policies:DecodePriority",
        "slo": "pdserve.scheduler.policies:SLOAware",
    },
)


def make_policy(
    name: str, config: SchedulerConfig | None = None, *, clock: Callable[[], float] = time.monotonic
) -> Policy:
    """The policy registered as `name`, configured from `config` (default: `SchedulerConfig` defaults).
    `clock`: the one the scheduler is given (`Request.arrival_time`'s), for policies that read time."""
    cls = POLICIES.load(name)
    return cls(config if config is not None else SchedulerConfig(policy=name), clock)

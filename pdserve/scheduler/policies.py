"""Scheduling policies: they decide the order in which work is offered to the step's token budget and
whether new requests are admitted; the budget arithmetic itself lives only in `Scheduler`.

A policy returns a `StepPlan` from the queue state. Later policies (SLO-aware budgets) add fields here,
not branches in the scheduler. `Scheduler.schedule()` calls `plan()` exactly once per step, so a policy
may keep per-step counters on its instance (never in module globals: two engines must not share them).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Protocol

from pdserve.config import SchedulerConfig
from pdserve.request import Request


@dataclass(frozen=True, slots=True)
class StepPlan:
    running_first: bool  # offer the budget to running requests before admitting waiting ones
    run_decodes: bool  # running requests whose prompt is done get their next token this step
    admit: bool  # admit waiting requests
    whole_prompts: bool  # admit a prompt only if all of it fits this step's remaining budget
    token_budget: int | None = None  # override of max_num_batched_tokens for this step
    run_prefills: bool = True  # running requests still in their prompt (or recomputing) get a chunk


class Policy(Protocol):
    name: str

    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[StepPlan]:
        """Plans to try in order; the scheduler takes the first that schedules any work."""
        ...


class PrefillFirst:
    """Classic continuous batching: whenever prompts wait, a step runs only prompts (whole), and every
    running decode stalls until they are done."""

    name = "prefill-first"

    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[StepPlan]:
        prefill = StepPlan(running_first=True, run_decodes=False, admit=True, whole_prompts=True)
        decode = StepPlan(
            running_first=True, run_decodes=True, admit=False, whole_prompts=True, run_prefills=False
        )
        return [prefill, decode]


class Chunked:
    """Stall-free batching (Sarathi-Serve): every running decode gets its token first, then prompt
    chunks fill what is left of the budget."""

    name = "chunked"

    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[StepPlan]:
        return [StepPlan(running_first=True, run_decodes=True, admit=True, whole_prompts=False)]


class DecodePriority:
    """Chunked, but prefills pause while decodes are under pressure: when at least
    `decode_priority_max_decodes` decodes run, or the oldest running decode has gone more than
    `decode_priority_max_wait_steps` steps without a token, a step runs only decodes (no admission, no
    prompt chunks). After `decode_priority_max_decode_steps` such decode-only steps in a row while prompts
    wait, one step runs the chunked plan, which bounds TTFT.

    `Request` keeps no per-token timestamp, so a decode's wait is counted in steps: the steps since its
    output count last changed."""

    name = "decode-priority"

    def __init__(self, config: SchedulerConfig) -> None:
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


POLICIES: dict[str, Callable[[SchedulerConfig], Policy]] = {
    PrefillFirst.name: lambda config: PrefillFirst(),
    Chunked.name: lambda config: Chunked(),
    DecodePriority.name: DecodePriority,
}


def make_policy(name: str, config: SchedulerConfig | None = None) -> Policy:
    """The policy registered as `name`, configured from `config` (default: `SchedulerConfig` defaults)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduler policy {name!r}; choose from {sorted(POLICIES)}") from None
    return factory(config if config is not None else SchedulerConfig(policy=name))

"""Scheduling policies: they decide the order in which work is offered to the step's token budget and
whether new requests are admitted; the budget arithmetic itself lives only in `Scheduler`.

A policy returns a `StepPlan` from the queue state. Later policies (decode-priority thresholds,
SLO-aware budgets) add fields here, not branches in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Protocol

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


POLICIES: dict[str, Callable[[], Policy]] = {
    PrefillFirst.name: PrefillFirst,
    Chunked.name: Chunked,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduler policy {name!r}; choose from {sorted(POLICIES)}") from None

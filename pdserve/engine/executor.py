"""The executor seam: what the engine loop needs from whatever runs a step.

`ModelRunner` (with its `KVCache`) is the real one; `pdserve.sim.fake_executor.FakeExecutor` runs steps
without a model (tests, and the simulator that drives the real scheduler). The loop calls, per step:
`apply_swaps` (always, even when nothing runs), then `execute` (when something is scheduled), and
`release` once a request is finished. Torch-free, like the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from pdserve.batch import ModelOutput
from pdserve.request import Request
from pdserve.scheduler.scheduler import SchedulerOutput


@runtime_checkable
class Executor(Protocol):
    def execute(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None) -> ModelOutput:
        """Run the scheduled tokens: write their K/V and sample one token per sampling request (in the
        order of `out.scheduled`). Changes no request: counters move only in `update_from_output`, so a
        failed step can be run again. `after_layer(i)` is called once layer i's K/V are written."""
        ...

    def apply_swaps(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        """Copy KV blocks between the host tier and the device, all of `swap_in` (host, device) before
        `swap_out` (device, host); called before `execute` of the same step."""
        ...

    def release(self, req_id: str) -> None:
        """Forget per-request state (a seeded request's generator); the request has finished."""
        ...

    def skip_draws(self, req: Request, num_draws: int) -> None:
        """Advance a seeded request's sampler past draws made elsewhere (its first token, sampled by a
        prefill instance), so its later tokens equal those of a colocated run."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """An executor that speculates (`pdserve.spec.SpeculativeExecutor`). Drafts normally come with a
    step's output; a request whose prompt and first token were computed elsewhere (a decode instance's
    request whose KV arrived) gets its first drafts here, so its first step here already verifies some."""

    def propose_received(self, reqs: Sequence[Request], num_running: int) -> list[list[int]]:
        """Drafts for each of `reqs` (running, prompt KV and first token in place); none for any when
        `num_running` requests make the next step compute-bound."""
        ...

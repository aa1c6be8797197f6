"""The step contract between the scheduler and an executor, torch-free on both sides.

The scheduler's `SchedulerOutput` says what runs this step; an executor (the model runner, or a fake one
for tests and the simulator) runs it and answers with a `ModelOutput`, which the scheduler applies in
`update_from_output`. Nothing here imports torch, so the engine loop and the simulator can use it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ModelOutput:
    """One entry per sampling request, in the order of `SchedulerOutput.scheduled`."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    forward_time: float  # seconds spent in the model and sampler

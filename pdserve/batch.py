"""The step contract between the scheduler and an executor, torch-free on both sides.

The scheduler's `SchedulerOutput` says what runs this step; an executor (the model runner, or a fake one
for tests and the simulator) runs it and answers with a `ModelOutput`, which the scheduler applies in
`update_from_output`. `SchedulerOutput.to_batch()` snapshots the step as a `Batch`: per request the
token ids to run, where they start, the block table and whether (and from how many draft tokens) it
samples (with the sequence's tokens where a penalty counts them), so an executor builds its tensors
from the batch rather than from live `Request` objects.

A step may accept more than one token per request: with k draft tokens scheduled (`num_spec_tokens`),
the executor verifies them and returns the accepted drafts plus one token of its own (1..k+1 tokens); it
may also propose drafts for the request's next step (`ModelOutput.spec_token_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.request import SamplingParams


@dataclass(frozen=True, slots=True)
class BatchRequest:
    req_id: str
    token_ids: list[int]  # what runs, from position `start` on; the last `num_spec_tokens` are drafts
    start: int  # position of token_ids[0]: the request's num_computed_tokens
    block_ids: list[int]  # the block table, covering at least start + len(token_ids) slots
    samples: bool  # every known token is computed after this step: it produces the next token(s)
    num_spec_tokens: int  # draft tokens at the end of token_ids, verified by this step
    params: SamplingParams
    # The prompt and the output so far (drafts excluded) of a sampling request whose params have
    # penalties (`SamplingParams.has_penalties`): what the sampler counts. None for every other request.
    history: tuple[list[int], tuple[int, ...]] | None = None
    # While a request's output is shorter than its min_tokens: the tokens it may not sample yet (its EOS
    # unless ignore_eos, and its stop_token_ids). None otherwise.
    stop_ids: tuple[int, ...] | None = None
    # For a request that scores its prompt (`SamplingParams.prompt_logprobs`): the prompt tokens its
    # positions in this step predict, token_ids[j] -> prompt_targets[j] (fewer at the prompt's end).
    prompt_targets: list[int] | None = None
    # For a sampling request under a structured-output grammar: the tokens it may sample, one bit per
    # vocabulary entry (bit t % 8 of byte t // 8), after 0, 1, ..., num_spec_tokens of its drafts (one
    # mask per row it samples from); the sampler gives every other token -inf.
    allowed: tuple[bytes, ...] | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Batch:
    requests: list[BatchRequest]  # in the order of `SchedulerOutput.scheduled`
    num_tokens: int

    @property
    def sampling(self) -> list[BatchRequest]:
        return [r for r in self.requests if r.samples]


@dataclass(slots=True)
class ModelOutput:
    """One entry per sampling request, in the order of `SchedulerOutput.scheduled`."""

    token_ids: list[list[int]]  # the tokens each accepted this step: 1..k+1 with k drafts scheduled
    logprobs: list[list[dict[int, float]] | None]  # one {token: logprob} per accepted token, if asked
    forward_time: float  # seconds spent in the model and sampler
    # Draft tokens proposed for each sampling request's next step (None: the executor proposes none).
    spec_token_ids: list[list[int]] | None = None
    # req_id -> one {token_id: logprob} per entry of its BatchRequest.prompt_targets (the target's own
    # logprob and the top alternatives), for the requests that score their prompt.
    prompt_logprobs: dict[str, list[dict[int, float]]] | None = None

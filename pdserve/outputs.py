"""What the engine returns per request. Cumulative fields plus the delta of the last step, so the
offline API reads the final object and a streaming server reads the deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    new_text: str = ""  # produced by the last step
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int
    num_preemptions: int


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    # With SamplingParams.prompt_logprobs: None for the first prompt token (nothing before it), then one
    # {token_id: logprob} per prompt token (its own first, then the top alternatives); as vLLM's.
    prompt_logprobs: list[dict[int, float] | None] | None = None

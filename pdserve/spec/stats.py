"""Cumulative speculative-decoding counters, named after vLLM's `spec_decode_*` metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps of a request that ran at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    # The length rule's choices: one per request that sampled in a step that could speculate, and the
    # drafts asked for (the proposer may find fewer); their ratio is the mean chosen length.
    num_length_choices: int = 0
    num_chosen_tokens: int = 0

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def observe_lengths(self, lengths: list[int]) -> None:
        self.num_length_choices += len(lengths)
        self.num_chosen_tokens += sum(lengths)

    @property
    def mean_chosen_length(self) -> float:
        return self.num_chosen_tokens / self.num_length_choices if self.num_length_choices else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: the accepted drafts plus the step's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

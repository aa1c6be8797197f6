"""The proposer interface: given requests' sequences, guess up to k next tokens for each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class DraftRequest:
    req_id: str
    token_ids: Sequence[int]  # the whole sequence: prompt, output, and the tokens this step accepted
    num_tokens: int  # how many drafts to propose at most (0: none)


class Proposer(Protocol):
    """Proposes drafts for a batch at once (a draft model runs them as one batch; n-gram loops).

    A draft-model proposer keeps per-request state (its own KV cache, advanced by the accepted tokens
    and rolled back over the rejected ones): `release` is where that state is dropped. Its drafts' own
    probabilities (q) would join the drafts for exact rejection sampling; n-gram drafts have q = 1."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """One list of at most `num_tokens` drafts per request, in order."""
        ...

    def release(self, req_id: str) -> None:
        """Forget the request (it finished)."""
        ...

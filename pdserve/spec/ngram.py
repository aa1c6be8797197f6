"""N-gram prompt lookup: if the sequence's last n tokens occurred earlier, guess that what followed them
then follows now. Strong where outputs copy their input (code edits, quoting, summaries with names)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pdserve.spec.proposer import DraftRequest


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.propose_one(r.token_ids, r.num_tokens) for r in requests]

    def release(self, req_id: str) -> None:
        pass  # stateless

    def propose_one(self, token_ids: Sequence[int], k: int) -> list[int]:
        """The k tokens after the earliest earlier occurrence of the longest matching suffix (n from
        max_n down to min_n); fewer near the end of the sequence, none without a match. O(context) per n,
        in numpy."""
        num = len(token_ids)
        if k <= 0 or num <= self.min_n:
            return []
        seq = np.asarray(token_ids, dtype=np.int64)
        # Candidates: earlier positions holding the last token (an occurrence must end before it).
        ends = np.flatnonzero(seq[:-1] == seq[-1])
        if ends.size == 0:
            return []
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            fit = ends[ends >= n - 1]  # (candidates too close to the start fit shorter n only)
            if fit.size == 0:
                continue
            # Row e - (n-1) of the windows is seq[e-n+1 .. e]: the n tokens ending at candidate e.
            windows = sliding_window_view(seq[:-1], n)[fit - (n - 1)]
            hits = fit[(windows == seq[num - n :]).all(axis=1)]
            if hits.size:
                start = int(hits[0]) + 1
                return seq[start : start + k].tolist()
        return []

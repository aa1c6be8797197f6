"""The draft-model proposer: a small model of the target's tokenizer guesses each request's next k tokens
greedily, from its own paged KV cache.

Per step and request, the draft first catches up the tokens the target accepted since its last proposal
(the whole prompt the first time, then 1..k+1 tokens: the accepted drafts it had not cached yet and the
target's own token), which yields draft 1; then k - 1 single-token steps yield drafts 2..k. Each of these
k forwards runs every proposing request as one batch through a `ModelRunner` over the draft's cache.
The KV of drafts the target rejected is simply overwritten: a request's valid prefix is its previous
sequence plus the drafts the target kept, and the next catch-up starts there ("rollback" moves a number).

Drafts are greedy (the draft's argmax), so the draft distribution q is a point mass and the sampler's
rejection rule with q = 1 (accept with probability p(x), resample from norm(max(p - q, 0))) keeps the
target's distribution exactly, as for n-gram drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.batch import BatchRequest
from pdserve.config import ModelConfig
from pdserve.request import SamplingParams
from pdserve.runner.model_runner import ModelRunner
from pdserve.runner.kernels import greedy
from pdserve.spec.proposer import DraftRequest

_GREEDY = SamplingParams(temperature=0)  # the runner's batch rows need params; the draft takes the argmax


def check_same_vocab(
    target: ModelConfig, draft: ModelConfig, target_tok: object | None, draft_tok: object | None
) -> None:
    """Refuse a draft whose token ids mean something else than the target's (e.g. SmolLM2 for Qwen):
    its guesses would be noise at best, out-of-range ids at worst."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}): a draft model must share the target's tokenizer"
        )
    tv, dv = _vocab(target_tok), _vocab(draft_tok)
    if tv is not None and dv is not None and tv != dv:
        raise ValueError("the draft model's tokenizer differs from the target's: a draft model must share it")


def _vocab(tok: object | None) -> dict[str, int] | None:
    backend = getattr(tok, "backend", None)
    return backend.get_vocab(with_added_tokens=True) if backend is not None else None


@dataclass(slots=True)
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    seq_len: int = 0  # the sequence's length at the last proposal: positions < seq_len are cached
    drafts: list[int] = field(default_factory=list)  # drafts whose KV follows seq_len (d1..d_{k-1})


class DraftModelProposer:
    """`runner` runs the draft model over its own `KVCache` (sized by `draft_kv_cache_memory_gb`);
    this class owns that cache's blocks (a free list: the draft has no prefix cache). A request that
    finds no free blocks gets no drafts this step (its state is dropped and rebuilt when blocks free)."""

    def __init__(self, runner: ModelRunner, num_blocks: int, max_model_len: int, cost: float) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.max_model_len = max_model_len  # positions the draft may attend over (its own limit)
        self.cost = cost  # a draft step's time as a fraction of a target step's (SpecLengthController)
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._state: dict[str, _DraftState] = {}
        self.last_rows: list[int] = []  # query rows of each forward of the last `propose` (the cost rule's)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        rows: list[int] = []  # index into `requests` of each proposing request
        lens: list[int] = []  # its sequence length L
        ks: list[int] = []  # its number of drafts
        first: list[BatchRequest] = []
        for i, r in enumerate(requests):
            L = len(r.token_ids)
            k = min(r.num_tokens, self.max_model_len - L + 1)  # the last draft's KV is never written
            if k <= 0:
                continue
            st = self._state.get(r.req_id)
            if st is None:
                st = self._state[r.req_id] = _DraftState()
            valid = self._valid_prefix(st, r.token_ids)
            if not self._reserve(st, L + k - 1):
                self.release(r.req_id)
                continue
            rows.append(i)
            lens.append(L)
            ks.append(k)
            catch_up = list(r.token_ids[valid:])
            first.append(BatchRequest(r.req_id, catch_up, valid, st.blocks, True, 0, _GREEDY))
        self.last_rows = []
        if not rows:
            return out
        self.last_rows.append(sum(len(b.token_ids) for b in first))
        drafts = [[t] for t in self._greedy(first)]
        for j in range(1, max(ks)):
            live = [n for n, k in enumerate(ks) if k > j]
            self.last_rows.append(len(live))
            step = [  # draft j at position L + j - 1
                BatchRequest(first[n].req_id, [drafts[n][-1]], lens[n] + j - 1, first[n].block_ids, True, 0, _GREEDY)
                for n in live
            ]
            for n, t in zip(live, self._greedy(step)):
                drafts[n].append(t)
        for n, i in enumerate(rows):
            st = self._state[requests[i].req_id]
            st.seq_len = lens[n]
            st.drafts = drafts[n][:-1]  # the last draft was never fed back: its KV is not cached
            out[i] = drafts[n]
        return out

    def lag(self, req_id: str, seq_len: int) -> int:
        """About how many tokens of a `seq_len`-token sequence the next proposal's first forward runs for
        `req_id`: the whole sequence if the draft has never seen it, else what came since its last
        proposal (1 + the accepted drafts when it proposed last step; more after steps without drafts)."""
        st = self._state.get(req_id)
        return seq_len if st is None else max(1, seq_len - st.seq_len)

    def release(self, req_id: str) -> None:
        st = self._state.pop(req_id, None)
        if st is not None:
            self._free.extend(reversed(st.blocks))

    @staticmethod
    def _valid_prefix(st: _DraftState, token_ids: Sequence[int]) -> int:
        """How many leading positions of `token_ids` the draft cache holds: the previous sequence (tokens
        never change once appended) plus the cached drafts the target accepted. At least one token is
        always rerun, since the first forward must produce the next token's logits."""
        valid = st.seq_len if st.seq_len <= len(token_ids) else 0
        for d in st.drafts:  # at most k - 1 comparisons
            if valid >= len(token_ids) or token_ids[valid] != d:
                break
            valid += 1
        return min(valid, len(token_ids) - 1)

    def _reserve(self, st: _DraftState, num_slots: int) -> bool:
        need = -(-num_slots // self.block_size) - len(st.blocks)
        if need > len(self._free):
            return False
        st.blocks.extend(self._free.pop() for _ in range(max(0, need)))
        return True

    def _greedy(self, batch: list[BatchRequest]) -> list[int]:
        """One batched draft forward; each request's next token (argmax of its last position's logits)."""
        logits = self.runner.logits_for(batch, [1] * len(batch))
        return greedy(torch.cat(logits)).tolist()

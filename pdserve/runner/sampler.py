"""Turns one step's logits into next tokens, one row per sequence being sampled.

The model runner builds a `SamplingMetadata` from the rows' `SamplingParams` (once per batch layout) and
calls `Sampler` on the last-position logits. Logprobs are those of the raw model distribution (as vLLM's
default). Rows with penalties or a logit bias (`Penalties`) have their logits changed first, rows under a
structured-output grammar get -inf at every token it does not allow (`SamplingMetadata.allowed`); then greedy
rows take the argmax; random rows go through temperature, top-k, top-p and min-p and are drawn with
inverse-CDF sampling (one uniform number per row), so a seeded row's draw depends only on its own
generator and its own logits, never on which other rows share the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.request import SamplingParams
from pdserve.runner.kernels import SamplingKernels, TokenMasks, inverse_cdf

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
_MIN_TEMPERATURE = 1e-5


class History(NamedTuple):
    """What a row's penalties count: its sequence so far, and the tokens it may not sample before its
    min_tokens (EOS, stop_token_ids)."""

    prompt: Sequence[int]
    output: Sequence[int]
    stop_ids: Sequence[int] = ()


@dataclass(slots=True)
class Penalties:
    """The rows' penalties and logit biases (vLLM's semantics and order): a row short of its min_tokens
    gets -inf at its stop ids, the bias is added, then repetition divides the positive logits and
    multiplies the others of every token in the row's prompt or output, then frequency x (occurrences in
    the output) + presence (if any) is subtracted.

    Sparse: each part is a list of flat positions (row x V + token) of the rows that use it, with what it
    does there, so the work follows the sequences' lengths, not rows x vocabulary (dense [rows, V] counts
    cost 165 ms a step at 64 rows of Qwen2.5's 151,936 tokens on host G, mostly fresh pages). A part no
    row uses is None. Built per step: the counts change with every token."""

    banned: torch.Tensor | None  # positions set to -inf (min_tokens)
    bias: tuple[torch.Tensor, torch.Tensor] | None  # positions, values to add
    repetition: tuple[torch.Tensor, torch.Tensor] | None  # positions (unique), the rows' penalties there
    subtract: torch.Tensor | None  # positions (unique) of output tokens ...
    amounts: torch.Tensor | None  # ... and frequency x count + presence at each

    @classmethod
    def from_rows(
        cls, params: list[SamplingParams], histories: list[History | None], vocab_size: int, device: torch.device
    ) -> Penalties | None:
        """None when no row has a penalty or a bias. A row with one must have its history."""
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return None

        def positions(row_seqs: list[tuple[int, Sequence[int]]]) -> torch.Tensor:
            """Flat positions of every token of each (row, tokens), in order, duplicates kept."""
            ids = torch.tensor(list(itertools.chain.from_iterable(seq for _, seq in row_seqs)), dtype=torch.int64)
            lens = torch.tensor([len(seq) for _, seq in row_seqs])
            base = torch.repeat_interleave(torch.tensor([r for r, _ in row_seqs]) * vocab_size, lens)
            return base + ids

        assert all(histories[i] is not None for i in rows), "a row with penalties has no history"
        hist = {i: History(*histories[i]) for i in rows}  # type: ignore[misc]  (a plain tuple is one too)

        banned = None
        short = [i for i in rows if len(hist[i].output) < params[i].min_tokens and hist[i].stop_ids]
        if short:
            banned = positions([(i, hist[i].stop_ids) for i in short]).to(device)
        bias = None
        biased = [(i, params[i].logit_bias or {}) for i in rows if params[i].logit_bias]
        if biased:
            values = torch.tensor([b for _, d in biased for b in d.values()], dtype=torch.float32)
            bias = (positions([(i, list(d)) for i, d in biased]).to(device), values.to(device))
        repetition = None
        repeated = [i for i in rows if params[i].repetition_penalty != 1.0]
        if repeated:
            pos = positions([(i, seq) for i in repeated for seq in (hist[i].prompt, hist[i].output)]).unique()
            factor = torch.tensor([params[i].repetition_penalty for i in range(len(params))])
            repetition = (pos.to(device), factor[pos // vocab_size].to(device))
        subtract = amounts = None
        counted = [i for i in rows if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0]
        if counted:
            pos, counts = positions([(i, hist[i].output) for i in counted]).unique(return_counts=True)
            frequency = torch.tensor([params[i].frequency_penalty for i in range(len(params))])
            presence = torch.tensor([params[i].presence_penalty for i in range(len(params))])
            row = pos // vocab_size
            subtract, amounts = pos.to(device), (frequency[row] * counts + presence[row]).to(device)
        return cls(banned, bias, repetition, subtract, amounts)

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalise the float32 logits [N, V] (contiguous) in place; returns them."""
        assert logits.dtype == torch.float32 and logits.is_contiguous()
        flat = logits.view(-1)
        if self.banned is not None:
            flat[self.banned] = float("-inf")
        if self.bias is not None:
            flat.index_add_(0, *self.bias)
        if self.repetition is not None:
            pos, factor = self.repetition
            v = flat[pos]
            flat[pos] = torch.where(v > 0, v / factor, v * factor)
        if self.subtract is not None and self.amounts is not None:
            flat.index_add_(0, self.subtract, -self.amounts)
        return logits


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling options as batch tensors; an option no row uses is None so its work is skipped."""

    temperature: torch.Tensor  # [N] float32, 0.0 for greedy rows
    top_k: torch.Tensor | None  # [N] int64, vocab size where off; None when no row uses top-k
    top_p: torch.Tensor | None  # [N] float32, 1.0 where off; None when no row uses it
    min_p: torch.Tensor | None  # [N] float32, 0.0 where off; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    all_greedy: bool
    any_greedy: bool
    max_num_logprobs: int | None  # max over rows of params.logprobs; None if no row wants logprobs
    penalties: Penalties | None = None  # None when no row has a penalty or a logit bias
    # The rows under a structured-output grammar and the tokens each may take; None when no row has one.
    allowed: TokenMasks | None = None

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
        histories: list[History | None] | None = None,
        allowed: Sequence[bytes | None] | None = None,
    ) -> SamplingMetadata:
        """Greedy rows get neutral top-k/top-p/min-p values: those options only shape random draws.
        `histories`: per row, the tokens its penalties count (needed for the rows that have them).
        `allowed`: per row, the packed bitmask of a row under a grammar (`BatchRequest.allowed`) or None."""
        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        for p in params:
            greedy = p.temperature < _MIN_TEMPERATURE
            temperature.append(0.0 if greedy else float(p.temperature))
            top_k.append(vocab_size if greedy or p.top_k <= 0 else min(p.top_k, vocab_size))
            top_p.append(1.0 if greedy else float(p.top_p))
            min_p.append(0.0 if greedy else float(p.min_p))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        uses_top_k = any(k < vocab_size for k in top_k)
        uses_top_p = any(v < 1.0 for v in top_p)
        uses_min_p = any(v > 0.0 for v in min_p)
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device) if uses_top_k else None,
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device) if uses_top_p else None,
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device) if uses_min_p else None,
            generators=generators,
            all_greedy=all(t == 0.0 for t in temperature),
            any_greedy=any(t == 0.0 for t in temperature),
            max_num_logprobs=max(wanted) if wanted else None,
            penalties=Penalties.from_rows(params, histories or [None] * len(params), vocab_size, device),
            allowed=TokenMasks.from_rows(allowed, vocab_size, device) if allowed else None,
        )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    # [N, 1 + k] float32: logprob of the sampled token, then the k highest logprobs (k = max_num_logprobs)
    logprobs: torch.Tensor | None
    logprob_token_ids: torch.Tensor | None  # [N, 1 + k] int64: the sampled token id, then the top-k ids


class Sampler:
    """Stateless apart from `generator`, which feeds the noise of every unseeded random row. `kernels`:
    how structured-output masks are applied and temperature draws made (`choose_sampling_kernels`;
    torch's ops by default)."""

    def __init__(self, generator: torch.Generator | None = None, kernels: SamplingKernels | None = None) -> None:
        self.generator = generator
        self.kernels = kernels or SamplingKernels()

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Samples one token per row of `logits` [N, V] (float32 or the model's 16-bit dtype); never
        modifies `logits`. An all-greedy batch without logprobs or penalties takes the argmax of the rows
        as given: widening 16-bit values to float32 is exact, so the argmax is the same, without the copy."""
        if md.all_greedy and md.max_num_logprobs is None and md.penalties is None:
            if md.allowed is None:
                token_ids = self.kernels.greedy(logits)
            elif md.allowed.rows.numel() == logits.shape[0]:  # every row under a grammar
                token_ids = self.kernels.argmax(logits, md.allowed)
            else:
                token_ids = self.kernels.greedy(logits)
                token_ids[md.allowed.rows] = self.kernels.argmax(logits, md.allowed)
            return SamplerOutput(token_ids=token_ids, logprobs=None, logprob_token_ids=None)
        raw = logits  # the logprobs' source
        changed = md.penalties is not None or md.allowed is not None
        # Widened to float32 unless only the C++ draw kernel reads them (it reads the model's dtype).
        plain_draws = md.top_k is None and md.top_p is None and md.min_p is None
        if changed or not (self.kernels.draws_in_cpp and plain_draws and not md.any_greedy):
            logits = logits.to(torch.float32, copy=changed)
        if md.penalties is not None:
            md.penalties.apply_(logits)
        if md.allowed is not None:
            self.kernels.apply_(logits, md.allowed)
        if md.all_greedy:
            token_ids = self.kernels.greedy(logits)
        elif md.any_greedy:
            token_ids = torch.where(md.temperature == 0.0, self.kernels.greedy(logits), self._sample(logits, md))
        else:  # (no argmax to compute)
            token_ids = self._sample(logits, md)

        if md.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, logprob_token_ids=None)
        raw_logprobs = torch.log_softmax(raw.to(torch.float32), dim=-1)
        top_logprobs, top_ids = raw_logprobs.topk(min(md.max_num_logprobs, logits.shape[-1]), dim=-1)
        sampled = token_ids.unsqueeze(-1)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=torch.cat([raw_logprobs.gather(-1, sampled), top_logprobs], dim=-1),
            logprob_token_ids=torch.cat([sampled, top_ids], dim=-1),
        )

    def verify(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        num_drafts: list[int],
        draft_ids: list[int],
        generators: dict[int, torch.Generator],
    ) -> tuple[list[list[int]], list[int]]:
        """Verify draft tokens proposed with q = 1 (n-gram): request i owns k_i + 1 consecutive rows of
        `logits` (row j: the distribution of the token after its j-th input token) and the next k_i of
        `draft_ids`; `md` is per row, `generators` per request. Returns each request's accepted drafts
        plus one token of its own, and the rows those tokens came from.

        Greedy requests accept the drafts equal to the argmax, then take the argmax. Random ones use
        rejection sampling, so each token is distributed exactly as without speculation: draft d is
        accepted with probability p(d) (p after temperature, top-k, top-p, min-p); on rejection the token
        is drawn from p with d removed (norm(max(p - onehot(d), 0))); when all k pass, a bonus token is
        drawn from the last row. A request draws k + 1 uniform numbers from its own generator (k tests,
        one final draw), so with k = 0 it makes exactly the draw of `__call__`. Penalties count, for
        row j of a request, its sequence plus its first j drafts (the caller's `md`)."""
        logits = logits.to(torch.float32, copy=md.penalties is not None or md.allowed is not None)
        if md.penalties is not None:
            md.penalties.apply_(logits)
        if md.allowed is not None:
            self.kernels.apply_(logits, md.allowed)
        greedy_ids = self.kernels.greedy(logits).tolist()
        starts, d_starts = [0], [0]
        for k in num_drafts:
            starts.append(starts[-1] + k + 1)
            d_starts.append(d_starts[-1] + k)
        greedy_req = [True] * len(num_drafts)
        accept_random: list[bool] = []
        probs = u = None
        if not md.all_greedy:
            temps = md.temperature.tolist()
            greedy_req = [temps[starts[i]] == 0.0 for i in range(len(num_drafts))]
            probs = self._probs(logits, md)
            u = torch.rand(logits.shape[0], device=logits.device, generator=self.generator)
            for i, gen in generators.items():
                u[starts[i] : starts[i + 1]] = torch.rand(num_drafts[i] + 1, device=logits.device, generator=gen)
            draft_rows = [starts[i] + j for i, k in enumerate(num_drafts) for j in range(k)]
            if draft_rows:
                rows_t = torch.tensor(draft_rows, device=logits.device)
                ids_t = torch.tensor(draft_ids, device=logits.device)
                p_draft = probs[rows_t, ids_t] / probs[rows_t].sum(dim=-1)
                accept_random = (u[rows_t] < p_draft).tolist()
        accepted: list[list[int]] = []
        final_rows: list[int] = []
        for i, k in enumerate(num_drafts):
            s, ds = starts[i], d_starts[i]
            m = 0
            if greedy_req[i]:
                while m < k and draft_ids[ds + m] == greedy_ids[s + m]:
                    m += 1
            else:
                while m < k and accept_random[ds + m]:
                    m += 1
            accepted.append(draft_ids[ds : ds + m])
            final_rows.append(s + m)
        if probs is None or u is None:
            return [a + [greedy_ids[r]] for a, r in zip(accepted, final_rows)], final_rows
        random_reqs = [i for i in range(len(num_drafts)) if not greedy_req[i]]
        final: dict[int, int] = {}
        if random_reqs:
            rows = [final_rows[i] for i in random_reqs]
            dist = probs[torch.tensor(rows, device=logits.device)]
            for n, i in enumerate(random_reqs):
                m = len(accepted[i])
                if m < num_drafts[i]:  # rejected: the residual excludes the rejected draft
                    dist[n, draft_ids[d_starts[i] + m]] = 0.0
            last_u = u[torch.tensor([starts[i + 1] - 1 for i in random_reqs], device=logits.device)]
            cdf = dist.cumsum(dim=-1)
            idx = torch.searchsorted(cdf, last_u.unsqueeze(-1) * cdf[:, -1:], right=True)
            idx = idx.clamp_max_(dist.shape[-1] - 1).squeeze(-1).tolist()
            # A residual of no mass (p(d) rounded to 1, then rejected): keep the row's most likely token.
            empty = (cdf[:, -1] <= 0).tolist()
            for n, i in enumerate(random_reqs):
                final[i] = greedy_ids[final_rows[i]] if empty[n] else idx[n]
        tokens = [
            accepted[i] + [final[i] if i in final else greedy_ids[final_rows[i]]] for i in range(len(num_drafts))
        ]
        return tokens, final_rows

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Inverse-CDF sampling: one uniform number per row, located in the row's cumulative (unnormalised)
        probabilities. One draw per row keeps seeded rows on their own generator; on CPU this is ~15x
        cheaper than drawing exponential noise for every vocabulary entry (measured: 169 ms vs ~10 ms
        for 150 rows x 49k tokens). Without top-k, top-p or min-p in the batch, `SamplingKernels.draw`."""
        u = torch.rand(logits.shape[0], 1, device=logits.device, generator=self.generator)
        for row, gen in md.generators.items():
            u[row] = torch.rand(1, device=logits.device, generator=gen)
        if md.top_k is None and md.top_p is None and md.min_p is None:
            return self.kernels.draw(logits, md.temperature, u)
        return inverse_cdf(self._probs(logits, md), u)

    def _probs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The rows' sampling distributions (unnormalised after min-p)."""
        # Greedy rows are divided by 1 so they stay finite; their draw is discarded by the caller.
        temperature = torch.where(md.temperature == 0.0, 1.0, md.temperature)
        logits = logits / temperature.unsqueeze(-1)
        if md.top_k is not None or md.top_p is not None:
            logits = _apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        if md.min_p is not None:
            threshold = md.min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Sets to -inf every logit outside the row's top-k, then outside its top-p nucleus: the fewest
    highest-probability tokens whose probability sums to at least top_p (the top token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(rank >= top_k.unsqueeze(-1), float("-inf"))
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Rows with top_p == 1 keep everything, even when rounding lets the running sum reach 1 early.
        drop = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

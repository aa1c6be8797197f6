"""Turns a scheduled step into tensors, runs the model and samples: the engine loop's `Executor`
(`pdserve.engine.executor`) on the real model, with its `KVCache` for swaps.

The step arrives as a `SchedulerOutput` and is read only through its `Batch` snapshot (token ids,
start positions, block tables, sampling params), never through live `Request` objects. Layout of a step
(flat, no padding between requests): first every request with a single query token
(decodes), then the prompt chunks. All index tensors (positions, slot mapping, decode slot table, masks)
are built once per step on the host with tensor ops and shared by all layers. Logits are computed only
for the last token of each request that samples this step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata, DecodeGroup, PrefillSeq
from pdserve.batch import BatchRequest, ModelOutput
from pdserve.kv.cache import KVCache
from pdserve.model.llama import LlamaModel
from pdserve.request import Request, SamplingParams
from pdserve.runner.kernels import choose_sampling_kernels
from pdserve.runner.sampler import History, Sampler, SamplingMetadata
from pdserve.scheduler.scheduler import SchedulerOutput


__all__ = ["ModelOutput", "ModelRunner"]

_SCORE_ROWS = 256  # prompt positions scored at a time (`prompt_logprobs`)


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_cache: KVCache, attn: AttentionBackend, device: torch.device, seed: int = 0
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attn = attn
        self.device = device
        self.block_size = kv_cache.block_size
        self.vocab_size = model.cfg.vocab_size
        # (the logits the sampler gets, upcast=False, are in the activations' dtype: the embedding's)
        kernels = choose_sampling_kernels(self.vocab_size, model.embed.dtype, device)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed), kernels)
        self._generators: dict[str, torch.Generator] = {}  # req_id -> generator of a seeded request

    def apply_swaps(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        """Copy blocks between the host tier and the device: every swap-in, then every swap-out."""
        self.kv_cache.swap(swap_in, swap_out)

    def release(self, req_id: str) -> None:
        """Forget per-request state (called when a request finishes)."""
        self._generators.pop(req_id, None)

    def skip_draws(self, req: Request, num_draws: int) -> None:
        """Advance a seeded request's generator past draws made elsewhere (its first token, sampled by a
        prefill instance), so its later tokens equal those of a colocated run."""
        p = req.params
        if p.seed is None or p.is_greedy:
            return
        g = self._generators.get(req.req_id)
        if g is None:
            g = self._generators[req.req_id] = torch.Generator(device=self.device).manual_seed(p.seed)
        torch.rand(num_draws, device=self.device, generator=g)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None) -> ModelOutput:
        """Run one step. `after_layer(i)` is called once layer i's K/V are in the cache."""
        t0 = time.perf_counter()
        batch = out.to_batch()
        # Decodes first, by context length (so similar lengths share a padded attention group).
        scheduled = sorted(batch.requests, key=self._layout_key)
        hidden, last_index = self._forward(scheduled, after_layer)

        prompt_logprobs = self._prompt_logprobs(scheduled, hidden, last_index)
        # Sampling rows in scheduler order, so the scheduler can zip them with its own list.
        flat_pos = {id(r): last_index[j] for j, r in enumerate(scheduled)}
        sampling = batch.sampling
        if not sampling:
            return ModelOutput([], [], time.perf_counter() - t0, prompt_logprobs=prompt_logprobs)
        gens: dict[int, torch.Generator] = {}  # sampling request -> its generator, when seeded
        for i, r in enumerate(sampling):
            if r.params.seed is not None:
                g = self._generators.get(r.req_id)
                if g is None:
                    g = torch.Generator(device=self.device).manual_seed(r.params.seed)
                    self._generators[r.req_id] = g
                gens[i] = g
        if any(r.num_spec_tokens for r in sampling):
            out = self._verify(sampling, hidden, flat_pos, gens, t0)
            out.prompt_logprobs = prompt_logprobs
            return out
        rows = torch.tensor([flat_pos[id(r)] for r in sampling], device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows), upcast=False)
        params = [r.params for r in sampling]
        histories = [None if r.history is None else History(*r.history, r.stop_ids or ()) for r in sampling]
        allowed = [r.allowed[0] if r.allowed else None for r in sampling]
        md = SamplingMetadata.from_params(params, gens, self.vocab_size, self.device, histories, allowed)
        so = self.sampler(logits, md)
        token_ids = [[t] for t in so.token_ids.tolist()]
        logprobs: list[list[dict[int, float]] | None] = [None] * len(sampling)
        if so.logprobs is not None and so.logprob_token_ids is not None:
            lp, ids = so.logprobs.tolist(), so.logprob_token_ids.tolist()
            for row, p in enumerate(params):
                if p.logprobs is not None:
                    logprobs[row] = [dict(zip(ids[row][: p.logprobs + 1], lp[row][: p.logprobs + 1]))]
        return ModelOutput(token_ids, logprobs, time.perf_counter() - t0, prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(
        self, scheduled: list[BatchRequest], hidden: torch.Tensor, last_index: list[int]
    ) -> dict[str, list[dict[int, float]]] | None:
        """For the requests that score their prompt: per position of this step that predicts a prompt
        token, that token's logprob then the top `prompt_logprobs` alternatives. Logits are computed
        `_SCORE_ROWS` positions at a time (a 2k-token chunk's [rows, vocab] float32 logits whole would be
        400 MB at SmolLM2's 49,152 tokens)."""
        out: dict[str, list[dict[int, float]]] = {}
        for j, r in enumerate(scheduled):
            if not r.prompt_targets:
                continue
            k = r.params.prompt_logprobs or 0
            first = last_index[j] - r.num_new_tokens + 1
            targets = torch.tensor(r.prompt_targets, device=self.device)
            entries: list[dict[int, float]] = []
            for a in range(0, len(targets), _SCORE_ROWS):
                t = targets[a : a + _SCORE_ROWS]
                rows = torch.arange(first + a, first + a + len(t), device=self.device)
                lp = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, rows)), dim=-1)
                top_lp, top_ids = lp.topk(k, dim=-1)
                ids = torch.cat([t[:, None], top_ids], dim=-1).tolist()
                vals = torch.cat([lp.gather(-1, t[:, None]), top_lp], dim=-1).tolist()
                entries.extend(dict(zip(i, v)) for i, v in zip(ids, vals))
            out[r.req_id] = entries
        return out or None

    @torch.inference_mode()
    def logits_for(self, requests: list[BatchRequest], num_scored: list[int]) -> list[torch.Tensor]:
        """Run `requests` as one step, laid out and cached exactly like a scheduled one (their K/V are
        written by their block tables; earlier positions are read from the cache), and return for each
        the float32 logits of its last `num_scored[i]` tokens, `[num_scored[i], vocab]`, in the order
        given. Teacher-forced scoring (`pdserve.bench.accuracy`) wants every position's distribution,
        not a sample; the caller owns the block tables (allocated from the engine's block manager)."""
        assert len(num_scored) == len(requests)
        order = sorted(range(len(requests)), key=lambda i: self._layout_key(requests[i]))
        scheduled = [requests[i] for i in order]
        hidden, last_index = self._forward(scheduled)
        if not any(num_scored):  # a prompt prefill: only the cache is wanted
            return [hidden.new_empty(0, self.vocab_size, dtype=torch.float32) for _ in requests]
        rows = torch.cat([
            torch.arange(last_index[j] - num_scored[i] + 1, last_index[j] + 1) for j, i in enumerate(order)
        ])
        logits = self.model.compute_logits(hidden.index_select(0, rows.to(self.device)))
        pieces = dict(zip(order, logits.split([num_scored[i] for i in order])))
        return [pieces[i] for i in range(len(requests))]

    def _forward(
        self, scheduled: list[BatchRequest], after_layer: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """The model over a laid-out step. An int4 cache's blocks change state around it, once per step
        for all layers (kv/cache.py): before, blocks holding only committed tokens are sealed and the
        blocks written for the first time opened; after, the blocks this step filled with committed
        tokens (not drafts, which are committed only once accepted) are noted, for the next step to seal."""
        input_ids, positions, meta, last_index, table = self._prepare(scheduled)
        kv = self.kv_cache
        if not kv.is_int4:
            return self.model(input_ids, positions, kv.layers, meta, self.attn, after_layer), last_index
        bs = self.block_size
        before = torch.tensor([r.start // bs for r in scheduled])
        after = torch.tensor([(r.context_len - r.num_spec_tokens) // bs for r in scheduled])
        kv.begin_step(meta.slot_mapping, table, before)
        hidden = self.model(input_ids, positions, kv.layers, meta, self.attn, after_layer)
        kv.end_step(table, after)
        return hidden, last_index

    def _verify(
        self,
        sampling: list[BatchRequest],
        hidden: torch.Tensor,
        flat_pos: dict[int, int],
        gens: dict[int, torch.Generator],
        t0: float,
    ) -> ModelOutput:
        """A step with draft tokens: each sampling request's last k + 1 positions (its last known token
        and its k drafts, run like a short prompt chunk) give the logits the drafts are checked against."""
        rows: list[int] = []
        params: list[SamplingParams] = []
        drafts: list[int] = []
        histories: list[History | None] = []  # row j of a request with penalties: its sequence + j drafts
        allowed: list[bytes | None] = []  # row j of a request under a grammar: its mask after j drafts
        for r in sampling:
            k, last = r.num_spec_tokens, flat_pos[id(r)]
            rows.extend(range(last - k, last + 1))
            params.extend([r.params] * (k + 1))
            allowed.extend(r.allowed if r.allowed else [None] * (k + 1))
            own = r.token_ids[len(r.token_ids) - k :]
            drafts.extend(own)
            if r.history is None:
                histories.extend([None] * (k + 1))
            else:
                prompt, output = r.history
                histories.extend(History(prompt, (*output, *own[:j]), r.stop_ids or ()) for j in range(k + 1))
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=self.device)))
        md = SamplingMetadata.from_params(params, {}, self.vocab_size, self.device, histories, allowed)
        num_drafts = [r.num_spec_tokens for r in sampling]
        token_ids, final_rows = self.sampler.verify(logits, md, num_drafts, drafts, gens)
        logprobs: list[list[dict[int, float]] | None] = [None] * len(sampling)
        if md.max_num_logprobs is not None:
            raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
            top_lp, top_ids = raw.topk(min(md.max_num_logprobs, raw.shape[-1]), dim=-1)
            for i, r in enumerate(sampling):
                n = r.params.logprobs
                if n is None:
                    continue
                first = final_rows[i] - (len(token_ids[i]) - 1)
                logprobs[i] = [
                    {t: float(raw[first + j, t]), **dict(zip(top_ids[first + j, :n].tolist(), top_lp[first + j, :n].tolist()))}
                    for j, t in enumerate(token_ids[i])
                ]
        return ModelOutput(token_ids, logprobs, time.perf_counter() - t0)

    def _prepare(
        self, scheduled: list[BatchRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], torch.Tensor]:
        """Token ids, positions, attention metadata, each request's last flat row, and the block table
        `[num_reqs, max_blocks]` (int64, host, padded with 0) of the laid-out step."""
        bs = self.block_size
        token_ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        tables: list[list[int]] = []
        for r in scheduled:
            token_ids.extend(r.token_ids)
            starts.append(r.start)
            lens.append(r.num_new_tokens)
            tables.append(r.block_ids)

        num_reqs = len(scheduled)
        lens_t = torch.tensor(lens)
        starts_t = torch.tensor(starts)
        ctx_t = starts_t + lens_t
        max_blocks = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)

        cu = torch.cumsum(lens_t, 0)
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs), lens_t)
        positions = torch.arange(int(cu[-1])) - (cu - lens_t - starts_t)[req_of_token]
        slot_mapping = table[req_of_token, positions // bs] * bs + positions % bs
        # Requests of up to `max_decode_rows` new tokens (decodes; a verification's drafts and the token
        # before them) come first and attend as decode rows, each over its own causal prefix: row j of
        # such a request sees the context up to its own position, through the request's table row.
        num_decodes = sum(1 for n in lens if n <= self.attn.max_decode_rows)
        num_rows = int(cu[num_decodes - 1]) if num_decodes else 0
        row_req = req_of_token[:num_rows]
        row_ctx = positions[:num_rows] + 1
        groups = []
        max_waste = 0.25 if self.attn.pads_decodes else float("inf")
        for g0, g1 in _decode_groups(row_ctx.tolist(), max_waste):
            group_ctx = row_ctx[g0:g1]
            nb = -(-int(group_ctx.max()) // bs)
            groups.append(DecodeGroup(
                query_start=g0,
                num_seqs=g1 - g0,
                block_table=table[row_req[g0:g1], :nb].to(self.device),
                context_lens=group_ctx.to(self.device),
                mask=(torch.arange(nb * bs) < group_ctx[:, None]).view(g1 - g0, 1, 1, nb * bs).to(self.device),
            ))
        prefills: list[PrefillSeq] = []
        q_start = num_rows
        for i in range(num_decodes, num_reqs):
            n, ctx = lens[i], starts[i] + lens[i]
            blocks = mask = None
            if starts[i] > 0:
                nb = -(-ctx // bs)
                blocks = table[i, :nb].to(self.device)
                rows = torch.arange(n).unsqueeze(1) + starts[i]
                mask = (torch.arange(nb * bs).unsqueeze(0) <= rows).to(self.device)
            prefills.append(PrefillSeq(q_start, n, ctx, blocks, mask))
            q_start += n

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            num_decode_tokens=num_rows,
            decode_groups=groups,
            prefills=prefills,
            prefill_block_table=table[num_decodes:] if prefills else None,
            prefill_context_lens=ctx_t[num_decodes:] if prefills else None,
            prefill_query_starts=(cu - lens_t)[num_decodes:] if prefills else None,
            prefill_query_lens=lens_t[num_decodes:] if prefills else None,
        )
        last_index = (cu - 1).tolist()
        return torch.tensor(token_ids, device=dev), positions.to(dev), meta, last_index, table

    def _layout_key(self, r: BatchRequest) -> tuple[bool, int]:
        """Requests that attend as decode rows first (`_prepare`), then prompt chunks; each by context."""
        return (r.num_new_tokens > self.attn.max_decode_rows, r.start)


def _decode_groups(context_lens: list[int], max_waste: float = 0.25) -> list[tuple[int, int]]:
    """Split (near-)ascending context lengths into runs [start, end) whose padding to the run's longest wastes
    at most `max_waste` of the attended slots (a single run when lengths are similar)."""
    groups = []
    start, total = 0, 0
    for i, c in enumerate(context_lens):
        if i > start and (i - start + 1) * c > (1 + max_waste) * (total + c):
            groups.append((start, i))
            start, total = i, 0
        total += c
    if context_lens:
        groups.append((start, len(context_lens)))
    return groups

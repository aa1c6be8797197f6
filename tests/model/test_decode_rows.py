"""A request with a few new tokens (speculative verification: its drafts and the token before them)
attends as that many decode rows, each over its own causal prefix (`AttentionBackend.max_decode_rows`),
instead of as a prefill chunk: the runner lays such requests out with the decodes, and their rows equal
those of the same pieces run as prefill chunks."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from pdserve.batch import BatchRequest
from pdserve.request import Request, SamplingParams
from tests.support.tiny import TINY, random_prompts

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("dtype,block_size,atol", [("float32", 4, 1e-4), ("bfloat16", 16, 0.15)])
def test_short_pieces_attend_as_decode_rows(tiny_weights, dtype, block_size, atol):  # type: ignore[no-untyped-def]
    llm = LLM(dtype=dtype, device="cpu", model_config=TINY, weights=tiny_weights, num_blocks=64, block_size=block_size,
              attention_backend="cpu-paged")
    engine, runner = llm.engine, llm.engine.runner
    assert runner.attn.name == "cpu-paged" and runner.attn.max_decode_rows == 3
    prompts = random_prompts(4, 20, 40, seed=7)
    new = [1, 2, 3, 4]  # a decode, two verification-like pieces of several rows, one piece past the limit
    reqs, batch = [], []
    for i, (p, n) in enumerate(zip(prompts, new)):
        req = Request(f"rows-{i}", p, GREEDY)
        assert engine.block_manager.allocate_slots(req, len(p))
        reqs.append(req)
        runner.logits_for([BatchRequest(req.req_id, p[:-n], 0, list(req.block_ids), False, 0, GREEDY)], [0])
        batch.append(BatchRequest(req.req_id, p[-n:], len(p) - n, list(req.block_ids), False, 0, GREEDY))
    try:
        as_rows = runner.logits_for(batch, new)
        _, _, meta, _, _ = runner._prepare(sorted(batch, key=runner._layout_key))
        assert meta.num_decode_tokens == 1 + 2 + 3 and [p.query_len for p in meta.prefills] == [4]
        assert sorted(meta.decode_groups[0].context_lens.tolist()) == sorted(
            c for p, n in zip(prompts, new) if n <= 3 for c in range(len(p) - n + 1, len(p) + 1)
        )
        runner.attn.max_decode_rows = 1  # every piece of several tokens as a prefill chunk
        _, _, meta, _, _ = runner._prepare(sorted(batch, key=runner._layout_key))
        assert meta.num_decode_tokens == 1 and sorted(p.query_len for p in meta.prefills) == [2, 3, 4]
        as_chunks = runner.logits_for(batch, new)
    finally:
        for req in reqs:
            engine.block_manager.free(req)
    for a, b, n in zip(as_rows, as_chunks, new):
        assert a.shape == b.shape == (n, TINY.vocab_size)
        assert torch.allclose(a, b, atol=atol, rtol=0), (a - b).abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # A wrong prefix would show: the rows differ from each other's logits by far more than the tolerance.
    assert (as_rows[2][0] - as_rows[2][-1]).abs().max() > 10 * atol

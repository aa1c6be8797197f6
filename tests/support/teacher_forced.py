"""Next-token distributions of a whole token sequence through an engine's model, cache and attention, in
one prefill (teacher-forced): how the tests compare a quantized KV cache with an unquantized one."""

from __future__ import annotations

import torch

from pdserve.attention.base import AttentionMetadata, PrefillSeq


def teacher_forced_logprobs(engine, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Log-probabilities of the next token at every position of `ids` ([len(ids), vocab], float32)."""
    return torch.log_softmax(teacher_forced_logits(engine, ids), dim=-1)


@torch.inference_mode()
def teacher_forced_logits(engine, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Logits of the next token at every position of `ids` ([len(ids), vocab], float32), written into
    the engine's cache from block 0 on (the engine must hold no request). A quantized cache is read back
    for every position, as decode steps read it."""
    n, bs = len(ids), engine.kv_cache.block_size
    assert -(-n // bs) <= engine.kv_cache.num_blocks, "the sequence does not fit the engine's cache"
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), num_decode_tokens=0, decode_groups=[],
        prefills=[PrefillSeq(0, n, n, None, None)], prefill_block_table=torch.arange(-(-n // bs))[None],
        prefill_context_lens=torch.tensor([n]), prefill_query_starts=torch.tensor([0]),
        prefill_query_lens=torch.tensor([n]),
    )
    kv = engine.kv_cache
    table = meta.prefill_block_table
    if kv.is_int4:  # open the blocks written (state changes are the runner's, once per step)
        kv.begin_step(meta.slot_mapping, table, torch.zeros(1, dtype=torch.int64))
    hidden = engine.model(torch.tensor(ids), torch.arange(n), kv.layers, meta, engine.runner.attn)
    if kv.is_int4:  # the blocks are free again: their slots come back at the next step
        for b in range(-(-n // bs)):
            kv.note_freed(b, False)
    return engine.model.compute_logits(hidden).float()


def kl_and_top1(ref: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(ref || other) and whether the two argmaxes agree."""
    return (ref.exp() * (ref - other)).sum(-1), ref.argmax(-1) == other.argmax(-1)

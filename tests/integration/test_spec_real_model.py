"""N-gram speculation on the bundled SmolLM2 (float32): a prompt whose answer repeats its text gets drafts
accepted, and the greedy output equals plain decoding's."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.real_model

PROMPT = (
    "Repeat the following list exactly.\n"
    "apple, banana, cherry, dates, elderberry, fig, grape, honeydew, kiwi, lemon, mango\n"
    "apple, banana, cherry, dates, elderberry, fig, grape, honeydew, kiwi, lemon, mango\n"
)


@pytest.mark.timeout(900)  # two SmolLM2 engines in float32: ~110 s on the loaded 2-core machine
def test_greedy_output_is_unchanged_and_drafts_are_accepted() -> None:
    params = SamplingParams(temperature=0, max_tokens=40)
    want = LLM(dtype="float32", device="cpu", kv_cache_memory_gb=0.25).generate(PROMPT, params, use_tqdm=False)
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory_gb=0.25,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    got = llm.generate(PROMPT, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    stats = llm.engine.spec_decode_stats
    assert stats is not None and stats.num_accepted_tokens > 0

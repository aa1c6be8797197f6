"""The draft-model proposer on real weights (float32): Qwen2.5-Coder-0.5B drafting for the 1.5B gives
exactly the 1.5B's greedy tokens with drafts accepted (skips where the 1.5B is not installed; it needs
~12 GB while loading: run it alone), and a draft of another vocabulary (SmolLM2 for Qwen) is refused."""

from __future__ import annotations

import gc

import pytest

from pdserve import LLM, SamplingParams
from pdserve.errors import ModelLoadError
from pdserve.model.registry import get_model

pytestmark = pytest.mark.real_model

DRAFT, TARGET = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
PROMPTS = [
    "def quicksort(arr):",
    "# Fix the bug: the function should return the mean\ndef mean(xs):\n    return sum(xs) / len(xs) + 1\n"
    "# Fixed version:\ndef mean(xs):",
]


def _need(name: str) -> None:
    """Skip unless the model's file is at hand: assembled in the model cache, or its parts installed."""
    try:
        get_model(name).locate()  # type: ignore[union-attr]
    except (ModelLoadError, AttributeError) as e:
        pytest.skip(f"{name} is not installed: {e}")


@pytest.mark.timeout(1800)
def test_qwen_05b_drafting_for_15b_keeps_greedy_output() -> None:
    _need(DRAFT)
    _need(TARGET)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(TARGET, dtype="float32", device="cpu", kv_cache_memory_gb=0.25)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    del plain
    gc.collect()
    spec = {"method": "draft", "model": DRAFT, "num_speculative_tokens": 4, "draft_kv_cache_memory_gb": 0.1}
    llm = LLM(TARGET, dtype="float32", device="cpu", kv_cache_memory_gb=0.25, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.spec_decode_stats
    assert stats is not None and stats.num_accepted_tokens > 0


@pytest.mark.timeout(600)
def test_smollm2_draft_for_qwen_is_refused() -> None:
    _need(DRAFT)
    from pdserve.model.loader import default_model_path

    with pytest.raises(ValueError, match="vocabulary"):
        LLM(DRAFT, dtype="float32", device="cpu", kv_cache_memory_gb=0.1,
            speculative_config={"method": "draft", "model": default_model_path()})

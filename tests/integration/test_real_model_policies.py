"""The bundled SmolLM2 under every scheduling policy, chunk size and preemption mode gives exactly the
greedy tokens of one-request-at-a-time generation (float32): prompts that span many chunks, prefix-cache
hits that end in the middle of a chunk (second pass), and preemption by recompute and by swap."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model.loader import default_model_path, load_weights
from pdserve.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.real_model

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PARAGRAPH = (
    "Prefill processes the whole prompt in parallel and is bound by matrix multiplications, while decode "
    "emits one token per step for each sequence and re-reads the entire key-value cache, so it is bound by "
    "memory bandwidth. "
)


@pytest.fixture(scope="module")
def model():
    path = default_model_path()
    cfg, weights = load_weights(path, torch.float32)
    return cfg, weights, load_tokenizer(path)


@pytest.fixture(scope="module")
def prompts(model):
    tok = model[2]
    long = tok.encode(PARAGRAPH * 8)  # 361 tokens: ten chunks of 40
    return [
        long,
        long[:101] + tok.encode(" In short,"),  # shares 6 full blocks (96 tokens) with `long`
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):\n    "),
        tok.encode(PARAGRAPH * 3 + "Explain this to a child:"),
    ]


def make_llm(model, **kw) -> LLM:
    cfg, weights, tok = model
    return LLM(dtype="float32", device="cpu", model_config=cfg, weights=weights, tokenizer=tok, **kw)


@pytest.fixture(scope="module")
def reference(model, prompts):
    llm = make_llm(model, max_num_seqs=1, enable_prefix_caching=False, kv_cache_memory_gb=0.25)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize(
    "opts",
    [
        dict(scheduler="prefill-first"),
        dict(scheduler="chunked", max_num_batched_tokens=64, chunk_size=40),
        dict(scheduler="chunked", max_num_batched_tokens=48),
        dict(scheduler="decode-priority", max_num_batched_tokens=64, chunk_size=40),
        dict(scheduler="slo", max_num_batched_tokens=128),
        # 30 blocks of 16 tokens hold 480 tokens; the batch needs ~680 at once: requests are preempted.
        dict(scheduler="prefill-first", num_blocks=30, block_size=16),
        dict(scheduler="chunked", max_num_batched_tokens=64, chunk_size=40, num_blocks=30, block_size=16,
             preemption_mode="swap", swap_space_gb=0.05),
    ],
    ids=["prefill-first", "chunked-64-c40", "chunked-48", "decode-priority", "slo", "recompute-preemption",
         "swap-preemption"],
)
def test_policies_match_sequential_greedy(model, prompts, reference, opts):
    llm = make_llm(model, **opts)
    for _ in range(2):  # the second pass starts from prefix-cache hits
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == reference
    engine = llm.engine
    assert engine.block_manager.num_prefix_hit_tokens > 0
    if "num_blocks" in opts:
        assert engine.scheduler.num_preemptions > 0
    if opts.get("preemption_mode") == "swap":
        assert engine.scheduler.num_swapped_out_blocks > 0

"""Batched, paged, chunked, prefix-cached and preempted generation all give exactly the greedy tokens of
one-request-at-a-time generation (tiny random model, float32)."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from tests.support.tiny import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    ps = random_prompts(12, 3, 70, seed=11)
    # Shared prefixes so the prefix cache has something to find.
    ps += [ps[0] + [7, 8, 9], ps[0][:9] + [3], ps[1] + ps[2]]
    return ps


@pytest.fixture(scope="module")
def reference(tiny_weights, prompts):
    from tests.support.tiny import TINY
    from pdserve import LLM

    llm = LLM(dtype="float32", device="cpu", model_config=TINY, weights=tiny_weights, num_blocks=256,
              block_size=4, enable_prefix_caching=False, max_num_seqs=1)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(scheduler="chunked", max_num_batched_tokens=16),
        dict(scheduler="chunked", max_num_batched_tokens=64, chunk_size=7),
        dict(scheduler="prefill-first", max_num_batched_tokens=32),  # prompts longer than the budget
        dict(block_size=16),
        dict(attention_backend="cpu-paged", scheduler="chunked", max_num_batched_tokens=32),
        dict(scheduler="decode-priority", max_num_batched_tokens=32),
        dict(scheduler="slo", max_num_batched_tokens=16),
    ],
    ids=["default", "no-prefix-cache", "chunked-16", "chunked-64-c7", "prefill-first-32", "block16", "cpu-paged",
         "decode-priority", "slo-16"],
)
def test_batched_equals_sequential(make_tiny_llm, prompts, reference, opts):
    assert _tokens(make_tiny_llm(**opts), prompts) == reference


def test_prefix_cache_hits_and_same_output(make_tiny_llm, prompts, reference):
    llm = make_tiny_llm()
    assert _tokens(llm, prompts) == reference
    # Second pass: every prompt's full blocks are cached now.
    bm = llm.engine.block_manager
    hits_before = bm.num_prefix_hit_tokens
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert bm.num_prefix_hit_tokens > hits_before
    assert any(o.metrics.num_cached_tokens > 0 for o in outs)


@pytest.mark.parametrize("policy", ["prefill-first", "chunked", "decode-priority", "slo"])
def test_preemption_keeps_output(make_tiny_llm, prompts, reference, policy):
    # 40 blocks of 4 tokens cannot hold 15 sequences of up to ~90 tokens: requests get preempted.
    llm = make_tiny_llm(num_blocks=40, scheduler=policy, max_num_batched_tokens=64)
    assert _tokens(llm, prompts) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 40


@pytest.mark.parametrize("policy", ["prefill-first", "chunked", "decode-priority", "slo"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swap_preemption_keeps_output(make_tiny_llm, prompts, reference, policy, prefix_caching):
    """Preempted requests' KV goes to the host tier and back: same tokens, and nothing recomputed."""
    llm = make_tiny_llm(
        num_blocks=40, scheduler=policy, max_num_batched_tokens=64, preemption_mode="swap", swap_space_gb=0.01,
        enable_prefix_caching=prefix_caching,
    )
    engine = llm.engine
    assert _tokens(llm, prompts) == reference
    s = engine.scheduler
    assert s.num_preemptions > 0 and s.num_swapped_out_blocks > 0
    assert s.num_swapped_in_blocks == s.num_swapped_out_blocks
    if not prefix_caching:  # every token computed exactly once: the swapped KV was used, not recomputed
        computed = sum(r.num_prefill_tokens + r.num_decode_tokens for r in engine.step_records)
        assert computed == sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    assert engine.block_manager.num_free_blocks == 40
    assert s.host_pool is not None and s.host_pool.num_free_blocks == s.host_pool.num_blocks


def test_swap_preemption_keeps_seeded_sampling(make_tiny_llm, prompts):
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=20, ignore_eos=True)
    roomy = _tokens(make_tiny_llm(), prompts, params)
    llm = make_tiny_llm(num_blocks=40, scheduler="chunked", max_num_batched_tokens=64, preemption_mode="swap",
                        swap_space_gb=0.01)
    assert _tokens(llm, prompts, params) == roomy
    assert llm.engine.scheduler.num_swapped_out_blocks > 0


def test_no_blocks_leak_after_generation(make_tiny_llm, prompts):
    llm = make_tiny_llm(num_blocks=64)
    _tokens(llm, prompts)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_seeded_sampling_is_reproducible_across_batches(make_tiny_llm, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = _tokens(make_tiny_llm(), [prompts[0]], params)[0]
    mixed = _tokens(make_tiny_llm(), prompts[:6], [params] + [SamplingParams(temperature=1.0, max_tokens=5)] * 5)
    assert mixed[0] == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, seed=43, max_tokens=12, ignore_eos=True)
    assert _tokens(make_tiny_llm(), [prompts[0]], other_seed)[0] != alone


def test_stop_conditions(make_tiny_llm, prompts, reference):
    llm = make_tiny_llm()
    ref = reference[0]
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref[5]]), use_tqdm=False)[0]
    first = ref.index(ref[5])
    assert out.outputs[0].token_ids == ref[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == ref[5]
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_context_length_limit(make_tiny_llm):
    llm = make_tiny_llm(max_model_len=40)
    out = llm.generate([5] * 30, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40


def test_logprobs(make_tiny_llm, prompts, reference):
    llm = make_tiny_llm()
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 5
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token

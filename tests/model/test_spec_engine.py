"""Speculative decoding on the tiny random model (float32): n-gram drafts verified by the model runner
give exactly the greedy tokens of plain decoding under every policy, chunked prefill, preemption and the
prefix cache, and sampled outputs keep their distribution."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve import SamplingParams
from tests.support.tiny import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ps = random_prompts(6, 4, 30, seed=5)
    return [p + p for p in ps] + [ps[0] + [9]]  # repeated text, so lookups find matches


def tokens(llm, prompts, params=GREEDY) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(scheduler="prefill-first"),
        dict(scheduler="decode-priority"),
        dict(scheduler="slo"),
        dict(max_num_batched_tokens=16, chunk_size=8),
        dict(num_blocks=24),
        dict(num_blocks=24, preemption_mode="swap"),
    ],
)
def test_greedy_output_is_unchanged_by_speculation(make_tiny_llm, prompts, opts) -> None:  # type: ignore[no-untyped-def]
    want = tokens(make_tiny_llm(**opts), prompts)
    llm = make_tiny_llm(speculative_config=NGRAM, **opts)
    assert tokens(llm, prompts) == want
    stats = llm.engine.spec_decode_stats
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_logprobs_of_accepted_tokens_match_plain_decoding(make_tiny_llm, prompts) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    plain = make_tiny_llm().generate(prompts[:2], params, use_tqdm=False)
    spec = make_tiny_llm(speculative_config=NGRAM).generate(prompts[:2], params, use_tqdm=False)
    for a, b in zip(plain, spec):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None and len(la) == len(lb)
        for da, db in zip(la, lb):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)


def test_sampled_tokens_keep_their_distribution(make_tiny_llm) -> None:  # type: ignore[no-untyped-def]
    """Many seeded runs with and without speculation (different seeds: independent samples): each of the
X
    temperature that concentrates it on a few tokens."""
    # The prompt ends in what it likely continues with: the greedy output of its start repeats one
    # token, and lookups of a run of that token propose more of it.
    base = [5, 6, 7, 8, 9, 10]
    cont = tokens(make_tiny_llm(), [base], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    prompt = base + [cont[-1]] * 4
    n = 1500

    def sample(llm, seed0: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
        params = [SamplingParams(temperature=0.8, top_k=3, max_tokens=4, ignore_eos=True, seed=seed0 + s) for s in range(n)]
        return tokens(llm, [prompt] * n, params)

    plain = sample(make_tiny_llm(max_num_seqs=8), 0)
    llm = make_tiny_llm(max_num_seqs=8, speculative_config=NGRAM)  # (small steps: drafts are proposed)
    spec = sample(llm, 10_000)
    stats = llm.engine.spec_decode_stats
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len({tuple(t) for t in plain}) > 1  # a distribution, not one sequence
    for pos in range(4):
        a, b = Counter(t[pos] for t in plain), Counter(t[pos] for t in spec)
        tv = 0.5 * sum(abs(a[k] - b[k]) for k in a.keys() | b.keys()) / n
        assert tv < 0.07, (pos, tv, a.most_common(4), b.most_common(4))


@pytest.mark.parametrize(
    "rule",
    [dict(length_rule="slack", slo_tpot_ms=5.0), dict(length_rule="slack"), dict(length_rule="acceptance")],
)
def test_greedy_output_is_unchanged_by_the_length_rule(make_tiny_llm, prompts, rule) -> None:  # type: ignore[no-untyped-def]
    """Under the `slo` policy the slack rule reads the policy's step-time model (here learned from this
    machine's own steps, so how many drafts run is not fixed); whatever it picks, output is the same."""
    want = tokens(make_tiny_llm(scheduler="slo"), prompts)
    llm = make_tiny_llm(scheduler="slo", speculative_config={**NGRAM, **rule})
    assert tokens(llm, prompts) == want
    spec = llm.engine.spec_executor
    assert spec is not None and spec.stats.num_length_choices > 0
    assert (spec.step_model is not None) == (rule["length_rule"] == "slack")


def test_greedy_output_is_unchanged_by_per_request_targets(make_tiny_llm, prompts) -> None:  # type: ignore[no-untyped-def]
    """Two classes in one `slo` engine with the slack rule: interactive requests with tight targets of
    their own (TTFT, ITL, TPOT) beside batch requests with loose ones. Targets change the order and the
    lengths, never the tokens."""
    want = tokens(make_tiny_llm(scheduler="slo"), prompts)
    tight = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, slo_ttft_ms=1.0, slo_itl_ms=0.5, slo_tpot_ms=0.5
    )
    loose = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True,
        slo_ttft_ms=60_000, slo_itl_ms=60_000, slo_tpot_ms=60_000,
    )
    params = [tight if i % 2 else loose for i in range(len(prompts))]
    llm = make_tiny_llm(scheduler="slo", speculative_config={**NGRAM, "slo_tpot_ms": 1000.0})
    assert tokens(llm, prompts, params) == want
    spec = llm.engine.spec_executor
    assert spec is not None and spec.stats.num_length_choices > 0

"""Penalties, logit bias and min_tokens through the engine (tiny random model, float32): greedy outputs equal a
reference that penalises whole-sequence logits token by token, whatever the batching, chunking,
preemption, prefix cache or speculation; rows without penalties are untouched by rows with them."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from tests.support.teacher_forced import teacher_forced_logits
from tests.support.tiny import random_prompts
from tests.unit.test_sampler import penalised_by_hand

PENALISED = [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.4),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=-1.0, logit_bias={5: 1.5}),
    # repeats (drafts get accepted) and counts them: the speculative case fails if a row misses the drafts
    # before it in its counts
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=0.5, repetition_penalty=0.7),
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ps = random_prompts(6, 4, 40, seed=21)
    return [p + p for p in ps]  # repeated text: the penalties have something to act on, lookups find drafts


def tokens(llm, prompts, params) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def reference(llm, prompt: list[int], p: SamplingParams) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy decoding by hand: the whole sequence's last-position logits in one prefill per token,
    penalised token by token."""
    out: list[int] = []
    for _ in range(p.max_tokens):
        logits = teacher_forced_logits(llm.engine, prompt + out)[-1]
        out.append(int(penalised_by_hand(logits, p, prompt, out).argmax()))
    return out


@pytest.fixture(scope="module")
def references(tiny_weights, prompts) -> list[list[list[int]]]:  # type: ignore[no-untyped-def]
    from pdserve import LLM
    from tests.support.tiny import TINY

    llm = LLM(dtype="float32", device="cpu", model_config=TINY, weights=tiny_weights, num_blocks=64, block_size=4)
    return [[reference(llm, prompt, p) for prompt in prompts] for p in PENALISED]


def test_the_penalties_change_the_output(make_tiny_llm, prompts, references) -> None:  # type: ignore[no-untyped-def]
    plain = tokens(make_tiny_llm(), prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for ref in references:
        assert ref != plain


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(scheduler="chunked", max_num_batched_tokens=16, chunk_size=8),
        dict(num_blocks=24),  # preemption: recomputed sequences keep their counts
        dict(num_blocks=24, preemption_mode="swap"),
        dict(attention_backend="cpu-paged"),
        dict(speculative_config=NGRAM),  # drafts are counted for the rows after them
    ],
    ids=["default", "no-prefix-cache", "chunked", "recompute", "swap", "cpu-paged", "ngram"],
)
def test_penalised_greedy_equals_the_reference(make_tiny_llm, prompts, references, opts) -> None:  # type: ignore[no-untyped-def]
    llm = make_tiny_llm(**opts)
    for p, ref in zip(PENALISED, references):
        assert tokens(llm, prompts, p) == ref
    if "speculative_config" in opts:
        stats = llm.engine.spec_decode_stats
        assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_rows_without_penalties_are_untouched(make_tiny_llm, prompts, references) -> None:  # type: ignore[no-untyped-def]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = tokens(make_tiny_llm(), prompts, plain)
    mixed = tokens(make_tiny_llm(), prompts + prompts, [plain] * len(prompts) + [PENALISED[0]] * len(prompts))
    assert mixed[: len(prompts)] == alone
    assert mixed[len(prompts) :] == references[0]


def test_min_tokens_holds_back_a_stop_token(make_tiny_llm, prompts) -> None:  # type: ignore[no-untyped-def]
    """A stop token the greedy output reaches early is banned until min_tokens, then stops the output;
    tokens equal a by-hand reference, with and without speculation."""
    llm = make_tiny_llm()
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    cases = [(prompt, out[1]) for prompt, out in zip(prompts, first)]  # each stops at its 2nd token by default
    for opts in (dict(), dict(speculative_config=NGRAM)):
        engine_llm = make_tiny_llm(**opts)
        for prompt, stop in cases:
            p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
            got = engine_llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
            want: list[int] = []
            while len(want) < p.max_tokens and (not want or want[-1] != stop):
                logits = teacher_forced_logits(llm.engine, prompt + want)[-1]
                want.append(int(penalised_by_hand(logits, p, prompt, want, (stop,)).argmax()))
            assert got.token_ids == want
            assert len(want) >= 6 and stop not in want[:6]

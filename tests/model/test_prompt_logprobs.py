"""The prompt's own logprobs (`SamplingParams.prompt_logprobs`, the scoring eval harnesses do through
`echo`) equal a teacher-forced pass over the whole prompt, whatever the chunking, preemption, prefix cache
or speculation (tiny random model, float32)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve import SamplingParams
from pdserve.errors import InvalidRequestError
from tests.support.teacher_forced import teacher_forced_logprobs
from tests.support.tiny import random_prompts

K = 3
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ps = random_prompts(5, 2, 60, seed=31)
    return ps + [ps[0] + [7, 8, 9, 10, 11], [42]]  # a cached prefix, and a one-token prompt


@pytest.fixture(scope="module")
def expected(tiny_weights, prompts) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    from pdserve import LLM
    from tests.support.tiny import TINY

    llm = LLM(dtype="float32", device="cpu", model_config=TINY, weights=tiny_weights, num_blocks=64, block_size=4)
    return [teacher_forced_logprobs(llm.engine, p) for p in prompts]


def check(out, prompt: list[int], want: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row = got[i], want[i - 1]
        assert list(entry)[0] == prompt[i]  # the prompt token itself first
        assert entry[prompt[i]] == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        top = row.topk(K)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t] == pytest.approx(v, abs=1e-4)
        assert len(entry) in (K, K + 1)  # the prompt token may be among the top K


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(scheduler="chunked", max_num_batched_tokens=16, chunk_size=8),
        dict(scheduler="prefill-first", max_num_batched_tokens=32),
        dict(num_blocks=24),  # preemption: a recomputed prompt is not rated twice
        dict(num_blocks=24, preemption_mode="swap"),
        dict(attention_backend="cpu-paged"),
        dict(speculative_config=NGRAM),
    ],
    ids=["default", "chunked", "prefill-first", "recompute", "swap", "cpu-paged", "ngram"],
)
def test_prompt_logprobs_equal_a_teacher_forced_pass(make_tiny_llm, prompts, expected, opts) -> None:  # type: ignore[no-untyped-def]
    llm = make_tiny_llm(**opts)
    params = PARAMS if "num_blocks" not in opts else replace(PARAMS, max_tokens=40)  # long enough to preempt
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt, want in zip(outs, prompts, expected):
        check(out, prompt, want)
        assert out.outputs[0].finish_reason == "length"  # (max_tokens or, for the longest, the context)
    if "num_blocks" in opts:
        assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_a_cached_prefix_is_computed_again_for_scoring(make_tiny_llm, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    llm = make_tiny_llm()
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompts[0], plain, use_tqdm=False)
    assert llm.generate(prompts[5], plain, use_tqdm=False)[0].metrics.num_cached_tokens > 0  # a hit
    out = llm.generate(prompts[5], PARAMS, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    check(out, prompts[5], expected[5])


def test_greedy_output_and_plain_requests_are_unchanged(make_tiny_llm, prompts) -> None:  # type: ignore[no-untyped-def]
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_tiny_llm().generate(prompts, plain, use_tqdm=False)]
    mixed = make_tiny_llm().generate(prompts + prompts, [plain] * len(prompts) + [PARAMS] * len(prompts), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == want + want
    assert all(o.prompt_logprobs is None for o in mixed[: len(prompts)])


def test_prompt_logprobs_are_refused_with_disaggregation(make_tiny_llm) -> None:  # type: ignore[no-untyped-def]
    from pdserve.transfer.connector import RemotePrefill

    llm = make_tiny_llm()
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        llm.engine.add_request([1, 2, 3], PARAMS, kv_transfer=RemotePrefill("t"))
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)

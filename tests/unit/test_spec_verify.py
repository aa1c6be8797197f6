"""Sampler.verify: greedy accepts exactly the argmax prefix; rejection sampling with q = 1 gives each
token exactly the target distribution (chi-square over many seeded draws); with no drafts it draws
exactly what the plain sampler draws."""

from __future__ import annotations

import pytest
import torch

from pdserve.request import SamplingParams
from pdserve.runner.sampler import Sampler, SamplingMetadata

V = 6


def md_for(params: list[SamplingParams]) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, {}, V, torch.device("cpu"))


def test_greedy_accepts_the_argmax_prefix_plus_one_token() -> None:
    # Two requests: 3 drafts (rows 0..3), 1 draft (rows 4..5). Row argmaxes: 2, 4, 1, 5 | 3, 0.
    argmax = [2, 4, 1, 5, 3, 0]
    logits = torch.full((6, V), -1.0)
    logits[torch.arange(6), torch.tensor(argmax)] = 3.0
    g = SamplingParams(temperature=0)
    tokens, rows = Sampler().verify(logits, md_for([g] * 6), [3, 1], [2, 4, 0, 3], {})
    assert tokens == [[2, 4, 1], [3, 0]]  # first: 2 and 4 accepted, 0 rejected -> the argmax 1; second: bonus
    assert rows == [2, 5]
    tokens, _ = Sampler().verify(logits, md_for([g] * 6), [3, 1], [5, 4, 1, 1], {})
    assert tokens == [[2], [3]]  # first drafts rejected: only the correction token


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)])
def test_rejection_sampling_keeps_the_target_distribution(params: SamplingParams) -> None:
    """Two positions, draft tokens of high and low target probability: the first token and, given the
    first draft was accepted, the second are each distributed as the (processed) target."""
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 1.5
    md = md_for([params] * 3)
    sampler = Sampler()
    target = sampler._probs(logits.clone(), md)
    target = target / target.sum(-1, keepdim=True)
    likely, unlikely = int(target[0].argmax()), int(target[1].argmin())  # (unlikely may have p = 0)
    drafts = [likely, unlikely]
    n = 4_000
    first = torch.zeros(V)
    second = torch.zeros(V)
    for seed in range(n):
        gen = {0: torch.Generator().manual_seed(seed)}
        (tokens,), _ = sampler.verify(logits, md, [2], drafts, gen)
        first[tokens[0]] += 1
        if tokens[0] == likely:  # the second token is drawn from row 1 exactly when draft 0 is accepted
            second[tokens[1]] += 1
    # 99.9% quantile of chi-square with V - 1 = 5 degrees of freedom: 20.5.
    assert chi_square(first, target[0]) < 20.5
    assert chi_square(second, target[1]) < 20.5


def test_without_drafts_verify_draws_what_the_sampler_draws() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(4)]
    md = md_for(params)
    for seed in range(50):
        gens_a = {i: torch.Generator().manual_seed(seed * 10 + i) for i in range(4)}
        gens_b = {i: torch.Generator().manual_seed(seed * 10 + i) for i in range(4)}
        plain = Sampler()(logits, SamplingMetadata.from_params(params, gens_a, V, torch.device("cpu")))
        tokens, _ = Sampler().verify(logits, md, [0, 0, 0, 0], [], gens_b)
        assert [t[0] for t in tokens] == plain.token_ids.tolist()

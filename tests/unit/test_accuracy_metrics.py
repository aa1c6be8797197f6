"""The accuracy harness's pieces that need no model (pdserve/bench/accuracy.py): the metrics on hand-built
distributions, the step plan, the routing of an option's overrides and the ShareGPT conversations."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.bench.accuracy import (
    OPTIONS,
    Conversation,
    GreedyStats,
    OptionError,
    TeacherForcedStats,
    bootstrap_ratio_ci,
    first_divergence,
    kl_divergence,
    option_config,
    parse_option,
    perplexity,
    plan_steps,
    sample_conversations,
    select_options,
    step_targets,
    token_nll,
    top1_agreement,
)
from pdserve.config import EngineConfig


def logp(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


def test_kl_of_identical_distributions_is_zero():
    p = torch.log_softmax(torch.randn(5, 32, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(kl_divergence(p, p), torch.zeros(5, dtype=p.dtype))


def test_kl_known_values():
    p, q = logp([0.5, 0.5], [0.9, 0.1]), logp([0.9, 0.1], [0.5, 0.5])
    kl = kl_divergence(p, q)
    assert kl[0].item() == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))
    assert kl[1].item() == pytest.approx(0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5))
    assert kl[0].item() != pytest.approx(kl[1].item())  # not symmetric: the baseline is p


def test_kl_ignores_tokens_p_gives_no_mass_and_is_infinite_where_q_gives_none():
    assert kl_divergence(logp([1.0, 0.0]), logp([0.5, 0.5])).item() == pytest.approx(math.log(2))
    assert kl_divergence(logp([0.5, 0.5]), logp([1.0, 0.0])).item() == math.inf


def test_top1_and_nll_and_perplexity():
    p = logp([0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8])
    q = logp([0.4, 0.5, 0.1], [0.1, 0.6, 0.3], [0.1, 0.2, 0.7])
    assert top1_agreement(p, q).tolist() == [False, True, True]
    nll = token_nll(p, torch.tensor([0, 2, 2]))
    assert nll.tolist() == pytest.approx([-math.log(0.6), -math.log(0.3), -math.log(0.8)])
    assert perplexity(float(nll.sum()), 3) == pytest.approx((0.6 * 0.3 * 0.8) ** (-1 / 3))
    # a uniform distribution over V tokens has perplexity V
    assert perplexity(4 * math.log(8), 4) == pytest.approx(8)
    assert math.isnan(perplexity(0.0, 0))


def test_teacher_forced_stats_sum_over_positions():
    p = logp([0.4, 0.6], [0.9, 0.1])
    q = logp([0.9, 0.1], [0.9, 0.1])
    s = TeacherForcedStats()
    s.add(p, q, torch.tensor([0, 0]), positions=torch.tensor([5, 300]), conv_ids=torch.tensor([7, 2]))
    s.add(p[:1], p[:1], torch.tensor([1]), positions=torch.tensor([130]), conv_ids=torch.tensor([7]))
    out = s.summary()
    kl0 = 0.4 * math.log(0.4 / 0.9) + 0.6 * math.log(0.6 / 0.1)
    assert out["positions"] == 3 and out["conversations"] == 2
    kl_sum, count, agree = s.per_conversation()  # conversations 2 and 7, in index order
    assert kl_sum.tolist() == pytest.approx([0.0, kl0]) and count.tolist() == [1, 2] and agree.tolist() == [1, 1]
    assert out["conversation_mean_kl_p10_p50_p90"] == pytest.approx([0.1 * kl0 / 2, kl0 / 4, 0.9 * kl0 / 2])
    lo, hi = out["mean_kl_ci95"]
    assert 0.0 <= lo < out["mean_kl"] < hi <= kl0 / 2  # resampling conversation 2 alone gives 0, 7 alone kl0/2
    assert out["mean_kl"] == pytest.approx(kl0 / 3)
    assert out["max_kl"] == pytest.approx(kl0) and out["median_kl"] == 0.0
    assert out["p99_kl"] == pytest.approx(kl0 * 0.98)  # linear between the two largest of [0, 0, kl0]
    assert out["mean_kl_by_context"] == pytest.approx({"0-127": kl0, "128-255": 0.0, "256-511": 0.0})
    assert out["top1_agreement"] == pytest.approx(2 / 3)
    assert out["ppl"] == pytest.approx((0.9 * 0.9 * 0.6) ** (-1 / 3))
    assert out["base_ppl"] == pytest.approx((0.4 * 0.9 * 0.6) ** (-1 / 3))
    assert out["ppl_delta"] == pytest.approx(out["ppl"] / out["base_ppl"] - 1)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([4], [5]) == 0
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # one stopped (EOS) where the other went on
    assert first_divergence([], []) is None


def test_greedy_stats_summary():
    g = GreedyStats()
    g.add([1, 2, 3, 4], [1, 2, 3, 4])  # identical: counts as its length, 4
    g.add([1, 2, 3, 4], [1, 9, 9, 9])  # 1
    g.add([1, 2, 3, 4], [1, 2, 3, 5])  # 3
    s = g.summary()
    assert s["share_identical"] == pytest.approx(1 / 3)
    assert s["mean_first_divergence"] == pytest.approx(8 / 3)
    assert s["median_first_divergence"] == 3
    assert s["mean_first_divergence_diverged"] == pytest.approx(2)


def _convs(*shapes: tuple[int, int]) -> list[Conversation]:
    return [Conversation(list(range(1, p + 1)), list(range(100, 100 + r))) for p, r in shapes]


@pytest.mark.parametrize("chunk,max_batch", [(1, 1), (4, 2), (16, 8), (3, 3)])
def test_plan_covers_every_stream_position_once_and_scores_every_reply_token(chunk, max_batch):
    convs = _convs((5, 9), (1, 4), (12, 1), (3, 20), (7, 7))
    steps = plan_steps(convs, chunk, max_batch)
    ran: dict[int, list[int]] = {i: [] for i in range(len(convs))}
    scored: dict[int, list[int]] = {i: [] for i in range(len(convs))}
    for step in steps:
        assert 1 <= len(step) <= max_batch
        assert len({p.index for p in step}) == len(step)
        for p in step:
            ran[p.index].extend(range(p.start, p.start + p.num_tokens))
            first = p.first_reply_index(convs[p.index])
            scored[p.index].extend(range(first, first + p.num_scored))
            assert p.num_scored in (0, p.num_tokens) and p.num_tokens <= max(chunk, len(convs[p.index].prompt_ids))
        # the step's target tokens line up with its scored rows, piece by piece
        expected = [
            convs[p.index].reply_ids[p.first_reply_index(convs[p.index]) + k] for p in step for k in range(p.num_scored)
        ]
        targets, positions, conv_ids = step_targets(convs, step)
        assert targets.tolist() == expected
        assert positions.tolist() == [p.start + k for p in step for k in range(p.num_scored)]
        assert conv_ids.tolist() == [p.index for p in step for _ in range(p.num_scored)]
    for i, c in enumerate(convs):
        assert ran[i] == list(range(len(c.stream_ids)))
        assert scored[i] == list(range(len(c.reply_ids)))


@pytest.mark.parametrize("chunk,max_rows", [(8, 5), (1024, 16), (3, 1)])
def test_plan_scores_at_most_max_rows_per_step_and_still_covers_everything(chunk, max_rows):
    convs = _convs((5, 40), (1, 4), (12, 30), (3, 20), (7, 7))
    steps = plan_steps(convs, chunk, 4, max_rows)
    assert max(sum(p.num_scored for p in step) for step in steps) == max_rows
    scored: dict[int, list[int]] = {i: [] for i in range(len(convs))}
    for step in steps:
        assert step and sum(p.num_scored for p in step) <= max_rows
        for p in step:
            assert p.num_tokens > 0
            first = p.first_reply_index(convs[p.index])
            scored[p.index].extend(range(first, first + p.num_scored))
    assert all(scored[i] == list(range(len(c.reply_ids))) for i, c in enumerate(convs))
    # the cap is the only difference: without it the same conversations take fewer steps
    assert len(plan_steps(convs, chunk, 4, 10**6)) < len(steps)


def test_bootstrap_interval_covers_the_ratio_and_narrows_with_more_conversations():
    gen = torch.Generator().manual_seed(0)
    def draw(n):
        count = torch.randint(20, 200, (n,), generator=gen).double()
        return count * (2e-3 + 1e-3 * torch.randn(n, generator=gen, dtype=torch.float64)), count
    few, many = draw(8), draw(200)
    lo8, hi8 = bootstrap_ratio_ci(*few)
    lo, hi = bootstrap_ratio_ci(*many)
    assert lo8 < float(few[0].sum() / few[1].sum()) < hi8 and lo < float(many[0].sum() / many[1].sum()) < hi
    assert hi - lo < (hi8 - lo8) / 2  # 25x the conversations: about a fifth of the width
    assert bootstrap_ratio_ci(*many) == (lo, hi)  # seeded
    const = torch.full((5,), 3.0), torch.full((5,), 2.0)
    assert bootstrap_ratio_ci(*const) == pytest.approx((1.5, 1.5))


def test_plan_admits_a_new_conversation_as_soon_as_one_finishes():
    steps = plan_steps(_convs((2, 2), (2, 30), (2, 30)), chunk=4, max_batch=2)
    assert [p.index for p in steps[0]] == [0, 1]
    assert 2 in {p.index for p in steps[2]}  # conversation 0 ended in step 1 (prefill, then 2 tokens)


def test_option_overrides_go_to_the_dataclass_that_owns_them():
    base = EngineConfig()
    c = option_config(base, "mixed", {"dtype": "float32", "kv_cache_dtype": "int8", "max_num_seqs": 3})
    assert (c.dtype, c.cache.kv_cache_dtype, c.scheduler.max_num_seqs) == ("float32", "int8", 3)
    assert c.cache.block_size == base.cache.block_size
    assert option_config(base, "bf16", OPTIONS["bf16"]).dtype == "bfloat16"


def test_unknown_setting_or_value_fails_naming_the_option():
    with pytest.raises(OptionError, match="option 'w-int9'.*no engine setting 'weight_dtypo'"):
        option_config(EngineConfig(), "w-int9", {"weight_dtypo": "int8"})
    with pytest.raises(OptionError, match="option 'kv-int3'.*kv_cache_dtype"):
        option_config(EngineConfig(), "kv-int3", {"kv_cache_dtype": "int3"})
    with pytest.raises(OptionError, match="option 'nested'"):
        option_config(EngineConfig(), "nested", {"cache": {}})  # whole sub-configs are not settings


def test_options_are_chosen_by_name_baseline_first_and_defined_ones_added():
    name, overrides = parse_option('kv-int8-bs32={"kv_cache_dtype": "int8", "block_size": 32}')
    assert (name, overrides) == ("kv-int8-bs32", {"kv_cache_dtype": "int8", "block_size": 32})
    chosen = select_options("bf16", ["fp32", "bf16", "kv-int8-bs32", "fp32"], {name: overrides})
    assert list(chosen) == ["bf16", "fp32", "kv-int8-bs32"] and chosen["fp32"] == OPTIONS["fp32"]
    with pytest.raises(OptionError, match=r"unknown option\(s\) \['kv-int7'\]"):
        select_options("bf16", ["kv-int7"])
    for bad in ("kv-int8", "x={not json", "=[1]", 'x=["a list"]'):
        with pytest.raises(OptionError):
            parse_option(bad)


class FakeTokenizer:
    """One token per character; the chat template wraps the message in brackets."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(ch) for ch in text]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "[" + messages[0]["content"] + "]"


def test_sample_conversations_templates_the_prompt_and_cuts_the_reply():
    records = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        {"conversations": [{"from": "gpt", "value": "starts with the model"}, {"from": "human", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "q" * 20}, {"from": "gpt", "value": "long prompt"}]},
        {"conversations": [{"from": "human", "value": "ok"}, {"from": "gpt", "value": "ab"}]},  # reply too short
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]
    convs = sample_conversations(FakeTokenizer(), 10, records=records, max_total_len=14, min_reply_len=3)
    assert len(convs) == 1
    (c,) = convs
    assert c.prompt_ids == [1] + [ord(ch) for ch in "[hi]"]
    assert c.reply_ids == [ord(ch) for ch in "hello the"]  # cut: 5 prompt + 9 reply tokens = 14
    assert c.stream_ids == c.prompt_ids + c.reply_ids[:-1]

"""The accuracy harness (pdserve/bench/accuracy.py) end to end on the tiny random model: the same option
twice is bit-identical, fp32 against bf16 differs a little; teacher-forced rows come through the paged
cache (chunked scoring equals a one-shot prefill, and does not once the cache is wiped)."""

from __future__ import annotations

import pytest
import torch

from pdserve.batch import BatchRequest
from pdserve.bench.accuracy import (
    OPTIONS,
    Conversation,
    OptionError,
    base_config,
    build_engines,
    evaluate,
    format_table,
    kl_divergence,
    option_config,
    plan_steps,
    teacher_forced_rows,
)
from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import Request, SamplingParams
from pdserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from tests.support.tiny import TINY, random_prompts

CHOICES = {"bf16": OPTIONS["bf16"], "fp32": OPTIONS["fp32"], "bf16-again": OPTIONS["bf16"]}


@pytest.fixture(scope="module")
def engines(tiny_weights):
    base = base_config(None, device="cpu", max_total_len=96, max_tokens=12, max_num_seqs=4, block_size=4)
    return build_engines(base, CHOICES, lambda c: LLMEngine(c, model_config=TINY, weights=tiny_weights))


@pytest.fixture(scope="module")
def convs():
    prompts, replies = random_prompts(6, 2, 40, seed=1), random_prompts(6, 4, 50, seed=2)
    return [Conversation(p, r) for p, r in zip(prompts, replies)]


def test_same_option_twice_is_exact_and_fp32_differs_a_little(engines, convs):
    results = evaluate(engines, "bf16", convs, CHOICES, chunk=5, max_batch=3, max_tokens=12)
    results = {r.name: r for r in results}
    again, fp32 = results["bf16-again"], results["fp32"]
    n = sum(len(c.reply_ids) for c in convs)
    assert again.teacher_forced["positions"] == fp32.teacher_forced["positions"] == n
    assert again.teacher_forced["mean_kl"] == 0.0 and again.teacher_forced["max_kl"] == 0.0
    assert again.teacher_forced["top1_agreement"] == 1.0 and again.teacher_forced["ppl_delta"] == 0.0
    assert again.greedy is not None and again.greedy["share_identical"] == 1.0
    t = fp32.teacher_forced
    assert 0.0 < t["mean_kl"] < 1e-2, t
    assert t["top1_agreement"] > 0.9 and abs(t["ppl_delta"]) < 0.01
    assert fp32.greedy is not None and fp32.greedy["prompts"] == len(convs)
    for engine in engines.values():  # every scoring block went back
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    table = format_table("bf16", list(results.values()))
    assert "fp32" in table and "note: bf16-again is bit-identical" in table and "note: fp32" not in table


def _one_shot_logprobs(engine: LLMEngine, conv: Conversation) -> torch.Tensor:
    """The reply positions' log-probabilities from one prefill of the whole stream (nothing cached)."""
    stream = conv.stream_ids
    req = Request("one-shot", stream, SamplingParams())
    assert engine.block_manager.allocate_slots(req, len(stream))
    try:
        batch = [BatchRequest(req.req_id, stream, 0, list(req.block_ids), False, 0, req.params)]
        return torch.log_softmax(engine.runner.logits_for(batch, [len(conv.reply_ids)])[0], -1)
    finally:
        engine.block_manager.free(req)


@pytest.mark.parametrize("name,max_kl", [("fp32", 1e-5), ("bf16", 1e-3)])
@pytest.mark.parametrize("chunk", [1, 5])  # 1: every reply position is a decode
def test_chunked_scoring_reads_earlier_tokens_from_the_cache(engines, name, max_kl, chunk):
    engine = engines[name]
    conv = Conversation(random_prompts(1, 30, 30, seed=3)[0], random_prompts(1, 40, 40, seed=4)[0])
    one_shot = _one_shot_logprobs(engine, conv)
    steps = plan_steps([conv], chunk, 1)
    assert len(steps) > 2 and steps[0][0].num_scored == 0  # the prompt's prefill, then the reply in pieces
    chunked = torch.cat(list(teacher_forced_rows(engine, [conv], steps)))
    assert chunked.shape == one_shot.shape == (len(conv.reply_ids), TINY.vocab_size)
    assert kl_divergence(one_shot, chunked).max().item() < max_kl
    # The same with the prompt's K/V wiped after its prefill: the pieces see a different context.
    rows = teacher_forced_rows(engine, [conv], steps)
    prefill = next(rows)
    engine.kv_cache.data.zero_()
    wiped = torch.cat([prefill, *rows])
    assert kl_divergence(one_shot, wiped).max().item() > 0.05  # 50x the bf16 bound above


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_a_scoring_step_computes_what_a_scheduled_step_samples_from(tiny_weights, convs, option):
    """`ModelRunner.logits_for` runs a step as `execute` does: the same pieces run as a scheduled step
    sample, greedily, the argmax of logits_for's last row of each piece, with its log-probability. Every
    option this build has is checked, so a storage option that changes how a step runs is held here too
    once it is merged."""
    base = base_config(None, device="cpu", max_total_len=96, max_tokens=0, max_num_seqs=len(convs), block_size=4)
    try:
        config = option_config(base, option, OPTIONS[option])
    except OptionError as e:
        pytest.skip(str(e))
    engine = LLMEngine(config, model_config=TINY, weights=tiny_weights)
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    block_ids = {}
    for i, c in enumerate(convs):
        req = Request(f"score-{i}", c.stream_ids, greedy)
        assert engine.block_manager.allocate_slots(req, len(c.stream_ids))
        block_ids[i] = req.block_ids
    for step in plan_steps(convs, chunk=5, max_batch=3):
        pieces = [(p, convs[p.index].stream_ids[: p.start + p.num_tokens]) for p in step]
        batch = [BatchRequest(f"score-{p.index}", s[p.start :], p.start, block_ids[p.index], False, 0, greedy)
                 for p, s in pieces]
        ours = engine.runner.logits_for(batch, [p.num_tokens for p in step])  # every row, prompts' too
        scheduled = [
            ScheduledRequest(Request(f"score-{p.index}", s, greedy, num_computed_tokens=p.start,
                                     block_ids=list(block_ids[p.index])), p.num_tokens)
            for p, s in pieces
        ]
        sampled = engine.runner.execute(SchedulerOutput(scheduled))
        for (p, _), rows, tokens, logprobs in zip(pieces, ours, sampled.token_ids, sampled.logprobs):
            assert rows.shape == (p.num_tokens, TINY.vocab_size)
            last = torch.log_softmax(rows[-1], -1)
            assert tokens == [int(last.argmax())]
            assert logprobs is not None
            assert logprobs[0][tokens[0]] == pytest.approx(float(last.max()), abs=1e-5)


def test_a_value_only_the_engine_checks_fails_naming_the_option(tiny_weights):
    base = base_config(None, device="cpu", max_total_len=32, max_tokens=4, max_num_seqs=1, block_size=4)
    with pytest.raises(OptionError, match="option 'fp6'.*float6"):
        build_engines(base, {"fp6": {"dtype": "float6"}},
                      lambda c: LLMEngine(c, model_config=TINY, weights=tiny_weights))

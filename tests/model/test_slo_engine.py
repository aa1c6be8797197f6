"""The `slo` policy inside a real engine (tiny random model, float32): every step's measurement reaches
its step-time model, budgets that vary from step to step (a tight ITL target, the floor) still give
exactly the greedy tokens of one-request-at-a-time generation, and a refused request raises
`SLORejectedError` with nothing of it left in the engine."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import SLORejectedError
from pdserve.scheduler.policies import SLOAware
from tests.support.tiny import TINY, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def slo_engine(tiny_weights, **slo) -> LLMEngine:  # type: ignore[no-untyped-def]
    sc = SchedulerConfig(policy="slo", max_num_batched_tokens=64, **slo)
    config = EngineConfig(
        dtype="float32", device="cpu", cache=CacheConfig(block_size=4, num_blocks=256), scheduler=sc
    )
    return LLMEngine(config, model_config=TINY, weights=tiny_weights)


def run_all(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def test_every_step_feeds_the_model_and_outputs_match_sequential(tiny_weights, make_tiny_llm) -> None:
    prompts = random_prompts(8, 3, 60, seed=5)
    seq = make_tiny_llm(enable_prefix_caching=False, max_num_seqs=1)
    reference = [o.outputs[0].token_ids for o in seq.generate(prompts, GREEDY, use_tqdm=False)]

    # A target no step meets: every step runs at the floor of 3 prompt tokens beside all decodes.
    engine = slo_engine(tiny_weights, slo_itl_ms=0.001, slo_min_chunk=3)
    assert run_all(engine, prompts) == reference
    records = list(engine.step_records)
    assert max(r.num_prefill_tokens for r in records) == 3
    model = engine.scheduler.step_model
    assert model is not None and model.num_observations == len(records)
    assert model.last_measured == records[-1].duration
    assert all(c >= 0 for c in model.coefficients)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks

    # A target near the measured step times: the budget moves with the decodes and the model.
    engine = slo_engine(tiny_weights, slo_itl_ms=3.0, slo_min_chunk=1)
    assert run_all(engine, prompts) == reference


def test_rejected_request_leaves_nothing_behind(tiny_weights) -> None:
    engine = slo_engine(tiny_weights, slo_reject=True, slo_ttft_ms=0.001)
    policy = engine.scheduler.policy
    assert isinstance(policy, SLOAware)
    first = engine.add_request([5] * 20, GREEDY)  # an idle engine accepts anything
    with pytest.raises(SLORejectedError, match="time-to-first-token"):
        engine.add_request([6] * 20, GREEDY, req_id="refused")
    assert list(engine.scheduler.requests) == [first] and policy.num_rejected == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.abort_request("refused") is None  # never known to the engine
    engine.add_request([6] * 20, GREEDY, req_id="refused")  # idle again: accepted


def test_offline_generate_aborts_what_it_queued_when_one_is_refused(tiny_weights) -> None:
    llm = LLM.__new__(LLM)
    llm.engine = slo_engine(tiny_weights, slo_reject=True, slo_ttft_ms=0.001)
    with pytest.raises(SLORejectedError):
        llm.generate([[5] * 20, [6] * 20], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_rejection_reads_each_requests_own_ttft(tiny_weights) -> None:
    """The engine's TTFT target is generous; a request with a 0.001 ms target of its own is refused
    behind queued work, one with none (or a generous one) beside it is accepted."""
    engine = slo_engine(tiny_weights, slo_reject=True, slo_ttft_ms=60_000.0)
    engine.add_request([5] * 20, GREEDY)
    tight = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, slo_ttft_ms=0.001)
    with pytest.raises(SLORejectedError, match="target 0 ms"):
        engine.add_request([6] * 20, tight, req_id="tight")
    engine.add_request([6] * 20, GREEDY, req_id="plain")
    assert "plain" in engine.scheduler.requests and "tight" not in engine.scheduler.requests
    while engine.has_unfinished_requests():
        engine.step()

"""The simulator replays what the engine does: the same workload and settings give the same sequence of
steps (prompt tokens, decodes, context) on the tiny model and in `pdserve.sim.simulator`, preemptions
included: only the steps' durations are modelled."""

from __future__ import annotations

import random

import pytest

from pdserve import SamplingParams
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.sim.simulator import SimConfig, SimRequest, simulate


@pytest.mark.parametrize(
    "opts",
    [
        dict(scheduler="chunked", max_num_batched_tokens=32, max_num_seqs=8),
        dict(scheduler="prefill-first", max_num_batched_tokens=128, max_num_seqs=16),
        dict(scheduler="decode-priority", max_num_batched_tokens=48),
        dict(scheduler="chunked", max_num_batched_tokens=64, num_blocks=30),  # preempts
    ],
    ids=["chunked", "prefill-first", "decode-priority", "preempting"],
)
def test_simulated_steps_are_the_engines(make_tiny_llm, opts) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 90) for _ in range(rng.randint(3, 60))] for _ in range(14)]
    outputs = [rng.randint(1, 30) for _ in prompts]
    llm = make_tiny_llm(enable_prefix_caching=False, **opts)
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts, params, use_tqdm=False)
    real = [(s.num_prefill_tokens, s.num_decode_tokens, s.num_context_tokens) for s in engine.step_records]

    config = SimConfig(engine.scheduler.config, engine.block_manager.num_blocks, engine.block_manager.block_size)
    sim = simulate([SimRequest(len(p), n) for p, n in zip(prompts, outputs)], StepTimeModel(), config)
    assert [(s.prefill_tokens, s.decode_seqs, s.context_tokens) for s in sim.steps] == real
    assert sim.num_preemptions == engine.scheduler.num_preemptions
    if "num_blocks" in opts:
        assert sim.num_preemptions > 0

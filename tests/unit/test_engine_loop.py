"""The torch-free engine loop over the fake executor: outputs, time stamps from the scheduler's clock,
step records, failures replayed request by request, executor state released. No torch here (and the
loop, the executor seam and the fake executor must import none)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.loop import EngineLoop
from pdserve.errors import InvalidRequestError
from pdserve.kv.block_manager import BlockManager
from pdserve.request import SamplingParams
from pdserve.scheduler.policies import make_policy
from pdserve.scheduler.scheduler import Scheduler, SchedulerOutput
from pdserve.sim.fake_executor import FakeExecutor, KVConsistencyError, ManualClock, expected_output

EOS = 0
STEP_TIME = 0.25  # seconds per step on the manual clock, plus 0.01 per scheduled token


def step_time(out: SchedulerOutput) -> float:
    return STEP_TIME + 0.01 * out.num_batched_tokens


def make_loop(
    policy: str = "chunked", *, budget: int = 16, num_blocks: int = 64, block_size: int = 4
) -> tuple[EngineLoop, FakeExecutor, ManualClock]:
    clock = ManualClock(100.0)
    config = SchedulerConfig(policy=policy, max_num_batched_tokens=budget)
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(config, bm, make_policy(policy, config, clock=clock), clock=clock)
    executor = FakeExecutor(bm, clock=clock, step_time=step_time)
    loop = EngineLoop(sched, executor, vocab_size=8, max_model_len=64, eos_token_ids=frozenset({EOS}))
    return loop, executor, clock


def run(loop: EngineLoop, max_steps: int = 500) -> dict:
    done = {}
    for _ in range(max_steps):
        if not loop.has_unfinished_requests():
            return done
        for o in loop.step():
            if o.finished:
                done[o.request_id] = o
    raise AssertionError("did not finish")


def test_the_loop_and_its_fakes_import_no_torch() -> None:
    code = (
        "import sys; import pdserve.engine.loop, pdserve.engine.executor, pdserve.sim.fake_executor, "
        "pdserve.batch; bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("policy", ["prefill-first", "chunked"])
def test_outputs_equal_the_fake_models_greedy_tokens(policy: str) -> None:
    loop, executor, _ = make_loop(policy)
    prompts = [[1, 2, 3], [2, 3, 1, 2, 3, 1, 2], [3] * 20, [1]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = [loop.add_request(p, params) for p in prompts]
    done = run(loop)
    for req_id, prompt in zip(ids, prompts):
        out = done[req_id].outputs[0]
        assert out.token_ids == expected_output(prompt, 6) and out.finish_reason == "length"
    assert sorted(executor.released) == sorted(ids)  # every finished request's executor state released
    assert loop.block_manager.num_free_blocks == loop.block_manager.num_blocks


def test_time_stamps_come_from_the_schedulers_clock() -> None:
    loop, executor, clock = make_loop(budget=16)
    loop.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), req_id="a")
    clock.advance(1.0)
    loop.add_request([2, 2], SamplingParams(max_tokens=1, ignore_eos=True), req_id="b")
    outs = {}
    while loop.has_unfinished_requests():
        for o in loop.step():
            outs[o.request_id] = o
    a, b = outs["a"].metrics, outs["b"].metrics
    assert (a.arrival_time, b.arrival_time) == (100.0, 101.0)
    # Step 1 (at 101.0) runs both prompts: 5 tokens, 0.30 s; then a's two decodes of 0.26 s each.
    assert a.first_scheduled_time == b.first_scheduled_time == 101.0
    assert a.first_token_time == b.first_token_time == pytest.approx(101.30)
    assert b.finished_time == pytest.approx(101.30)
    assert a.finished_time == pytest.approx(101.30 + 2 * 0.26)
    records = list(loop.step_records)
    assert [r.start for r in records] == pytest.approx([101.0, 101.30, 101.56])
    assert [r.duration for r in records] == pytest.approx([0.30, 0.26, 0.26])
    shapes = [(r.num_prefill_tokens, r.num_decode_tokens, r.num_seqs) for r in records]
    assert shapes == [(5, 0, 2), (0, 1, 1), (0, 1, 1)]
    assert executor.num_steps == 3


def test_a_failing_step_is_replayed_and_fails_only_the_culprit() -> None:
    loop, executor, _ = make_loop("chunked")
    execute = executor.execute
    poison = 7

    def failing(out, after_layer=None):  # type: ignore[no-untyped-def]
        if any(poison in s.req.prompt_token_ids for s in out.scheduled):
            raise RuntimeError("injected failure")
        return execute(out, after_layer)

    executor.execute = failing  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    good = loop.add_request([1, 2, 3], params)
    loop.step()
    bad = loop.add_request([4, poison, 6], params)
    done = run(loop)
    assert done[bad].outputs[0].finish_reason == "error" and "injected failure" in done[bad].error
    assert done[good].outputs[0].token_ids == expected_output([1, 2, 3], 8)
    assert bad in executor.released
    assert loop.block_manager.num_free_blocks == loop.block_manager.num_blocks


def test_abort_releases_and_bad_prompts_are_refused() -> None:
    loop, executor, _ = make_loop()
    req_id = loop.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    loop.step()
    out = loop.abort_request(req_id)
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert executor.released == [req_id] and not loop.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="token ids"):
        loop.add_request("text needs a tokenizer")
    with pytest.raises(InvalidRequestError, match=r"\[0, 8\)"):
        loop.add_request([1, 8])
    with pytest.raises(InvalidRequestError, match="context length"):
        loop.add_request([1] * 64)


def test_the_fake_executor_catches_a_read_of_foreign_kv() -> None:
    """The fake executor is a checker: a block table pointing at K/V computed for another sequence fails."""
    loop, executor, _ = make_loop(block_size=2)
    a = loop.add_request([1, 2, 3, 1], SamplingParams(max_tokens=4, ignore_eos=True))
    loop.step()
    b = loop.add_request([3, 3, 3, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    loop.step()
    ra, rb = loop.scheduler.requests[a], loop.scheduler.requests[b]
    rb.block_ids[0], ra.block_ids[0] = ra.block_ids[0], rb.block_ids[0]  # corrupt both block tables
    with pytest.raises(KVConsistencyError, match="foreign K/V"):
        executor.execute(loop.scheduler.schedule())


def test_steps_that_accept_several_tokens_stream_them_as_one_delta() -> None:
    """Through the whole loop (outputs and their deltas): an executor speculating 2 tokens per step gives
    the same tokens and finish reasons as one token per step, in fewer steps, with multi-token deltas."""
    params = [
        SamplingParams(max_tokens=7, ignore_eos=True),
        SamplingParams(max_tokens=12, ignore_eos=False),
        SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=[3]),
    ]
    prompts = [[1, 2, 3], [2, 2, 1, 3, 1], [3, 1]]
    results = []
    for k in (0, 2):
        loop, executor, _ = make_loop("chunked")
        executor.num_spec_tokens = k
        ids = [loop.add_request(p, sp) for p, sp in zip(prompts, params)]
        streamed: dict[str, list[int]] = {i: [] for i in ids}
        finals = {}
        widest = 0
        while loop.has_unfinished_requests():
            for o in loop.step():
                streamed[o.request_id] += o.outputs[0].new_token_ids
                widest = max(widest, len(o.outputs[0].new_token_ids))
                if o.finished:
                    finals[o.request_id] = o.outputs[0]
        assert all(streamed[i] == finals[i].token_ids for i in ids)
        got = [(finals[i].token_ids, finals[i].finish_reason) for i in ids]
        results.append((got, executor.num_steps, widest))
    (one, steps_one, widest_one), (spec, steps_spec, widest_spec) = results
    assert spec == one and steps_spec < steps_one
    assert widest_one == 1 and widest_spec == 3


def test_a_policy_that_reads_time_gets_the_schedulers_clock() -> None:
    clock = ManualClock(5.0)
    config = SchedulerConfig(policy="slo")
    policy = make_policy("slo", config, clock=clock)
    assert policy.clock is clock  # type: ignore[attr-defined]
    assert make_policy("slo", config).clock is time.monotonic  # type: ignore[attr-defined]

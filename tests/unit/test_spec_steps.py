"""The multi-token step contract: with draft tokens a step accepts 1..k+1 tokens per request. Driven by
the fake executor speculating (perfect drafts, and drafts it rejects), the scheduler must give exactly the
outputs, stop conditions and max_tokens / context-length cuts of one token per step, roll back over
rejected drafts (the fake fails any read of their K/V as context), give their slots back and never hash
them into the prefix cache (the driver checks both after every step). Pure Python."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pdserve.request import FinishReason, Request
from pdserve.scheduler.scheduler import Scheduler
from pdserve.sim.fake_executor import model_token
from tests.support.scheduler_driver import Driver, assert_all_freed, expected_output, make_req, make_scheduler

POLICIES = ["prefill-first", "chunked"]
Draft = Callable[[list[int]], int]


def lossy_draft(tokens: list[int]) -> int:
    """A proposer that is wrong about every third position."""
    t = model_token(tokens)
    return (t + 1) % 4 if len(tokens) % 3 == 0 else t


def always_wrong(tokens: list[int]) -> int:
    return (model_token(tokens) + 1) % 4


def run_all(
    sched: Scheduler, reqs: list[Request], *, num_spec_tokens: int = 0, draft: Draft = model_token
) -> Driver:
    d = Driver(sched, num_spec_tokens=num_spec_tokens, draft=draft)
    for r in reqs:
        sched.add_request(r)
    d.run(max_steps=2_000)
    assert_all_freed(sched)
    return d


def result(r: Request) -> tuple:
    return r.output_token_ids, r.finish_reason, r.stop_reason


def test_perfect_drafts_give_three_tokens_per_step_and_cut_max_tokens_exactly() -> None:
    sched = make_scheduler("chunked", budget=16, block_size=2)
    prompt = [1, 2, 3]
    req = make_req("a", prompt, max_tokens=9)
    d = run_all(sched, [req], num_spec_tokens=2)
    assert req.output_token_ids == expected_output(prompt, 9)
    assert req.finish_reason is FinishReason.LENGTH
    # The prompt gives 1 token, then each step runs the last token and 2 drafts and accepts all three:
    # 1 + 3 + 3, and with 2 tokens left only 1 draft is worth proposing.
    assert [[s.num_new_tokens for s in out.scheduled] for out in d.outputs] == [[3], [3], [3], [2]]
    assert d.executor.num_steps == 4


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_spec_tokens, draft", [(2, model_token), (3, lossy_draft), (2, always_wrong)])
def test_speculation_changes_no_output(policy: str, num_spec_tokens: int, draft: Draft) -> None:
    """Seeded workloads with stops (EOS, stop token ids, max_tokens, the context length) landing anywhere
    among a step's accepted tokens, tight caches (preemption drops drafts) and prefix caching."""
    rng = random.Random(99)
    steps_one = steps_many = 0
    for _ in range(25):
        specs = []
        for i in range(rng.randint(1, 6)):
            prompt = [rng.randint(1, 3) for _ in range(rng.randint(1, 14))]
            kw = {
                "ignore_eos": rng.random() < 0.5,
                "stop_token_ids": (rng.randint(1, 3),) if rng.random() < 0.3 else (),
                "max_model_len": len(prompt) + rng.randint(1, 12) if rng.random() < 0.3 else 0,
            }
            specs.append((f"r{i}", prompt, rng.randint(1, 12), kw))
        block_size = rng.choice([1, 2, 4])
        need = max(-(-(len(p) + m) // block_size) for _, p, m, _ in specs)
        config = dict(
            budget=rng.randint(4, 24), max_num_seqs=rng.randint(1, 6), block_size=block_size,
            num_blocks=need + rng.randint(0, 6), prefix_caching=rng.random() < 0.7,
        )
        one = [make_req(i, p, m, **kw) for i, p, m, kw in specs]
        base = run_all(make_scheduler(policy, **config), one)
        many = [make_req(i, p, m, **kw) for i, p, m, kw in specs]
        d = run_all(make_scheduler(policy, **config), many, num_spec_tokens=num_spec_tokens, draft=draft)
        assert [result(r) for r in many] == [result(r) for r in one]
        steps_one += base.executor.num_steps
        steps_many += d.executor.num_steps
    if draft is model_token:  # every draft accepted: the same tokens in far fewer steps
        assert steps_many < 0.75 * steps_one


def stop_at(index: int, num_spec_tokens: int) -> Driver:
    """A stop token id as output token `index`, inside the tokens one step accepts: the request stops
    there and the accepted tokens after it are dropped."""
    prompt = [1, 2, 3, 1]
    ref = expected_output(prompt, 8)
    stop = ref[index]
    assert stop not in ref[:index]
    sched = make_scheduler("chunked", block_size=2)
    req = make_req("a", prompt, max_tokens=8, stop_token_ids=(stop,))
    d = run_all(sched, [req], num_spec_tokens=num_spec_tokens)
    assert req.output_token_ids == ref[: index + 1]
    assert req.finish_reason is FinishReason.STOP and req.stop_reason == stop
    return d


def test_a_stop_among_accepted_tokens_drops_the_rest() -> None:
    ref = expected_output([1, 2, 3, 1], 8)
    index = next(i for i in range(2, 8) if ref[i] not in ref[:i])  # a token first seen past the prompt step
    d = stop_at(index, num_spec_tokens=3)
    # The prompt step gives 1 token; the next verifies 3 drafts and accepts up to 4, the stop among them.
    assert index < 5 and [s.num_new_tokens for out in d.outputs for s in out.scheduled] == [4, 4]


def test_rejected_drafts_are_recomputed_not_read() -> None:
    """Every draft wrong: each step accepts exactly one token, and the slots the drafts wrote are written
    again by the next step (the fake executor fails a read of them as context)."""
    sched = make_scheduler("chunked", budget=16, block_size=2, prefix_caching=True)
    prompt = [2, 1, 3, 3]
    req = make_req("a", prompt, max_tokens=6)
    d = run_all(sched, [req], num_spec_tokens=3, draft=always_wrong)
    assert req.output_token_ids == expected_output(prompt, 6)
    # The prompt, then one token per step: each runs its token and min(3, tokens still wanted - 1) drafts.
    assert [s.num_new_tokens for out in d.outputs for s in out.scheduled] == [4, 4, 4, 3, 2, 1]

"""Scheduler: the token budget, admission order, preemption (recompute and swap), aborts and token-level
stops, driven by a fake runner (no model). Pure Python: no torch here.

The fake runner keeps a model of what each KV slot holds, on the device and in the host tier, so a step
that reads K/V nobody computed (a bad prefix hit, a block given to two requests, a lost recomputation, a
swap copied from or to the wrong block or in the wrong order) fails, and it samples a token that depends
on the whole sequence, so a lost or duplicated output token changes every later one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.config import SchedulerConfig
from pdserve.kv.block_manager import BlockManager
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.scheduler.policies import make_policy
from pdserve.scheduler.scheduler import Scheduler
from tests.support.scheduler_driver import (
    EOS,
    Driver,
    assert_all_freed,
    expected_output,
    make_req,
    make_scheduler,
)

POLICIES = ["prefill-first", "chunked"]


# ---- random workloads ------------------------------------------------------------------------------


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    budget: int
    max_num_seqs: int
    chunk_size: int | None
    prefix_caching: bool
    arrivals: list[tuple[int, list[int], int]]  # (step, prompt, max_tokens), in arrival order
    aborts: list[tuple[int, int, bool]]  # (step, index into arrivals, while its step is in flight)
    num_host_blocks: int = 0  # > 0: preemption swaps


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4]))
    budget = draw(st.integers(1, 24))
    base = draw(st.lists(st.integers(1, 3), min_size=24, max_size=24))
    arrivals = []
    step = 0
    for _ in range(draw(st.integers(1, 8))):
        step += draw(st.integers(0, 3))
        prompt = base[: draw(st.integers(0, 24))] + draw(st.lists(st.integers(1, 3), max_size=6))
        arrivals.append((step, prompt or [1], draw(st.integers(1, 8))))
    # Small caches force preemption; the longest request must still fit alone.
    min_blocks = max(-(-(len(p) + m) // block_size) for _, p, m in arrivals)
    aborts = draw(
        st.lists(st.tuples(st.integers(0, 40), st.integers(0, len(arrivals) - 1), st.booleans()), max_size=2)
    )
    return Workload(
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, min_blocks + 16)),
        budget=budget,
        max_num_seqs=draw(st.integers(1, 6)),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, budget))),
        prefix_caching=draw(st.booleans()),
        arrivals=arrivals,
        aborts=aborts,
    )


def run_workload(policy: str, w: Workload, seed: int) -> Driver:
    sched = make_scheduler(
        policy,
        budget=w.budget,
        max_num_seqs=w.max_num_seqs,
        num_blocks=w.num_blocks,
        block_size=w.block_size,
        chunk_size=w.chunk_size,
        prefix_caching=w.prefix_caching,
        num_host_blocks=w.num_host_blocks,
    )
    rng = random.Random(seed)
    driver = Driver(sched, sample=lambda req: rng.randrange(4))  # EOS included: ignore_eos must hold
    reqs = [make_req(f"r{i}", p, m) for i, (_, p, m) in enumerate(w.arrivals)]
    aborted: set[str] = set()

    def abort(i: int) -> None:
        if sched.finish_request(reqs[i].req_id, FinishReason.ABORT) is not None:
            aborted.add(reqs[i].req_id)

    for step in range(1_500):
        for i, (t, _, _) in enumerate(w.arrivals):
            if t == step:
                sched.add_request(reqs[i])
        for t, i, in_flight in w.aborts:
            if t == step and not in_flight:
                abort(i)
        in_flight = [i for t, i, f in w.aborts if t == step and f]
        if not sched.has_unfinished_requests():
            if step > max(t for t, _, _ in w.arrivals):
                break
            continue
        out = driver.step(lambda out: [abort(i) for i in in_flight])
        assert out.scheduled or out.preempted or out.swap_in, "stuck: unfinished requests but nothing scheduled"
    else:
        raise AssertionError("did not finish")

    for r in reqs:
        assert r.is_finished
        if r.req_id in aborted:
            assert r.finish_reason is FinishReason.ABORT
        else:
            assert r.finish_reason is FinishReason.LENGTH
            assert r.num_output_tokens == r.params.max_tokens
    arrival_order = [r.req_id for r in reqs]
    assert driver.first_scheduled == [i for i in arrival_order if i in driver.first_scheduled], "FIFO broken"
    assert set(arrival_order) - set(driver.first_scheduled) <= aborted, "a request never ran"
    assert_all_freed(sched)
    return driver


WORKLOAD_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy", POLICIES)
@WORKLOAD_SETTINGS
@given(w=workloads(), seed=st.integers(0, 2**16))
def test_random_workloads(policy: str, w: Workload, seed: int) -> None:
    run_workload(policy, w, seed)


@pytest.mark.parametrize("policy", POLICIES)
@WORKLOAD_SETTINGS
@given(w=workloads(), num_host_blocks=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_random_workloads_swap(policy: str, w: Workload, num_host_blocks: int, seed: int) -> None:
    """The same workloads with a host tier, from one block (mostly recompute) to plenty."""
    w.num_host_blocks = num_host_blocks
    run_workload(policy, w, seed)


def seeded_workload(rng: random.Random, num_host_blocks: int = 0) -> Workload:
    """A workload with a tight cache (the longest request just fits, plus up to 4 blocks) from `rng`."""
    block_size = rng.choice([1, 2, 4])
    arrivals = []
    for i in range(rng.randint(3, 8)):
        prompt = [rng.randint(1, 3) for _ in range(rng.randint(1, 20))]
        arrivals.append((i // 2, prompt, rng.randint(1, 12)))
    min_blocks = max(-(-(len(p) + m) // block_size) for _, p, m in arrivals)
    budget = rng.randint(4, 24)
    return Workload(
        block_size, min_blocks + rng.randint(0, 4), budget, rng.randint(2, 6),
        rng.choice([None, rng.randint(1, budget)]), rng.random() < 0.5, arrivals, [], num_host_blocks,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_seeded_workloads_preempt_and_finish(policy: str) -> None:
    """Fixed seeds with a tight cache: preemption must actually happen, and everything still finishes."""
    rng = random.Random(1234)
    total_preempted = 0
    for _ in range(30):
        w = seeded_workload(rng)
        total_preempted += run_workload(policy, w, rng.randrange(2**16)).num_preempted
    assert total_preempted > 0


# ---- policies --------------------------------------------------------------------------------------


def test_prefill_first_runs_prompts_alone_then_decodes_together() -> None:
    sched = make_scheduler("prefill-first", budget=16)
    d = Driver(sched)
    a = make_req("a", [1, 2, 3], max_tokens=4)
    sched.add_request(a)
    out = d.step()
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 3)]
    out = d.step()
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1)]
    b = make_req("b", [4, 5, 6, 7, 8], max_tokens=2)
    sched.add_request(b)
    out = d.step()  # b's prompt runs alone: a's decode stalls
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("b", 5)]
    assert out.num_decode_tokens == 0
    out = d.step()
    assert sorted((s.req.req_id, s.num_new_tokens) for s in out.scheduled) == [("a", 1), ("b", 1)]
    d.run()
    assert a.output_token_ids == expected_output([1, 2, 3], 4)
    assert b.output_token_ids == expected_output([4, 5, 6, 7, 8], 2)
    assert_all_freed(sched)


def test_prefill_first_chunks_a_prompt_larger_than_the_budget() -> None:
    sched = make_scheduler("prefill-first", budget=8)
    d = Driver(sched)
    big = make_req("big", list(range(1, 21)), max_tokens=2)
    small = make_req("small", [5, 5, 5], max_tokens=2)
    sched.add_request(big)
    sched.add_request(small)
    sizes = [[(s.req.req_id, s.num_new_tokens) for s in d.step().scheduled] for _ in range(3)]
    # big takes the whole budget twice; its last 4 tokens leave room for all of small.
    assert sizes == [[("big", 8)], [("big", 8)], [("big", 4), ("small", 3)]]
    d.run()
    assert big.output_token_ids == expected_output(list(range(1, 21)), 2)
    assert_all_freed(sched)


def test_prefill_first_keeps_a_prompt_that_fits_the_budget_whole() -> None:
    """After a long prompt's last chunk, what is left of the step is too small for the next prompt:
    that prompt waits for the next step instead of being split (whole prompts)."""
    sched = make_scheduler("prefill-first", budget=8)
    d = Driver(sched)
    sched.add_request(make_req("big", list(range(1, 11)), max_tokens=1))  # 8 + 2
    sched.add_request(make_req("mid", [7] * 7, max_tokens=1))
    steps = [[(s.req.req_id, s.num_new_tokens) for s in d.step().scheduled] for _ in range(3)]
    assert steps == [[("big", 8)], [("big", 2)], [("mid", 7)]]


@pytest.mark.parametrize(
    "num_blocks, budget, block_size, first, second",
    [
        # A prompt chunked over many steps runs out of blocks that a stalled decode holds.
        (16, 1, 1, ([1, 1], 2), ([1] * 15, 1)),
        # The same with a recomputation: its last token is a decode, which the prompt steps stall.
        (6, 1, 1, ([1], 4), ([1, 1, 1, 1], 2)),
        (11, 2, 2, ([1] * 19, 2), ([1, 1, 1], 1)),
    ],
)
def test_prefill_first_does_not_livelock_on_stalled_decodes(
    num_blocks: int, budget: int, block_size: int, first: tuple, second: tuple
) -> None:
    """Used to loop forever: the prompt preempted itself, was readmitted in the same step and restarted,
    while the decode holding the blocks never got a step."""
    sched = make_scheduler(
        "prefill-first", budget=budget, max_num_seqs=2, num_blocks=num_blocks, block_size=block_size,
        prefix_caching=False,
    )
    d = Driver(sched)
    reqs = [make_req("a", *first), make_req("b", *second)] + [make_req(f"c{i}", [1], 1) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    d.run(max_steps=300)
    for r, (prompt, max_tokens) in zip(reqs, [first, second] + [([1], 1)] * 3):
        assert r.output_token_ids == expected_output(prompt, max_tokens)
    assert_all_freed(sched)


def test_chunked_runs_decodes_beside_prompt_chunks() -> None:
    sched = make_scheduler("chunked", budget=8, chunk_size=4)
    d = Driver(sched)
    a = make_req("a", [1, 2], max_tokens=10)
    sched.add_request(a)
    d.step()
    sched.add_request(make_req("b", list(range(1, 15)), max_tokens=2))
    for _ in range(4):  # b's 14 prompt tokens in chunks of 4, a decoding in every step
        out = d.step()
        got = {s.req.req_id: s.num_new_tokens for s in out.scheduled}
        assert got["a"] == 1 and got["b"] <= 4
    d.run()
    assert a.output_token_ids == expected_output([1, 2], 10)
    assert_all_freed(sched)


def test_chunked_without_chunk_size_fills_the_budget() -> None:
    sched = make_scheduler("chunked", budget=8)
    d = Driver(sched)
    sched.add_request(make_req("a", [1, 2], max_tokens=10))
    d.step()
    sched.add_request(make_req("b", list(range(1, 21)), max_tokens=1))
    out = d.step()
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 7)


@pytest.mark.parametrize("policy", POLICIES)
def test_max_num_seqs_caps_admission(policy: str) -> None:
    sched = make_scheduler(policy, budget=64, max_num_seqs=2)
    d = Driver(sched)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", [1, 2, 3], max_tokens=3))
    out = d.step()
    assert [s.req.req_id for s in out.scheduled] == ["r0", "r1"]
    d.run()
    assert d.first_scheduled == ["r0", "r1", "r2", "r3", "r4"]


@pytest.mark.parametrize("policy", POLICIES)
def test_single_token_prompt_chunks_count_as_prefill(policy: str) -> None:
    """The last token of a prompt (a 1-token prompt, or the 1 token a prefix hit leaves) is prompt work,
    not a decode, even though it is a single token."""
    sched = make_scheduler(policy, block_size=4)
    d = Driver(sched)
    sched.add_request(make_req("one", [3], max_tokens=1))
    out = d.step()
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (1, 0)
    sched.add_request(make_req("a", [1, 2, 3, 4, 5], max_tokens=1))
    d.step()
    sched.add_request(make_req("b", [1, 2, 3, 4, 5], max_tokens=1))  # 4 tokens hit: 1 left
    out = d.step()
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("b", 1)]
    assert sched.block_manager.num_prefix_hit_tokens == 4
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (1, 0)


def test_prefix_hit_skips_cached_tokens() -> None:
    sched = make_scheduler("chunked", block_size=4)
    d = Driver(sched)
    a = make_req("a", list(range(1, 11)), max_tokens=3)
    sched.add_request(a)
    d.run()
    b = make_req("b", list(range(1, 11)) + [9], max_tokens=3)
    sched.add_request(b)
    out = d.step()
    assert b.num_cached_tokens == 8
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("b", 3)]
    d.run()
    assert b.output_token_ids == expected_output(list(range(1, 11)) + [9], 3)
    assert_all_freed(sched)


# ---- preemption ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_recomputes_and_finishes(policy: str) -> None:
    # 6 blocks of 2 tokens; three requests of 4 + 6 tokens cannot all stay resident.
    sched = make_scheduler(policy, budget=16, num_blocks=6, block_size=2)
    d = Driver(sched)
    prompts = {"a": [1, 2, 3, 1], "b": [2, 3, 1, 2], "c": [3, 1, 2, 3]}
    reqs = [make_req(k, p, max_tokens=6) for k, p in prompts.items()]
    for r in reqs:
        sched.add_request(r)
    d.run()
    assert sched.num_preemptions > 0 and d.num_preempted == sched.num_preemptions
    assert any(r.num_preemptions for r in reqs)
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_token_ids == expected_output(prompts[r.req_id], 6)  # nothing lost or duplicated
    assert d.first_scheduled == ["a", "b", "c"]
    assert_all_freed(sched)


def test_chunked_recomputation_respects_chunk_size() -> None:
    """A preempted request recomputes its prompt and its outputs; past the prompt it is still chunked,
    so the decodes beside it keep their token every step."""
    sched = make_scheduler(
        "chunked", budget=8, num_blocks=9, block_size=1, chunk_size=2, prefix_caching=False
    )
    d = Driver(sched)  # checks chunk_size and decode starvation every step
    a, b = make_req("a", [1, 2], max_tokens=6), make_req("b", [3, 4], max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    d.run()
    assert b.num_preemptions and not a.num_preemptions
    chunks = [s.num_new_tokens for out in d.outputs for s in out.scheduled if s.req is b]
    recompute = [n for n in chunks if n > 1]
    assert len(recompute) >= 3  # the first prompt, then the recomputation of 2 + >= 2 tokens in chunks
    assert b.output_token_ids == expected_output([3, 4], 6)
    assert_all_freed(sched)


def test_preempted_request_goes_back_to_the_front_of_the_queue() -> None:
    sched = make_scheduler("chunked", budget=16, num_blocks=4, block_size=2, max_num_seqs=2)
    d = Driver(sched)
    a, b, c = (make_req(k, [t, 2, 3], max_tokens=5) for k, t in zip("abc", (1, 2, 3)))
    for r in (a, b, c):
        sched.add_request(r)
    while not d.outputs or not d.outputs[-1].preempted:
        d.step()
    victim = d.outputs[-1].preempted[0]
    assert victim is b  # the most recently admitted
    assert list(sched.waiting) == [b, c]
    d.run()
    assert_all_freed(sched)


# ---- swap to the host tier -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_seeded_workloads_swap_out_and_back(policy: str) -> None:
    """Fixed seeds, tight caches and a host tier: requests really are swapped out and back (the driver
    checks every copy against its model of both tiers), and everything finishes with no block leaked."""
    rng = random.Random(4321)
    swapped_out = swapped_in = 0
    for _ in range(30):
        w = seeded_workload(rng, num_host_blocks=64)
        d = run_workload(policy, w, rng.randrange(2**16))
        swapped_out += d.num_swapped_out
        swapped_in += d.num_swapped_in
    assert swapped_out > 0 and swapped_in == swapped_out


@pytest.mark.parametrize("policy", POLICIES)
def test_swap_never_recomputes(policy: str) -> None:
    """With room on the host, a preempted request keeps every computed token: each token of each
    sequence is computed exactly once (no prefix cache to hide a recomputation)."""
    sched = make_scheduler(
        policy, budget=8, num_blocks=10, block_size=2, max_num_seqs=4, prefix_caching=False, num_host_blocks=32
    )
    d = Driver(sched)
    prompts = [[1, 2, 3], [2, 3], [3, 1, 2, 1], [1, 1]]
    reqs = [make_req(f"r{i}", p, max_tokens=8) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    d.run()
    assert d.num_swapped_out > 0 and sum(r.num_preemptions for r in reqs) > 0
    assert sum(out.num_batched_tokens for out in d.outputs) == sum(len(p) + 8 - 1 for p in prompts)
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == expected_output(p, 8)
    assert_all_freed(sched)


def test_swap_in_is_not_swapped_straight_out_again() -> None:
    """Found by the random workloads: under prefill-first a running prompt short of blocks took back the
    blocks of a request swapped in the same step, every step, while the decode plan never ran."""
    w = Workload(
        block_size=2, num_blocks=18, budget=3, max_num_seqs=3, chunk_size=None, prefix_caching=False,
        arrivals=[(0, [1] * 19, 2), (0, [1] * 17, 1), (0, [1], 1), (0, [1], 1), (0, [1], 2)], aborts=[],
        num_host_blocks=1,
    )
    assert run_workload("prefill-first", w, 0).num_swapped_in > 0


def test_swap_in_leaves_running_prompts_their_next_chunk() -> None:
    """Found by the random workloads: two long prompts that cannot both fit. The older one, one token
    short of its prompt, swapped the newer one out; the swap-in took the blocks it needed next, so it
    preempted itself (no host room for it: recompute) and the two traded places forever."""
    w = Workload(
        block_size=1, num_blocks=25, budget=4, max_num_seqs=2, chunk_size=2, prefix_caching=False,
        arrivals=[(0, [1] * 23, 1), (0, [1], 1), (0, [1], 1), (0, [1] * 23, 1), (0, [1], 1)], aborts=[],
        num_host_blocks=2,
    )
    assert run_workload("chunked", w, 0).num_swapped_in > 0


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full() -> None:
    sched = make_scheduler(
        "chunked", budget=16, num_blocks=4, block_size=2, max_num_seqs=2, prefix_caching=False, num_host_blocks=1
    )
    d = Driver(sched)
    a, b = make_req("a", [1, 2, 3], max_tokens=5), make_req("b", [2, 2, 3], max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    while not d.outputs or not d.outputs[-1].preempted:
        d.step()
    assert d.outputs[-1].preempted == [b]  # 2 blocks of KV, 1 host block: recomputed
    assert b.status is RequestStatus.PREEMPTED and list(sched.waiting) == [b] and not sched.swapped
    d.run()
    assert b.output_token_ids == expected_output([2, 2, 3], 5)
    assert_all_freed(sched)


def test_abort_a_swapped_request_frees_its_host_blocks() -> None:
    sched = make_scheduler(
        "chunked", budget=16, num_blocks=4, block_size=2, max_num_seqs=2, prefix_caching=False, num_host_blocks=8
    )
    d = Driver(sched)
    a, b = make_req("a", [1, 2, 3], max_tokens=5), make_req("b", [2, 2, 3], max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    while not sched.swapped:
        d.step()
    assert list(sched.swapped) == [b] and b.host_block_ids and b.num_computed_tokens > 0
    assert sched.host_pool is not None and sched.host_pool.num_free_blocks == 8 - len(b.host_block_ids)
    assert sched.finish_request("b", FinishReason.ABORT) is b
    assert not b.host_block_ids and sched.host_pool.num_free_blocks == 8
    d.run()
    assert a.output_token_ids == expected_output([1, 2, 3], 5)
    assert_all_freed(sched)


def test_swap_mode_needs_a_host_tier() -> None:
    config = SchedulerConfig(policy="chunked", preemption_mode="swap")
    with pytest.raises(ValueError, match="host tier"):
        Scheduler(config, BlockManager(8, 2), make_policy("chunked"))
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="discard")


# ---- aborts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_abort_waiting_running_and_preempted(policy: str) -> None:
    sched = make_scheduler(policy, budget=16, num_blocks=5, block_size=2, max_num_seqs=4)
    d = Driver(sched)
    a, b, c, e = (make_req(k, [t, 2, 3, 4], max_tokens=6) for k, t in zip("abce", (1, 2, 3, 1)))
    for r in (a, b, c, e):
        sched.add_request(r)
    while not sched.num_preemptions:
        d.step()
    preempted = next(r for r in sched.waiting if r.status is RequestStatus.PREEMPTED)
    waiting = next(r for r in sched.waiting if r.status is RequestStatus.WAITING)
    running = sched.running[0]
    assert running.block_ids
    free_before = sched.block_manager.num_free_blocks
    num_blocks = len(running.block_ids)
    for r in (preempted, waiting, running):
        assert sched.finish_request(r.req_id, FinishReason.ABORT) is r
        assert r.is_finished and r.finish_reason is FinishReason.ABORT
        assert r.block_ids == [] and r not in sched.running and r not in sched.waiting
        assert r.req_id not in sched.requests
        sched.block_manager.check_invariants(sched.running)
    assert sched.block_manager.num_free_blocks == free_before + num_blocks
    assert sched.finish_request(running.req_id, FinishReason.ABORT) is None  # twice: nothing to do
    assert sched.finish_request("nope", FinishReason.ABORT) is None
    d.run()
    assert_all_freed(sched)


def test_abort_while_the_step_is_in_flight() -> None:
    sched = make_scheduler("chunked", budget=16, block_size=2)
    d = Driver(sched, sample=lambda req: {"a": 10, "b": 20}[req.req_id])
    a = make_req("a", [1, 2, 3, 4, 5], max_tokens=3)
    b = make_req("b", [1, 2, 3, 4, 6], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    d.step(abort_in_flight=lambda out: sched.finish_request("a", FinishReason.ABORT))
    assert a.output_token_ids == [] and a.block_ids == []
    assert b.output_token_ids == [20]  # a's sampled token was skipped, not handed to b
    d.run()
    assert b.output_token_ids == [20, 20, 20]
    assert_all_freed(sched)


# ---- token-level stops -----------------------------------------------------------------------------


def run_one(req: Request, tokens: list[int]) -> Scheduler:
    """Feed `tokens` as the sampled tokens of `req`, one per step, until it finishes."""
    sched = make_scheduler("chunked", block_size=2)
    it = iter(tokens)
    d = Driver(sched, sample=lambda r: next(it))
    sched.add_request(req)
    d.run(max_steps=len(tokens) + 2)
    assert_all_freed(sched)
    return sched


@pytest.mark.parametrize(
    "kw, tokens, output, reason, stop_reason",
    [
        ({}, [5, 6, EOS, 7], [5, 6, EOS], FinishReason.STOP, None),
        ({"ignore_eos": True}, [5, EOS, 6, EOS], [5, EOS, 6, EOS], FinishReason.LENGTH, None),
        ({"stop_token_ids": (6,)}, [5, 6, 7, 8], [5, 6], FinishReason.STOP, 6),
        ({"stop_token_ids": (6,), "ignore_eos": True}, [EOS, 6, 7], [EOS, 6], FinishReason.STOP, 6),
        ({}, [5, 6, 7, 8], [5, 6, 7, 8], FinishReason.LENGTH, None),
        ({"max_tokens": 2}, [5, EOS], [5, EOS], FinishReason.STOP, None),  # EOS wins over max_tokens
        ({"max_model_len": 6}, [5, 6, 7, 8], [5, 6], FinishReason.LENGTH, None),  # 4 + 2 tokens
        ({"max_tokens": 1}, [5, 6], [5], FinishReason.LENGTH, None),
    ],
)
def test_token_level_stops(
    kw: dict, tokens: list[int], output: list[int], reason: FinishReason, stop_reason: int | None
) -> None:
    kw = {"max_tokens": 4, "ignore_eos": False, **kw}
    req = make_req("r", [1, 2, 3, 4], **kw)
    run_one(req, tokens)
    assert req.output_token_ids == output
    assert req.finish_reason is reason and req.stop_reason == stop_reason
    assert req.status is RequestStatus.FINISHED


def test_a_stop_token_in_the_prompt_does_not_stop() -> None:
    req = make_req("r", [1, EOS, 6, 4], max_tokens=2, ignore_eos=False, stop_token_ids=(6,))
    run_one(req, [5, 5])
    assert req.output_token_ids == [5, 5] and req.finish_reason is FinishReason.LENGTH

"""The scheduler test driver: runs steps like `EngineLoop.step()` over `FakeExecutor` (which keeps a model
of what each KV slot holds, device and host tier, and fails a step that reads or writes the wrong K/V) and
checks the scheduler's output every step. Shared by the scheduler and policy tests. Pure Python: no torch.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.kv.block_manager import BlockManager, HostBlockPool
from pdserve.request import Request, RequestStatus, SamplingParams
from pdserve.scheduler.policies import make_policy
from pdserve.scheduler.scheduler import Scheduler, SchedulerOutput
from pdserve.sim.fake_executor import FakeExecutor, expected_output, model_token

__all__ = [
    "EOS",
    "Driver",
    "assert_all_freed",
    "expected_output",
    "make_req",
    "make_scheduler",
    "model_token",
    "random_arrivals",
]

EOS = 0


def make_scheduler(
    policy: str,
    *,
    budget: int = 16,
    max_num_seqs: int = 8,
    num_blocks: int = 64,
    block_size: int = 4,
    chunk_size: int | None = None,
    prefix_caching: bool = True,
    num_host_blocks: int = 0,
) -> Scheduler:
    """`num_host_blocks` > 0: preemption swaps to a host tier of that many blocks."""
    config = SchedulerConfig(
        policy=policy, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, chunk_size=chunk_size,
        preemption_mode="swap" if num_host_blocks else "recompute",
    )
    host = HostBlockPool(num_host_blocks) if num_host_blocks else None
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching), make_policy(policy), host)


def make_req(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    ignore_eos: bool = True,
    stop_token_ids: tuple[int, ...] = (),
    max_model_len: int = 0,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids))
    return Request(
        req_id, list(prompt), params, eos_token_ids=frozenset({EOS}), max_model_len=max_model_len
    )


@dataclass
class Driver:
    """Runs steps like `EngineLoop.step()` over a `FakeExecutor`, checking the scheduler's output every
    step."""

    sched: Scheduler
    sample: Callable[[Request], int] | None = None  # scripted tokens (default: the fake model's)
    num_spec_tokens: int = 0  # > 0: the fake executor speculates (see `FakeExecutor`)
    draft: Callable[[list[int]], int] = model_token
    executor: FakeExecutor = field(init=False)
    first_scheduled: list[str] = field(default_factory=list)  # req ids in the order first scheduled
    outputs: list[SchedulerOutput] = field(default_factory=list)
    num_preempted: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0

    def __post_init__(self) -> None:
        self.executor = FakeExecutor(
            self.sched.block_manager, self.sample, num_spec_tokens=self.num_spec_tokens, draft=self.draft
        )

    def step(self, abort_in_flight: Callable[[SchedulerOutput], None] | None = None) -> SchedulerOutput:
        sched = self.sched
        bm, cfg = sched.block_manager, sched.config
        was_running = {id(r) for r in sched.running}
        was_waiting = {id(r) for r in sched.waiting}
        was_swapped = list(sched.swapped)
        # Decoding: the prompt is done and only the latest sampled token is left to compute.
        decoding = [
            r for r in sched.running if not r.is_prefill and r.num_computed_tokens == r.num_tokens - 1
        ]

        out = sched.schedule()

        reqs = [s.req for s in out.scheduled]
        scheduled = {id(r) for r in reqs}
        preempted = {id(r) for r in out.preempted}
        running = {id(r) for r in sched.running}
        assert len(scheduled) == len(reqs), "a request scheduled twice in one step"
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
        assert len(sched.running) <= cfg.max_num_seqs, "max_num_seqs exceeded"
        num_prefill = num_decode = 0
        for s in out.scheduled:
            r, n = s.req, s.num_new_tokens
            assert n >= 1
            assert r.status is RequestStatus.RUNNING and id(r) in running
            assert r.num_computed_tokens + n <= r.num_tokens_with_spec, "scheduled tokens that do not exist yet"
            assert len(r.block_ids) * bm.block_size >= r.num_computed_tokens + n, "no slots for the tokens"
            if not r.is_prefill and r.num_tokens - r.num_computed_tokens == 1:
                num_decode += n
            else:
                num_prefill += n
            if r.req_id not in self.first_scheduled:
                self.first_scheduled.append(r.req_id)
        assert (out.num_prefill_tokens, out.num_decode_tokens) == (num_prefill, num_decode), "accounting"
        swapped_in = [r for r in was_swapped if r.status is not RequestStatus.SWAPPED or id(r) in preempted]
        assert was_swapped[: len(swapped_in)] == swapped_in, "swapped requests came back out of order"
        still_swapped = [r for r in was_swapped if r.status is RequestStatus.SWAPPED and id(r) not in preempted]
        assert not still_swapped or not any(id(r) in was_waiting for r in reqs), "admitted before a swap-in"
        assert len(out.swap_in) == sum(bm.num_blocks_for(r.num_computed_tokens) for r in swapped_in)
        num_swap_out = 0
        for r in out.preempted:
            assert id(r) in was_running or r in swapped_in
            if r.status is RequestStatus.SWAPPED:
                assert sched.host_pool is not None and any(w is r for w in sched.swapped)
                assert r.block_ids == [] and len(r.host_block_ids) == bm.num_blocks_for(r.num_computed_tokens) > 0
                num_swap_out += len(r.host_block_ids)
            elif id(r) not in scheduled:  # (a victim may come straight back through the prefix cache)
                assert r.status is RequestStatus.PREEMPTED and any(w is r for w in sched.waiting)
                assert r.block_ids == [] and r.num_computed_tokens == 0
        assert len(out.swap_out) == num_swap_out
        self.num_preempted += len(out.preempted)
        self.num_swapped_out += len(out.swap_out)
        self.num_swapped_in += len(out.swap_in)

        if sched.policy.name == "chunked":
            # (With speculation a decode asks for its token and its drafts: only if all fit, none may starve.)
            if sum(1 + len(r.spec_token_ids) for r in decoding) <= cfg.max_num_batched_tokens:
                starved = [r.req_id for r in decoding if id(r) not in scheduled | preempted]
                assert not starved, f"decodes starved under chunked: {starved}"
            if cfg.chunk_size is not None:
                assert all(s.num_new_tokens <= cfg.chunk_size for s in out.scheduled), "chunk_size exceeded"
        if sched.policy.name == "prefill-first":
            # Running decodes stall while prompt tokens run. (A victim that the prefix cache readmits in
            # the same step with one token left is admission work computed like a decode: not a stall.)
            ran_prompt = any(s.req.is_prefill for s in out.scheduled)
            stalled = {id(r) for r in decoding} - preempted
            assert not (ran_prompt and scheduled & stalled), "prefill-first ran a decode too"
            for s in out.scheduled:  # a prompt that fits a whole step's budget is admitted whole
                left = s.req.num_tokens - s.req.num_computed_tokens
                if id(s.req) in was_waiting and left <= cfg.max_num_batched_tokens:
                    assert s.num_new_tokens == left, "prefill-first split a prompt that fits the budget"

        self.executor.apply_swaps(out.swap_in, out.swap_out)
        model_output = self.executor.execute(out)
        if abort_in_flight is not None:
            abort_in_flight(out)
        sched.update_from_output(out, model_output)
        bm.check_invariants(sched.running)
        bs = bm.block_size
        for r in sched.running:
            # Rejected drafts' slots are given back (BlockManager.truncate) ...
            assert len(r.block_ids) <= bm.num_blocks_for(r.num_tokens), "blocks held past the sequence"
            # ... and only verified tokens are hashed: a hashed block holds exactly its tokens' K/V.
            truth = r.all_token_ids()
            for i, _ in enumerate(bm._req_hashes.get(r.req_id, ())):
                for o in range(bs):
                    pos = i * bs + o
                    got = self.executor.slots.get(r.block_ids[i] * bs + o)
                    assert pos < r.num_computed_tokens and got == tuple(truth[: pos + 1]), "unverified K/V hashed"
        assert all(not r.block_ids for r in sched.waiting)
        assert all(not r.host_block_ids for r in [*sched.waiting, *sched.running]), "host blocks kept"
        if sched.host_pool is not None:
            sched.host_pool.check_invariants([r.host_block_ids for r in sched.swapped])
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            out = self.step()
            assert out.scheduled or out.preempted or out.swap_in, "stuck: unfinished requests but nothing scheduled"
        raise AssertionError("did not finish")


def assert_all_freed(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished_requests() and not sched.requests
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
    assert not bm._req_hashes, "per-request prefix-cache state leaked"
    if sched.host_pool is not None:
        sched.host_pool.check_invariants([])


def random_arrivals(rng: random.Random, n: int, *, max_prompt: int = 20, max_tokens: int = 16) -> list:
    """(step, prompt, max_tokens) arrivals, in arrival order, with prompts over tokens 1..3."""
    step, arrivals = 0, []
    for _ in range(n):
        step += rng.randint(0, 2)
        prompt = [rng.randint(1, 3) for _ in range(rng.randint(1, max_prompt))]
        arrivals.append((step, prompt, rng.randint(1, max_tokens)))
    return arrivals

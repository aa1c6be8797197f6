"""Speculation through the real scheduler and loop on the fake executor (which verifies drafts greedily
against its fake model and checks every KV read): n-gram drafts change no output under any policy,
with chunked prefill, preemption by recompute and by swap, and the prefix cache; and the speculation
length follows acceptance and drops to 0 in large steps. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pdserve.config import SchedulerConfig, SpeculativeConfig
from pdserve.engine.loop import EngineLoop
from pdserve.kv.block_manager import BlockManager, HostBlockPool
from pdserve.scheduler.policies import make_policy
from pdserve.scheduler.scheduler import Scheduler
from pdserve.sim.fake_executor import FakeExecutor, expected_output
from pdserve.spec import DraftRequest, SpeculativeExecutor
from tests.support.loop import generate

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def make_loop(
    policy: str, spec: SpeculativeConfig | None, *, num_blocks: int = 64, swap: bool = False, **config: object
) -> tuple[EngineLoop, FakeExecutor, SpeculativeExecutor | None]:
    sc = SchedulerConfig(policy=policy, preemption_mode="swap" if swap else "recompute", **config)  # type: ignore[arg-type]
    bm = BlockManager(num_blocks, 4)
    host = HostBlockPool(64) if swap else None
    sched = Scheduler(sc, bm, make_policy(policy, sc), host)
    fake = FakeExecutor(bm)
    executor = SpeculativeExecutor(fake, spec) if spec is not None else None
    loop = EngineLoop(sched, executor or fake, vocab_size=8, max_model_len=256)
    return loop, fake, executor


PROMPTS = [[1, 2, 3, 1, 2], [2, 2, 1, 3, 1, 2, 2, 1], [3, 1] * 6, [1, 2, 3, 1, 2] + [3] * 9]


@pytest.mark.parametrize("policy", ["chunked", "prefill-first", "decode-priority", "slo"])
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(max_num_batched_tokens=6, chunk_size=3),  # chunked prefill; drafts squeezed by the budget
        dict(num_blocks=12),  # preemption by recompute
        dict(num_blocks=12, swap=True),  # preemption by swap
    ],
)
def test_ngram_speculation_changes_no_greedy_output(policy: str, opts: dict) -> None:
    want = [expected_output(p, 24) for p in PROMPTS]
    loop, fake, spec = make_loop(policy, SPEC, **opts)
    assert generate(loop, PROMPTS, 24) == want
    assert spec is not None and spec.stats.num_accepted_tokens > 0  # drafts were accepted...
    assert spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens  # ...and some rolled back
    base, base_fake, _ = make_loop(policy, None, **opts)
    assert generate(base, PROMPTS, 24) == want
    if "max_num_batched_tokens" not in opts:  # (under a tiny budget drafts take prompt chunks' room)
        assert fake.num_steps < base_fake.num_steps  # accepted drafts saved steps


def test_drafts_fit_the_token_budget_with_prompt_chunks() -> None:
    loop, fake, spec = make_loop("chunked", SPEC, max_num_batched_tokens=5)
    budgets = []
    real_execute = fake.execute

    def execute(out, after_layer=None):  # type: ignore[no-untyped-def]
        budgets.append(out.num_batched_tokens)
        return real_execute(out, after_layer)

    fake.execute = execute  # type: ignore[method-assign]
    assert generate(loop, PROMPTS, 16) == [expected_output(p, 16) for p in PROMPTS]
    assert max(budgets) <= 5 and spec is not None and spec.stats.num_drafts > 0


class FixedProposer:
    """Proposes `num_tokens` copies of `token` (the fake model's tokens are 0..3)."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.asked: list[int] = []

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.asked += [r.num_tokens for r in requests]
        return [[self.token] * r.num_tokens for r in requests]

    def release(self, req_id: str) -> None:
        pass


def test_speculation_length_drops_when_drafts_are_rejected() -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=4)
    loop, fake, _ = make_loop("chunked", None)
    wrong = FixedProposer(7)  # never a token of the fake model
    loop.executor = SpeculativeExecutor(fake, cfg, wrong)
    assert generate(loop, [[1, 2, 3]], 20) == [expected_output([1, 2, 3], 20)]
    assert wrong.asked[0] == 4 and wrong.asked[-1] == 1  # full length first, then the floor of 1


def test_no_drafts_in_a_step_past_the_batch_size_limit() -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=3)
    loop, fake, _ = make_loop("chunked", None)
    spec = SpeculativeExecutor(fake, cfg, FixedProposer(1))
    loop.executor = spec
    prompts = [[1, 2, 3, i] for i in range(5)]
    assert generate(loop, prompts, 6) == [expected_output(p, 6) for p in prompts]
    assert spec.stats.num_drafts == 0  # five decodes per step: compute-bound, never a draft
    loop, fake, _ = make_loop("chunked", None)
    spec = SpeculativeExecutor(fake, cfg, FixedProposer(1))
    loop.executor = spec
    assert generate(loop, prompts[:3], 6) == [expected_output(p, 6) for p in prompts[:3]]
    assert spec.stats.num_drafts > 0

"""Scheduling policies driven through the real `Scheduler` with the fake runner of `test_scheduler`:
decode-priority's thresholds and its cap on decode-only steps, plus the registry. Pure Python: no torch.

`Watch` recomputes decode-priority's pause condition independently of the policy (from the queues before
each step) and checks what the scheduler actually ran against it.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

import pytest

from pdserve.config import SchedulerConfig
from pdserve.kv.block_manager import BlockManager
from pdserve.request import FinishReason, Request
from pdserve.scheduler.policies import POLICIES, Chunked, DecodePriority, Policy, PrefillFirst, make_policy
from pdserve.scheduler.scheduler import Scheduler, SchedulerOutput
from tests.support.scheduler_driver import Driver, assert_all_freed, expected_output, make_req, random_arrivals

POLICY = "decode-priority"


def make_scheduler(
    *,
    max_decodes: int = 64,
    max_wait_steps: int = 1,
    max_decode_steps: int = 8,
    budget: int = 16,
    max_num_seqs: int = 8,
    num_blocks: int = 256,
    block_size: int = 4,
    chunk_size: int | None = None,
    prefix_caching: bool = True,
    policy: str = POLICY,
) -> Scheduler:
    config = SchedulerConfig(
        policy=policy,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        chunk_size=chunk_size,
        decode_priority_max_decodes=max_decodes,
        decode_priority_max_wait_steps=max_wait_steps,
        decode_priority_max_decode_steps=max_decode_steps,
    )
    block_manager = BlockManager(num_blocks, block_size, prefix_caching)
    return Scheduler(config, block_manager, make_policy(policy, config))


def is_decode(req: Request) -> bool:
    return not req.is_prefill and req.num_tokens - req.num_computed_tokens == 1


@dataclass
class Watch:
    """Steps a `Driver` and checks decode-priority's promises on every step."""

    driver: Driver
    step_index: int = 0
    last_token: dict[str, tuple[int, int]] = field(default_factory=dict)  # req_id -> (outputs, step seen)
    paused_run: int = 0  # consecutive steps under pressure with prompts waiting and no prompt token run
    starved_run: int = 0  # consecutive steps with prompts waiting and no prompt token run
    max_starved_run: int = 0
    num_paused: int = 0  # steps under pressure that ran only decodes
    num_forced: int = 0  # steps under pressure that ran prompt tokens because the cap was reached
    num_wait_pauses: int = 0  # paused steps where only the wait threshold (not the count) was passed

    def step(self) -> SchedulerOutput:
        sched = self.driver.sched
        cfg = sched.config
        self.step_index += 1
        decodes = [r for r in sched.running if is_decode(r)]
        seen = {}
        for r in decodes:
            last = self.last_token.get(r.req_id)
            fresh = last is None or last[0] != r.num_output_tokens
            seen[r.req_id] = (r.num_output_tokens, self.step_index) if fresh else last
        self.last_token = seen
        max_wait = max((self.step_index - s for _, s in seen.values()), default=0)
        prompts_wait = bool(sched.waiting) or len(decodes) < len(sched.running)
        over_count = len(decodes) >= cfg.decode_priority_max_decodes
        over_wait = max_wait > cfg.decode_priority_max_wait_steps
        pressure = prompts_wait and (over_count or over_wait)

        out = self.driver.step()

        ran_prompt = out.num_prefill_tokens > 0
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        if pressure and ran_prompt:
            assert self.paused_run >= cfg.decode_priority_max_decode_steps, (
                f"step {self.step_index}: prompt tokens ran with {len(decodes)} decodes (max "
                f"{cfg.decode_priority_max_decodes}), oldest waited {max_wait} steps, before the cap"
            )
            self.num_forced += 1
        if pressure and not ran_prompt:
            self.paused_run += 1
            self.num_paused += 1
            self.num_wait_pauses += not over_count
        else:
            self.paused_run = 0
        self.starved_run = self.starved_run + 1 if prompts_wait and not ran_prompt else 0
        self.max_starved_run = max(self.max_starved_run, self.starved_run)
        return out


def run(sched: Scheduler, arrivals: list[tuple[int, list[int], int]], max_steps: int = 5_000) -> Watch:
    """Feed (step, prompt, max_tokens) arrivals, run to the end, and check every request finished exactly."""
    watch = Watch(Driver(sched))
    reqs = [make_req(f"r{i}", p, m) for i, (_, p, m) in enumerate(arrivals)]
    last_arrival = max(t for t, _, _ in arrivals)
    for step in range(max_steps):
        for (t, _, _), req in zip(arrivals, reqs):
            if t == step:
                sched.add_request(req)
        if not sched.has_unfinished_requests():
            if step > last_arrival:
                break
            continue
        out = watch.step()
        assert out.scheduled or out.preempted, "stuck: unfinished requests but nothing scheduled"
    else:
        raise AssertionError("did not finish")
    for req, (_, prompt, max_tokens) in zip(reqs, arrivals):
        assert req.finish_reason is FinishReason.LENGTH
        assert req.output_token_ids == expected_output(prompt, max_tokens)
    assert_all_freed(sched)
    return watch


# ---- decode-priority -------------------------------------------------------------------------------


def test_pauses_prefills_at_max_decodes_until_the_cap() -> None:
    sched = make_scheduler(max_decodes=2, max_decode_steps=3, max_wait_steps=100, budget=16)
    w = Watch(Driver(sched))
    a, b, c = make_req("a", [1, 2], 10), make_req("b", [3, 1], 10), make_req("c", [2, 2, 2], 2)
    sched.add_request(a)
    sched.add_request(b)
    w.step()  # both prompts run: no decodes yet
    sched.add_request(c)
    for _ in range(3):  # two decodes reach the threshold: c waits, decodes only
        out = w.step()
        assert [s.req.req_id for s in out.scheduled] == ["a", "b"] and out.num_prefill_tokens == 0
    out = w.step()  # the cap: one step admits c alongside the decodes
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1), ("c", 3)]
    w.driver.run()
    for req, prompt in ((a, [1, 2]), (b, [3, 1]), (c, [2, 2, 2])):
        assert req.output_token_ids == expected_output(prompt, req.params.max_tokens)
    assert_all_freed(sched)


def test_below_thresholds_it_behaves_like_chunked() -> None:
    def trace(policy: str) -> list[list[tuple[str, int]]]:
        sched = make_scheduler(policy=policy, max_decodes=64, max_wait_steps=1, budget=12, chunk_size=5)
        d = Driver(sched)
        arrivals = random_arrivals(random.Random(7), 6)
        for i, (_, p, m) in enumerate(arrivals):
            sched.add_request(make_req(f"r{i}", p, m))
        d.run()
        assert_all_freed(sched)
        return [[(s.req.req_id, s.num_new_tokens) for s in out.scheduled] for out in d.outputs]

    assert trace(POLICY) == trace("chunked")


@pytest.mark.parametrize("seed", range(20))
def test_count_threshold_and_cap_on_random_workloads(seed: int) -> None:
    """Ample budget, seats and blocks: whenever prompts wait they could run, so every step without prompt
    tokens is the policy's pause, and the cap bounds how many come in a row."""
    rng = random.Random(seed)
    cap = rng.randint(1, 4)
    sched = make_scheduler(
        max_decodes=rng.randint(1, 3), max_decode_steps=cap, max_wait_steps=1_000, budget=64,
        max_num_seqs=16, num_blocks=1_024, chunk_size=rng.choice([None, 3, 8]),
    )
    w = run(sched, random_arrivals(rng, 10, max_tokens=24))
    assert w.max_starved_run <= cap, f"{w.max_starved_run} decode-only steps in a row while prompts waited"
    assert w.num_paused > 0


def test_cap_is_reached_and_bounds_decode_only_steps() -> None:
    rng = random.Random(99)
    total_forced = 0
    for cap in (1, 2, 5):
        sched = make_scheduler(
            max_decodes=1, max_decode_steps=cap, budget=64, max_num_seqs=16, num_blocks=1_024
        )
        w = run(sched, [(0, [1, 2, 3], 40)] + [(i, [rng.randint(1, 3)] * 6, 3) for i in range(1, 8)])
        assert w.max_starved_run == cap  # long decode keeps the pressure on: runs of exactly `cap`
        total_forced += w.num_forced
    assert total_forced > 0


def test_wait_threshold_pauses_prefills_for_a_skipped_decode() -> None:
    """Under chunked-style ordering a decode waits only when the scheduler passes it over (KV pressure),
    which random workloads rarely produce, so this drives `plan()` directly: a decode whose output count
    does not move between steps has waited that many steps."""
    config = SchedulerConfig(
        policy=POLICY, decode_priority_max_decodes=100, decode_priority_max_wait_steps=1,
        decode_priority_max_decode_steps=2,
    )
    policy = make_policy(POLICY, config)
    a = make_req("a", [1, 2, 3], 10)
    a.output_token_ids.append(1)
    a.num_computed_tokens = a.num_tokens - 1  # a decode
    waiting = [make_req("c", [1, 1], 2)]

    def pauses(waiting: list[Request]) -> bool:
        plans = policy.plan([a], waiting)
        return not plans[0].admit and not plans[0].run_prefills and plans[0].run_decodes

    assert not pauses(waiting)  # waited 0 steps
    assert not pauses(waiting)  # 1: not over the threshold
    assert pauses(waiting)  # 2 > 1
    assert pauses(waiting)
    assert not pauses(waiting)  # the cap of 2 decode-only steps: one step admits
    assert pauses(waiting)
    a.output_token_ids.append(2)  # a got its token: its wait restarts
    a.num_computed_tokens += 1
    assert not pauses(waiting)
    assert not pauses(waiting)
    assert not pauses([])  # over the threshold, but no prompt waits: nothing to pause
    assert not pauses([])
    assert pauses(waiting)


@pytest.mark.parametrize("seed", range(30))
def test_tight_cache_preempts_and_finishes(seed: int) -> None:
    """KV pressure: preemption and recomputation under pauses; budget, exact outputs, no block leak."""
    rng = random.Random(5_000 + seed)
    block_size = rng.choice([1, 2, 4])
    arrivals = random_arrivals(rng, rng.randint(3, 8), max_tokens=12)
    min_blocks = max(-(-(len(p) + m) // block_size) for _, p, m in arrivals)
    budget = rng.randint(2, 24)
    sched = make_scheduler(
        max_decodes=rng.randint(1, 4), max_wait_steps=rng.randint(0, 2), max_decode_steps=rng.randint(1, 4),
        budget=budget, max_num_seqs=rng.randint(1, 6), num_blocks=min_blocks + rng.randint(0, 4),
        block_size=block_size, chunk_size=rng.choice([None, rng.randint(1, budget)]),
        prefix_caching=rng.random() < 0.5,
    )
    run(sched, arrivals)


# ---- registry and configuration --------------------------------------------------------------------


def test_registered_and_configured_from_scheduler_config() -> None:
    assert POLICY in POLICIES
    config = SchedulerConfig(
        policy=POLICY, decode_priority_max_decodes=3, decode_priority_max_wait_steps=0,
        decode_priority_max_decode_steps=2,
    )
    p = make_policy(POLICY, config)
    assert isinstance(p, DecodePriority) and p.name == POLICY
    assert (p.max_decodes, p.max_wait_steps, p.max_decode_steps) == (3, 0, 2)
    default = make_policy(POLICY)  # old callers: thresholds from SchedulerConfig's defaults
    d = SchedulerConfig()
    assert (default.max_decodes, default.max_wait_steps, default.max_decode_steps) == (
        d.decode_priority_max_decodes, d.decode_priority_max_wait_steps, d.decode_priority_max_decode_steps
    )
    assert default is not make_policy(POLICY)  # state lives on the instance
    assert isinstance(make_policy("prefill-first"), PrefillFirst)
    assert isinstance(make_policy("chunked", config), Chunked)
    with pytest.raises(ValueError, match="unknown scheduler policy"):
        make_policy("nope")


@pytest.mark.parametrize(
    "field_name, value",
    [
        ("decode_priority_max_decodes", 0),
        ("decode_priority_max_decode_steps", 0),
        ("decode_priority_max_wait_steps", -1),
    ],
)
def test_config_validation(field_name: str, value: int) -> None:
    with pytest.raises(ValueError, match=field_name):
        SchedulerConfig(policy=POLICY, **{field_name: value})


def test_cli_flags_reach_scheduler_config() -> None:
    from pdserve.cli import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([
        "--scheduler", POLICY, "--decode-priority-max-decodes", "5", "--decode-priority-max-wait-steps", "2",
        "--decode-priority-max-decode-steps", "7",
    ])
    sc = engine_config(args).scheduler
    assert sc.policy == POLICY
    thresholds = (
        sc.decode_priority_max_decodes, sc.decode_priority_max_wait_steps, sc.decode_priority_max_decode_steps
    )
    assert thresholds == (5, 2, 7)
    defaults = engine_config(parser.parse_args([])).scheduler
    assert defaults.decode_priority_max_decodes == SchedulerConfig().decode_priority_max_decodes
    assert defaults.decode_priority_max_wait_steps == SchedulerConfig().decode_priority_max_wait_steps
    assert defaults.decode_priority_max_decode_steps == SchedulerConfig().decode_priority_max_decode_steps


# ---- the Policy base class: hooks without probing -------------------------------------------------


def test_a_policy_without_a_plan_cannot_be_built():
    class NoPlan(Policy):
        name = "no-plan"

    for cls in (Policy, NoPlan):
        with pytest.raises(TypeError, match="abstract"):
            cls(SchedulerConfig())


class _Counting(Chunked):
    """A policy outside the registry: refuses every other request, counts steps, reports both."""

    name = "counting"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.num_observed = 0
        self.num_refused = 0
        self.num_asked = 0

    def observe_step(
        self, duration: float, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int
    ) -> None:
        self.num_observed += 1

    def admission_error(self, req: Request, running, waiting) -> str | None:  # type: ignore[no-untyped-def]
        self.num_asked += 1
        if self.num_asked % 2 == 0:
            self.num_refused += 1
            return "every other one"
        return None

    def stats(self) -> dict[str, float]:
        return {"counting_refused_total": self.num_refused, 'counting_steps{kind="observed"}': self.num_observed}


def test_base_hooks_do_nothing_and_overrides_are_called() -> None:
    from pdserve.errors import SLORejectedError

    config = SchedulerConfig(policy="chunked")
    plain = Scheduler(config, BlockManager(16, 4, True), make_policy("chunked", config))
    plain.check_admission(make_req("a", [1, 2, 3], 2))
    plain.observe_step(0.01, 1, 1, 1)
    assert plain.step_model is None and plain.policy.stats() == {}

    policy = _Counting(config)
    sched = Scheduler(config, BlockManager(16, 4, True), policy)
    sched.check_admission(make_req("a", [1, 2, 3], 2))
    with pytest.raises(SLORejectedError, match="every other one"):
        sched.check_admission(make_req("b", [1, 2, 3], 2))
    sched.observe_step(0.01, 1, 1, 1)
    assert policy.stats() == {"counting_refused_total": 1, 'counting_steps{kind="observed"}': 1}


def test_the_server_exports_any_policy_stats_without_knowing_the_policy() -> None:
    from prometheus_client import generate_latest

    from pdserve.engine.process.messages import EngineStats
    from pdserve.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    for refused, observed in ((2, 5), (3, 9)):
        stats = {"counting_refused_total": refused, 'counting_steps{kind="observed"}': observed}
        m.observe_engine(EngineStats(1, 0, 0.1, 0, 0, 0, policy_stats=stats), None)
    m.observe_engine(EngineStats(0, 0, 0.0, 0, 0, 0), None)  # a restarted core counts from zero ...
    stats = {"counting_refused_total": 1, 'counting_steps{kind="observed"}': 1}
    m.observe_engine(EngineStats(1, 0, 0.1, 0, 0, 0, policy_stats=stats), None)
    text = generate_latest(m.registry).decode()
    assert 'pdserve:counting_refused_total{model_name="m"} 4.0' in text  # ... and counters keep adding up
    assert 'pdserve:counting_steps{kind="observed",model_name="m"} 1.0' in text  # a gauge is the latest
    assert "# TYPE pdserve:counting_refused_total counter" in text and "# TYPE pdserve:counting_steps gauge" in text

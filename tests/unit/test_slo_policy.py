"""The `slo` policy driven through the real `Scheduler` with the fake runner of `test_scheduler`, fed
synthetic step times from a known linear cost so its step-time model learns as in the engine: decodes
first and never starved, the prompt budget sized under the ITL target (beyond the floor), admission
earliest deadline first, predicted TTFT misses counted once, early rejection, no block leaks, exact
outputs. Plus its configuration, CLI flags and the server metrics it feeds. Pure Python: no torch.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

import pytest

from pdserve.config import SchedulerConfig
from pdserve.errors import SLORejectedError
from pdserve.kv.block_manager import BlockManager
from pdserve.request import FinishReason, Request
from pdserve.scheduler.policies import SLOAware, make_policy
from pdserve.scheduler.scheduler import Scheduler, SchedulerOutput
from tests.support.scheduler_driver import Driver, assert_all_freed, expected_output, make_req, random_arrivals

POLICY = "slo"
# The fake machine: seconds per step, per prompt token, per decode, per context token.
TRUE = (0.002, 0.0001, 0.0005, 0.000005)


def true_time(out: SchedulerOutput) -> float:
    context = sum(s.req.num_computed_tokens for s in out.scheduled)  # after the update, as StepRecord
    a, b, c, d = TRUE
    return a + b * out.num_prefill_tokens + c * out.num_decode_tokens + d * context


def make_scheduler(
    *,
    itl_ms: float = 40.0,
    ttft_ms: float = 500.0,
    min_chunk: int = 4,
    reject: bool = False,
    prior: tuple[float, float, float, float] | None = None,
    budget: int = 256,
    max_num_seqs: int = 16,
    num_blocks: int = 1_024,
    block_size: int = 4,
    chunk_size: int | None = None,
    prefix_caching: bool = False,
) -> Scheduler:
    config = SchedulerConfig(
        policy=POLICY,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        chunk_size=chunk_size,
        slo_ttft_ms=ttft_ms,
        slo_itl_ms=itl_ms,
        slo_min_chunk=min_chunk,
        slo_reject=reject,
        slo_step_model_prior=prior,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching), make_policy(POLICY, config))


def policy_of(sched: Scheduler) -> SLOAware:
    assert isinstance(sched.policy, SLOAware)
    return sched.policy


@dataclass
class Watch:
    """Steps a `Driver`, checks the policy's promises on every step, then reports the step's synthetic
    duration to the scheduler as the engine does."""

    driver: Driver
    exact_context: bool  # no prefix cache and no preemption: the policy knows each step's context
    noise: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    num_steps: int = 0
    num_over_floor: int = 0  # steps whose prompt tokens went past the floor (the ITL check applies)
    num_floor_steps: int = 0  # steps where decodes alone used up the target and prompts got the floor

    def step(self) -> SchedulerOutput:
        sched = self.driver.sched
        policy = policy_of(sched)
        model = policy.step_model
        decoding = [r for r in sched.running if r.is_decode]
        budget, _, _ = policy.prefill_budget(sched.running)

        out = self.driver.step()
        self.num_steps += 1

        cfg = sched.config
        scheduled = {id(s.req) for s in out.scheduled}
        preempted = {id(r) for r in out.preempted}
        if len(decoding) <= cfg.max_num_batched_tokens and not out.preempted:
            starved = [r.req_id for r in decoding if id(r) not in scheduled | preempted]
            assert not starved, f"decodes starved: {starved}"
        assert out.num_prefill_tokens <= budget, "prompt tokens over the policy's budget"
        if cfg.chunk_size is not None:
            assert all(s.num_new_tokens <= cfg.chunk_size for s in out.scheduled), "chunk_size exceeded"
        context = sum(s.req.num_computed_tokens for s in out.scheduled)
        predicted = model.predict(out.num_prefill_tokens, out.num_decode_tokens, context)
        if out.num_prefill_tokens > policy.min_chunk:
            self.num_over_floor += 1
            if self.exact_context:
                assert predicted <= policy.itl * (1 + 1e-9), (
                    f"{out.num_prefill_tokens} prompt tokens beside {out.num_decode_tokens} decodes: "
                    f"predicted {predicted * 1e3:.2f} ms over the {policy.itl * 1e3:.0f} ms target"
                )
        elif budget == policy.min_chunk and decoding:
            self.num_floor_steps += 1

        sched.observe_step(
            true_time(out) * (1 + self.rng.gauss(0, self.noise)),
            out.num_prefill_tokens,
            out.num_decode_tokens,
            context,
        )
        return out


def run(
    sched: Scheduler, arrivals: list[tuple[int, list[int], int]], *, exact_context: bool, noise: float = 0.0
) -> Watch:
    """Feed (step, prompt, max_tokens) arrivals, run to the end, and check exact outputs and no leak."""
    watch = Watch(Driver(sched), exact_context, noise)
    reqs = [make_req(f"r{i}", p, m) for i, (_, p, m) in enumerate(arrivals)]
    last_arrival = max(t for t, _, _ in arrivals)
    for step in range(20_000):
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


def busy_arrivals(rng: random.Random, n: int) -> list[tuple[int, list[int], int]]:
    """Long prompts and long outputs arriving close together: decodes pile up while prompts wait."""
    step, arrivals = 0, []
    for _ in range(n):
        step += rng.randint(0, 3)
        prompt = [rng.randint(1, 3) for _ in range(rng.randint(1, 120))]
        arrivals.append((step, prompt, rng.randint(1, 60)))
    return arrivals


# ---- budget, decodes, floor ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_steps_stay_under_the_itl_target_beyond_the_floor(seed: int) -> None:
    rng = random.Random(seed)
    sched = make_scheduler(
        itl_ms=rng.choice([10.0, 20.0, 40.0]), min_chunk=rng.choice([1, 4, 16]), max_num_seqs=rng.choice([8, 32]),
        chunk_size=rng.choice([None, None, 24]),
    )
    w = run(sched, busy_arrivals(rng, 24), exact_context=True)
    assert w.num_over_floor > 0  # the ITL check did apply
    assert policy_of(sched).step_model.num_observations == w.num_steps


def test_budget_shrinks_as_decodes_grow_and_floor_keeps_prompts_moving() -> None:
    """The model has learnt the machine: with more decodes the prompt budget is smaller, and once the
    decodes alone take the whole target a prompt still gets `slo_min_chunk` tokens a step."""
    sched = make_scheduler(itl_ms=20.0, min_chunk=8, prior=TRUE, max_num_seqs=64)
    policy = policy_of(sched)
    budgets = []
    for num_decodes in (0, 4, 12, 40):
        running = []
        for i in range(num_decodes):
            r = make_req(f"d{i}", [1] * 10, 5)
            r.output_token_ids.append(1)
            r.num_computed_tokens = r.num_tokens - 1
            running.append(r)
        budgets.append(policy.prefill_budget(running)[0])
    a, b, c, d = TRUE
    assert budgets[0] == int((0.020 - a) / (b + d))  # 171
    assert budgets[0] > budgets[1] > budgets[2] > 8
    assert budgets[3] == 8  # 40 decodes: 22 ms > 20 ms already

    w = run(sched, [(0, [1, 2] * 20, 60) for _ in range(40)] + [(5, [3] * 50, 2)], exact_context=True)
    assert w.num_floor_steps > 0


def test_draft_tokens_count_as_decode_tokens_in_the_budget() -> None:
    """Speculative decoding: a decode carrying k drafts runs k + 1 decode tokens, which is how the step
    model learns them, so the prompt budget leaves room for them."""
    sched = make_scheduler(itl_ms=20.0, min_chunk=8, prior=TRUE, max_num_seqs=64)
    policy = policy_of(sched)
    running = []
    for i in range(4):
        r = make_req(f"d{i}", [1] * 10, 5)
        r.output_token_ids.append(1)
        r.num_computed_tokens = r.num_tokens - 1
        running.append(r)
    plain, plain_time, _ = policy.prefill_budget(running)
    for r in running:
        r.spec_token_ids = [1, 1, 1]
    with_drafts, drafts_time, _ = policy.prefill_budget(running)
    a, b, c, d = TRUE
    assert with_drafts < plain
    assert drafts_time - with_drafts * (b + d) == pytest.approx(plain_time - plain * (b + d) + 12 * c)


@pytest.mark.parametrize("seed", range(20))
def test_tight_cache_preempts_and_finishes(seed: int) -> None:
    """KV pressure, prefix caching, noisy step times: preemption and recomputation under the policy;
    budget, exact outputs, no block leak."""
    rng = random.Random(9_000 + seed)
    block_size = rng.choice([1, 2, 4])
    arrivals = random_arrivals(rng, rng.randint(3, 10), max_tokens=16)
    min_blocks = max(-(-(len(p) + m) // block_size) for _, p, m in arrivals)
    budget = rng.randint(2, 32)
    sched = make_scheduler(
        itl_ms=rng.choice([5.0, 10.0, 30.0]), min_chunk=rng.randint(1, 8), budget=budget,
        max_num_seqs=rng.randint(1, 6), num_blocks=min_blocks + rng.randint(0, 4), block_size=block_size,
        chunk_size=rng.choice([None, rng.randint(1, budget)]), prefix_caching=rng.random() < 0.5,
    )
    run(sched, arrivals, exact_context=False, noise=0.1)


def test_decodes_go_first_even_behind_a_running_prompt() -> None:
    """With `chunk_size` a short prompt can finish before a long one admitted earlier, leaving a decode
    behind a running prompt in `running`; the decode still gets its token before any prompt chunk."""
    sched = make_scheduler(itl_ms=1_000.0, budget=8, chunk_size=4, prior=TRUE)
    d = Driver(sched)
    long, short = make_req("long", [1] * 40, 3), make_req("short", [2] * 4, 10)
    sched.add_request(long)
    sched.add_request(short)
    d.step()  # long: 4, short: 4 (its whole prompt; it samples)
    assert [r.req_id for r in sched.running] == ["long", "short"] and short.is_decode
    out = d.step()
    assert [(s.req.req_id, s.num_new_tokens) for s in out.scheduled] == [("short", 1), ("long", 4)]


# ---- admission order, predicted TTFT misses --------------------------------------------------------


def test_admits_earliest_deadline_first() -> None:
    """Requests queued out of arrival order (the server stamps arrival at its front) are admitted by
    deadline = arrival + TTFT target, not by queue position. One seat: one admission at a time."""
    sched = make_scheduler(max_num_seqs=1)
    d = Driver(sched)
    arrivals = [5.0, 1.0, 4.0, 2.0, 3.0]
    for i, t in enumerate(arrivals):
        req = make_req(f"r{i}", [1, 2, 3], 2)
        req.arrival_time = t
        sched.add_request(req)
    d.run()
    assert d.first_scheduled == ["r1", "r3", "r4", "r2", "r0"]
    assert_all_freed(sched)


def test_chunked_admits_in_queue_order() -> None:
    """The control for the test above: without an admit order the scheduler keeps its queue's order."""
    config = SchedulerConfig(policy="chunked", max_num_seqs=1)
    sched = Scheduler(config, BlockManager(64, 4, False), make_policy("chunked", config))
    d = Driver(sched)
    for i, t in enumerate([5.0, 1.0, 4.0]):
        req = make_req(f"r{i}", [1, 2, 3], 2)
        req.arrival_time = t
        sched.add_request(req)
    d.run()
    assert d.first_scheduled == ["r0", "r1", "r2"]


def test_predicted_ttft_misses_counted_once_each() -> None:
    """Known model (no observations): 10 ms + 1 ms per prompt token, ITL target 50 ms, so 40 prompt
    tokens a step and 50 ms steps. TTFT target 200 ms: 100 prompt tokens ahead (3 steps, 150 ms) make it,
    200 (5 steps, 250 ms) do not."""
    sched = make_scheduler(itl_ms=50.0, ttft_ms=200.0, prior=(0.010, 0.001, 0.0, 0.0), budget=512)
    policy = policy_of(sched)
    now = 100.0
    policy.clock = lambda: now
    a, b = make_req("a", [1] * 100, 4), make_req("b", [1] * 100, 4)
    for r in (a, b):
        r.arrival_time = now
        sched.add_request(r)
    assert policy.prefill_budget([])[0] == 40
    policy.plan(sched.running, sched.waiting)
    assert policy.num_ttft_violations_predicted == 1  # b
    policy.plan(sched.running, sched.waiting)
    assert policy.num_ttft_violations_predicted == 1  # still b: counted once
    now += 0.1  # a is now 100 ms into its 200: 3 more steps reach 250 ms
    policy.plan(sched.running, sched.waiting)
    assert policy.num_ttft_violations_predicted == 2
    d = Driver(sched)
    d.run()  # first tokens come: nothing left to count, and the set of late requests empties
    policy.plan(sched.running, sched.waiting)
    assert policy.num_ttft_violations_predicted == 2 and not policy._late


# ---- rejection -------------------------------------------------------------------------------------


def decode_req(req_id: str, context: int) -> Request:
    r = make_req(req_id, [1] * (context - 1), 50)
    r.output_token_ids.append(1)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_rejects_a_request_that_would_miss_its_ttft() -> None:
    # 10 ms + 1 ms per prompt token; ITL 50 ms: 40 prompt tokens per 50 ms step; TTFT target 200 ms.
    sched = make_scheduler(
        reject=True, itl_ms=50.0, ttft_ms=200.0, prior=(0.010, 0.001, 0.0, 0.0), budget=512, min_chunk=4
    )
    policy = policy_of(sched)
    policy.clock = lambda: 10.0
    huge = make_req("huge", [1] * 1_000, 4)
    huge.arrival_time = 10.0
    sched.check_admission(huge)  # an idle engine accepts anything
    sched.add_request(huge)
    small = make_req("small", [2] * 20, 4)
    small.arrival_time = 10.0
    with pytest.raises(SLORejectedError, match="time-to-first-token"):
        sched.check_admission(small)  # behind 1,000 queued prompt tokens: 26 steps
    assert list(sched.waiting) == [huge] and "small" not in sched.requests
    assert policy.num_rejected == 1

    sched = make_scheduler(reject=True, itl_ms=50.0, ttft_ms=200.0, prior=(0.010, 0.001, 0.0, 0.0))
    policy_of(sched).clock = lambda: 10.0
    sched.running.append(decode_req("d", 30))
    short = make_req("short", [2] * 60, 4)  # 2 steps of 40: 100 ms
    short.arrival_time = 10.0
    sched.check_admission(short)
    short.arrival_time = 9.85  # it already waited 150 ms at the front: 250 ms
    with pytest.raises(SLORejectedError):
        sched.check_admission(short)


def test_rejects_a_request_that_would_push_decodes_past_the_itl() -> None:
    # 1 ms + 4 ms per decode: 12 decodes take 49 ms, 13 take 53 ms (ITL target 50 ms).
    prior = (0.001, 0.0001, 0.004, 0.0)
    sched = make_scheduler(reject=True, itl_ms=50.0, ttft_ms=500.0, prior=prior, min_chunk=32)
    sched.running.extend(decode_req(f"d{i}", 20) for i in range(11))
    new = make_req("new", [1] * 4, 4)
    sched.check_admission(new)  # 12 decodes
    sched.add_request(new)
    with pytest.raises(SLORejectedError, match="inter-token latency"):
        sched.check_admission(make_req("one-more", [1] * 4, 4))  # 13 (the waiting one counts)

    capped = make_scheduler(reject=True, itl_ms=50.0, prior=prior, max_num_seqs=12)
    capped.running.extend(decode_req(f"d{i}", 20) for i in range(12))
    capped.check_admission(make_req("waits-for-a-seat", [1] * 4, 4))  # never more than 12 decode at once


def test_no_rejection_unless_configured() -> None:
    sched = make_scheduler(reject=False, itl_ms=50.0, ttft_ms=1.0, prior=(1.0, 1.0, 1.0, 1.0))
    sched.running.extend(decode_req(f"d{i}", 20) for i in range(20))
    sched.check_admission(make_req("x", [1] * 500, 4))
    for name in ("prefill-first", "chunked", "decode-priority"):
        config = SchedulerConfig(policy=name)
        other = Scheduler(config, BlockManager(64, 4, True), make_policy(name, config))
        other.check_admission(make_req("x", [1] * 500, 4))
        other.observe_step(0.01, 1, 1, 1)  # policies without a model ignore it
        assert other.step_model is None


# ---- configuration, CLI, metrics -------------------------------------------------------------------


def test_registered_and_configured() -> None:
    config = SchedulerConfig(
        policy=POLICY, slo_ttft_ms=300.0, slo_itl_ms=25.0, slo_min_chunk=7, slo_reject=True,
        slo_step_model_prior=(0.02, 0.001, 0.002, 0.0),
    )
    p = make_policy(POLICY, config)
    assert isinstance(p, SLOAware) and p.name == POLICY
    assert (p.ttft, p.itl, p.min_chunk, p.reject) == (0.3, 0.025, 7, True)
    assert p.step_model.coefficients == (0.02, 0.001, 0.002, 0.0)
    assert make_policy(POLICY).step_model is not make_policy(POLICY).step_model  # state on the instance


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(slo_ttft_ms=0.0), "slo_ttft_ms"),
        (dict(slo_itl_ms=-1.0), "slo_itl_ms"),
        (dict(slo_min_chunk=0), "slo_min_chunk"),
        (dict(slo_step_model_prior=(0.01, 0.001, 0.001)), "slo_step_model_prior"),
        (dict(slo_step_model_prior=(0.01, -0.001, 0.001, 0.0)), "slo_step_model_prior"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(policy=POLICY, **kwargs)


def test_cli_flags_reach_scheduler_config() -> None:
    from pdserve.cli import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([
        "--scheduler", POLICY, "--slo-ttft-ms", "250", "--slo-itl-ms", "30", "--slo-min-chunk", "16",
        "--slo-reject",
    ])
    sc = engine_config(args).scheduler
    assert (sc.policy, sc.slo_ttft_ms, sc.slo_itl_ms, sc.slo_min_chunk, sc.slo_reject) == (
        POLICY, 250.0, 30.0, 16, True
    )
    defaults = engine_config(parser.parse_args([])).scheduler
    d = SchedulerConfig()
    assert (defaults.slo_ttft_ms, defaults.slo_itl_ms, defaults.slo_min_chunk, defaults.slo_reject) == (
        d.slo_ttft_ms, d.slo_itl_ms, d.slo_min_chunk, d.slo_reject
    )


def test_metrics_export_the_model_and_its_error() -> None:
    from prometheus_client import generate_latest

    from pdserve.engine.process.messages import EngineStats, StepStats
    from pdserve.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    coef = (0.01, 0.0004, 0.0009, 0.000002)
    policy = make_policy(POLICY, SchedulerConfig(policy=POLICY, slo_step_model_prior=coef))

    def policy_stats(num_violations: int, num_rejected: int) -> dict[str, float]:
        policy.num_ttft_violations_predicted, policy.num_rejected = num_violations, num_rejected  # type: ignore[attr-defined]
        return policy.stats()

    m.observe_engine(EngineStats(1, 0, 0.1, 0, 0, 0, policy_stats(2, 1)), StepStats(0.020, 0, 1, 0.025))
    m.observe_engine(EngineStats(1, 0, 0.1, 0, 0, 0, policy_stats(3, 1)), StepStats(0.040, 8, 1, 0.030))
    text = generate_latest(m.registry).decode()

    def value(line_start: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(line_start)]
        assert len(lines) == 1, (line_start, lines)
        return float(lines[0].rsplit(" ", 1)[1])

    for term, c in zip(("base", "prefill_token", "decode_seq", "context_token"), coef):
        assert value(f'pdserve:step_model_coefficient_seconds{{model_name="m",term="{term}"}}') == c
    assert value('pdserve:step_time_predicted_seconds{model_name="m"}') == 0.030
    assert value('pdserve:step_time_measured_seconds{model_name="m"}') == 0.040
    assert value('pdserve:step_time_prediction_error_ratio_count{model_name="m"}') == 2
    assert value('pdserve:step_time_prediction_error_ratio_sum{model_name="m"}') == pytest.approx(0.25 + 0.25)
    assert value('pdserve:step_time_prediction_error_ratio_bucket{le="0.2",model_name="m"}') == 0
    assert value('pdserve:slo_ttft_violations_predicted_total{model_name="m"}') == 3
    assert value('pdserve:slo_rejected_requests_total{model_name="m"}') == 1

    other = ServerMetrics("m")  # another policy: no model, no coefficient series
    other.observe_engine(EngineStats(1, 0, 0.1, 0, 0, 0), StepStats(0.02, 0, 1))
    text = generate_latest(other.registry).decode()
    assert "pdserve:step_model_coefficient_seconds{" not in text
    assert 'pdserve:step_time_prediction_error_ratio_count{model_name="m"} 0.0' in text

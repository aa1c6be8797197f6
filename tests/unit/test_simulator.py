"""The simulator: the step-time model fitted in one batch, and workloads run through the real scheduler on
simulated time (torch-free)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from pdserve.config import SchedulerConfig
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.sim.simulator import SimConfig, SimRequest, StepSample, fit_step_model, simulate

TRUE = (0.005, 0.0003, 0.0004, 0.000002)


def true_time(prefill: int, decode: int, context: int) -> float:
    a, b, c, d = TRUE
    return a + b * prefill + c * decode + d * context


def test_the_simulator_imports_no_torch() -> None:
    code = "import sys, pdserve.sim.simulator; assert not [m for m in sys.modules if m.split('.')[0] == 'torch']"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fit_recovers_the_coefficients_of_noise_free_steps() -> None:
    rng = random.Random(0)
    steps = []
    for _ in range(300):
        p, d, c = rng.choice([0, rng.randint(1, 2048)]), rng.randint(0, 128), rng.randint(0, 200_000)
        steps.append(StepSample(true_time(p, d, c), p, d, c))
    model = fit_step_model(steps)
    assert model.coefficients == pytest.approx(TRUE, rel=1e-4)


def workload(n: int, seed: int = 1, spread: float = 0.0) -> list[SimRequest]:
    rng = random.Random(seed)
    return [SimRequest(rng.randint(5, 300), rng.randint(1, 120), rng.uniform(0, spread)) for _ in range(n)]


def test_every_request_runs_its_tokens_and_time_is_the_sum_of_the_steps() -> None:
    model = StepTimeModel(prior=TRUE)
    wl = workload(60)
    res = simulate(wl, model, SimConfig(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32), 2048, 16))
    assert sum(s.prefill_tokens for s in res.steps) == sum(r.prompt_len for r in wl)
    # every output token but each request's first (sampled by its last prompt chunk) is one decode
    assert sum(s.decode_seqs for s in res.steps) == sum(r.output_len - 1 for r in wl)
    assert res.elapsed == pytest.approx(sum(s.duration for s in res.steps))
    assert all(s.duration == pytest.approx(true_time(s.prefill_tokens, s.decode_seqs, s.context_tokens)) for s in res.steps)
    assert all(s.prefill_tokens <= 512 and s.decode_seqs <= 32 for s in res.steps)
    for r, w in zip(res.requests, wl):
        assert 0 < r.ttft <= r.finished - r.arrival and r.output_len == w.output_len
    assert res.num_preemptions == 0


def test_arrivals_wait_for_their_time_and_idle_gaps_are_skipped() -> None:
    model = StepTimeModel(prior=TRUE)
    wl = [SimRequest(50, 10, 0.0), SimRequest(50, 10, 100.0)]
    res = simulate(wl, model, SimConfig(SchedulerConfig(), 256, 16))
    first, second = res.requests
    assert first.finished < 1.0 and second.first_token > 100.0
    assert res.elapsed == pytest.approx(second.finished)  # from the first arrival (0) to the last token
    assert sum(s.duration for s in res.steps) < 2.0  # the 99 s gap ran no step


def test_a_small_cache_preempts_and_still_finishes() -> None:
    wl = workload(40, seed=3)
    res = simulate(wl, StepTimeModel(prior=TRUE), SimConfig(SchedulerConfig(max_num_seqs=64), 48, 16))
    assert res.num_preemptions > 0
    assert all(r.finished >= r.first_token > 0 for r in res.requests)


def test_a_workload_the_cache_can_never_hold_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no progress"):
        simulate([SimRequest(500, 4)], StepTimeModel(prior=TRUE), SimConfig(SchedulerConfig(), 8, 16))


# ---- planner ----------------------------------------------------------------------------------------------


def test_poisson_arrivals_are_ordered_seeded_and_at_the_rate() -> None:
    from pdserve.sim.planner import poisson_arrivals

    lengths = [(10, 5)] * 2000
    a = poisson_arrivals(lengths, 4.0, seed=1)
    assert a == poisson_arrivals(lengths, 4.0, seed=1) and a != poisson_arrivals(lengths, 4.0, seed=2)
    times = [r.arrival for r in a]
    assert times == sorted(times) and times[0] == 0.0
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.1)
    assert all(r.arrival == 0.0 for r in poisson_arrivals(lengths[:5], float("inf")))


def test_the_planner_ranks_by_goodput_and_judges_like_the_benchmark() -> None:
    from pdserve.bench.metrics import SLO
    from pdserve.sim.planner import plan, poisson_arrivals

    rng = random.Random(4)
    lengths = [(rng.randint(20, 400), rng.randint(5, 150)) for _ in range(80)]
    workload = poisson_arrivals(lengths, 6.0, seed=0)
    model = StepTimeModel(prior=TRUE)
    slo = SLO(ttft_ms=1500, tpot_ms=60)
    rows = plan(workload, model, SimConfig(SchedulerConfig(), 4096, 16), budgets=[64, 2048], max_seqs=[4, 64], slo=slo)
    assert len(rows) == 4
    goodputs = [r.metrics.goodput for r in rows]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > goodputs[-1]
    assert (rows[-1].max_num_seqs, rows[0].max_num_seqs) == (4, 64)  # 4 sequences at a time queue up
    for r in rows:  # each row's goodput is the requests meeting both targets, over the run's time
        cfg = SchedulerConfig(max_num_batched_tokens=r.max_num_batched_tokens, max_num_seqs=r.max_num_seqs)
        res = simulate(workload, model, SimConfig(cfg, 4096, 16))
        good = [q for q in res.requests if q.ttft * 1e3 <= 1500 and (q.output_len < 2 or q.tpot * 1e3 <= 60)]
        assert r.metrics.num_good == len(good)
        assert r.metrics.goodput == pytest.approx(len(good) / res.elapsed)

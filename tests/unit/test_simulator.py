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

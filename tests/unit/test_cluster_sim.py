"""Simulated clusters (`pdserve.sim.simulator.simulate_cluster`): colocated instances behind a router and xPyD with the KV
crossing a modelled link, on the real engine loop and scheduler (torch-free)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from pdserve.config import SchedulerConfig
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.sim.simulator import ClusterConfig, LinkModel, SimConfig, SimRequest, simulate, simulate_cluster

MODEL = StepTimeModel(prior=(0.005, 0.0003, 0.0004, 0.000002))
BASE = SimConfig(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64), 2048, 16)
LINK = LinkModel(kv_bytes_per_token=20_000, bandwidth=1e9, latency_s=0.001, num_layers=10)


def workload(n: int, spread: float, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    return sorted(
        (SimRequest(rng.randint(10, 400), rng.randint(2, 80), rng.uniform(0, spread)) for _ in range(n)),
        key=lambda r: r.arrival,
    )


def prefill_seconds(prompt_len: int) -> float:
    return MODEL.predict(prompt_len, 0, prompt_len)


def test_the_cluster_simulator_imports_no_torch() -> None:
    code = "import sys, pdserve.sim.simulator; assert not [m for m in sys.modules if m.split('.')[0] == 'torch']"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_colocated_instance_is_the_single_simulator() -> None:
    wl = workload(40, 5.0)
    one, single = simulate_cluster(wl, MODEL, ClusterConfig(1, 0, BASE)), simulate(wl, MODEL, BASE)
    shape = [(s.prefill_tokens, s.decode_seqs, s.context_tokens) for s in single.steps]
    assert [(s.prefill_tokens, s.decode_seqs, s.context_tokens) for s in one.steps] == shape
    assert [r.token_times for r in one.requests] == [r.token_times for r in single.requests]


@pytest.mark.parametrize("cluster", [ClusterConfig(2, 0, BASE), ClusterConfig(1, 1, BASE, BASE, LINK),
                                     ClusterConfig(2, 3, BASE, BASE, LINK)], ids=["2 colocated", "1P1D", "2P3D"])
def test_every_request_gets_its_tokens_never_before_it_arrives(cluster) -> None:  # type: ignore[no-untyped-def]
    wl = workload(60, 6.0, seed=1)
    res = simulate_cluster(wl, MODEL, cluster)
    for w, r in zip(wl, res.requests):
        assert len(r.token_times) >= 1 and r.token_times == sorted(r.token_times)
        # nothing before the prompt's own prefill step could have run, on its instance, after it arrived
        assert r.first_token >= w.arrival + prefill_seconds(w.prompt_len) - 1e-9
        assert r.finished >= r.first_token
    assert sum(s.prefill_tokens for s in res.steps) == sum(w.prompt_len for w in wl)
    decode_steps = sum(s.decode_seqs for s in res.steps)
    assert decode_steps == sum(w.output_len - 1 for w in wl)  # the first token comes with the prompt's step


def test_disaggregation_adds_the_links_tail_to_the_first_token() -> None:
    """One request on an idle 1P1D cluster: its first token reaches the decode side the link's tail after
    its prefill step (overlapped: what the step's compute did not hide, at least one layer's share)."""
    r = SimRequest(300, 4, 0.0)
    for link in (LINK, LinkModel(20_000, 1e6, 0.002, 10), LinkModel(20_000, 1e6, 0.002, 10, overlap=False)):
        res = simulate_cluster([r], MODEL, ClusterConfig(1, 1, BASE, BASE, link))
        compute = prefill_seconds(300)
        transfer = 300 * 20_000 / link.bandwidth
        tail = link.latency_s + (max(transfer - compute, transfer / 10) if link.overlap else transfer)
        assert res.requests[0].first_token == pytest.approx(compute + tail)


def test_decode_instances_without_blocks_hold_requests_until_they_free() -> None:
    small = SimConfig(BASE.scheduler, 40, 16)  # 640 tokens of KV on the decode side
    wl = workload(30, 0.5, seed=2)
    res = simulate_cluster(wl, MODEL, ClusterConfig(1, 1, BASE, small, LINK))
    assert len(res.requests) == 30 and all(r.finished > 0 for r in res.requests)


def test_a_split_smooths_decode_latency_that_colocated_prompts_stall() -> None:
    """Long prompts arriving among decoding streams: colocated, a 512-token chunk lands in decode steps
    (ITL spikes); split, decode steps carry no prompt tokens."""
    from pdserve.bench.metrics import compute_metrics

    wl = workload(80, 8.0, seed=3)
    worst = {}
    for cfg in (ClusterConfig(2, 0, BASE), ClusterConfig(1, 1, BASE, BASE, LINK)):
        res = simulate_cluster(wl, MODEL, cfg)
        worst[cfg.name] = compute_metrics(res.records([w.prompt_len for w in wl]), res.elapsed).itl.p99
    assert worst["1P1D"] < worst["2 colocated"]


def test_the_split_planner_ranks_every_split() -> None:
    from pdserve.bench.metrics import SLO
    from pdserve.sim.planner import plan_split, poisson_arrivals

    wl = poisson_arrivals([(r.prompt_len, r.output_len) for r in workload(60, 0)], 8.0, seed=0)
    rows = plan_split(wl, MODEL, BASE, num_instances=3, link=LINK, slo=SLO(ttft_ms=2000, tpot_ms=40))
    assert sorted(r.name for r in rows) == ["1P2D", "2P1D", "3 colocated"]
    goodputs = [r.metrics.goodput for r in rows]
    assert goodputs == sorted(goodputs, reverse=True)

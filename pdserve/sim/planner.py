"""Which scheduler settings serve a workload best under latency targets, answered by the simulator.

    rows = plan(workload, model, base, budgets=[256, 512, 2048], max_seqs=[32, 128], slo=SLO(2000, 100))
    rows[0]  # the best: most requests per second that meet every target, then the most throughput

Each candidate (token budget per step x most sequences per step) runs the same workload (arrival times
included) through `simulate`, and is judged by `pdserve.bench.metrics` exactly as a real serving run
is (`pdserve bench serve --slo ...`).

    rows = plan_split(workload, model, base, num_instances=4, link=LinkModel(...), slo=SLO(2000, 100))

compares N colocated instances with every prefill / decode split of the same N (1P3D, 2P2D, 3P1D), each
instance with `base`'s settings, the KV crossing `link` (`pdserve.sim.simulator.simulate_cluster`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.bench.metrics import SLO, BenchMetrics, compute_metrics
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.sim.simulator import ClusterConfig, LinkModel, SimConfig, SimRequest, simulate, simulate_cluster


@dataclass(frozen=True, slots=True)
class PlanRow:
    max_num_batched_tokens: int
    max_num_seqs: int
    metrics: BenchMetrics
    num_preemptions: int


def poisson_arrivals(lengths: Sequence[tuple[int, int]], rate: float, seed: int = 0) -> list[SimRequest]:
    """The (prompt, output) lengths arriving as a Poisson process of `rate` requests per second (all at
    once where rate is infinite), in order."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for prompt_len, output_len in lengths:
        out.append(SimRequest(prompt_len, output_len, t))
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return out


def plan(
    workload: Sequence[SimRequest],
    model: StepTimeModel,
    base: SimConfig,
    *,
    budgets: Sequence[int],
    max_seqs: Sequence[int],
    slo: SLO | None = None,
) -> list[PlanRow]:
    """Every (budget, max sequences) candidate on `base`'s other settings, best first: by goodput under
    `slo` (requests per second meeting every target), then by requests per second."""
    rows = []
    prompt_lens = [r.prompt_len for r in workload]
    for budget in budgets:
        for seqs in max_seqs:
            sched = dataclasses.replace(base.scheduler, max_num_batched_tokens=budget, max_num_seqs=seqs)
            res = simulate(workload, model, dataclasses.replace(base, scheduler=sched))
            metrics = compute_metrics(res.records(prompt_lens), res.elapsed, slo)
            rows.append(PlanRow(budget, seqs, metrics, res.num_preemptions))
    return sorted(rows, key=lambda r: (-(r.metrics.goodput or 0.0), -r.metrics.request_throughput))


@dataclass(frozen=True, slots=True)
class SplitRow:
    name: str  # "4 colocated", "1P3D", ...
    num_prefill: int
    num_decode: int
    metrics: BenchMetrics
    num_preemptions: int


def plan_split(
    workload: Sequence[SimRequest],
    model: StepTimeModel,
    base: SimConfig,
    *,
    num_instances: int,
    link: LinkModel,
    slo: SLO | None = None,
) -> list[SplitRow]:
    """`num_instances` colocated against every xPyD split of them, best first (goodput under `slo`, then
    requests per second)."""
    prompt_lens = [r.prompt_len for r in workload]
    configs = [ClusterConfig(num_instances, 0, base)]
    configs += [ClusterConfig(p, num_instances - p, base, base, link) for p in range(1, num_instances)]
    rows = []
    for cfg in configs:
        res = simulate_cluster(workload, model, cfg)
        metrics = compute_metrics(res.records(prompt_lens), res.elapsed, slo)
        rows.append(SplitRow(cfg.name, cfg.num_prefill, cfg.num_decode, metrics, res.num_preemptions))
    return sorted(rows, key=lambda r: (-(r.metrics.goodput or 0.0), -r.metrics.request_throughput))

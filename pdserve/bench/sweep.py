"""`pdserve bench sweep`: the same workload at several request rates against one server.

Prints one row per rate, finds the highest rate whose SLO attainment reaches the target (90%: DistServe's
goodput), and writes a JSON report (every run's summary and records) and a PNG of latency percentiles
against the rate. The server is shared by all rates, so a prompt replayed at the second rate can hit the
prefix cache filled by the first: each run's prefix-cache hits are measured and recorded, and a fair
sweep runs the server with `--no-prefix-caching`.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TextIO

from pdserve.bench.client import fetch_model_name
from pdserve.bench.datasets import DecodingTokenizer
from pdserve.bench.metrics import SLO
from pdserve.bench.serve_bench import (
    BenchResult,
    default_tokenizer,
    format_grid,
    load_json,
    num_text,
    output_tokenizer,
    rate_json,
    rate_text,
    result_json,
    run_once,
    slo_text,
    write_artifacts,
    write_json,
    workload_samples,
)
from pdserve.config import LoadConfig, Workload

ATTAINMENT_TARGET = 90.0  # percent


@dataclass(frozen=True, slots=True)
class SweepResult:
    points: list[tuple[float, BenchResult]]  # (request rate, its run), in the order run
    max_rate: float | None  # see max_rate_meeting_target
    target: float  # attainment target, percent


def parse_rates(text: str) -> list[float]:
    """`0.5,1,2,inf` -> [0.5, 1.0, 2.0, inf]."""
    rates: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"bad request rate {part!r}: expected a number or inf") from None
        if not rate > 0:
            raise ValueError(f"request rates must be > 0 (or inf), got {part!r}")
        if rate in rates:
            raise ValueError(f"request rate {part} given twice")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rates given, e.g. 0.5,1,2,4,inf")
    return rates


def max_rate_meeting_target(
    attainments: Sequence[tuple[float, float | None]], target: float = ATTAINMENT_TARGET
) -> float | None:
    """DistServe's goodput: the highest request rate served with at least `target` percent SLO attainment.

    Walks the rates upward and stops at the first one that misses (or has no attainment: no SLO), so a
    rate is only counted if every lower rate tested also met the target; a pass above a miss is noise,
    not capacity. None when the lowest rate already misses.
    """
    best = None
    for rate, attainment in sorted(attainments, key=lambda p: p[0]):
        if attainment is None or attainment < target:
            break
        best = rate
    return best


def format_sweep_table(result: SweepResult) -> str:
    header = [
        "rate", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50", "ITL p99", "goodput", "attain %"
    ]
    rows = [
        [
            rate_text(rate),
            num_text(m.request_throughput, 2),
            num_text(m.ttft.median),
            num_text(m.ttft.p99),
            num_text(m.tpot.median),
            num_text(m.itl.median),
            num_text(m.itl.p99),
            num_text(m.goodput, 2),
            num_text(m.slo_attainment),
        ]
        for rate, m in ((rate, r.metrics) for rate, r in result.points)
    ]
    lines = [format_grid(header, rows), "(latencies in ms, rates and goodput in req/s)"]
    slo = result.points[0][1].metrics.slo if result.points else None
    if slo is None:
        lines.append("no SLO given: no goodput or attainment (use --slo ttft=MS,tpot=MS,itl=MS)")
    elif result.max_rate is None:
        lines.append(f"SLO {slo_text(slo)}: no rate reached {result.target:g}% attainment")
    else:
        lines.append(
            f"SLO {slo_text(slo)}: highest rate with >= {result.target:g}% attainment: "
            f"{rate_text(result.max_rate)} req/s"
        )
    carried = [rate_text(rate) for rate, r in result.points if r.prefix_cache_hit_tokens]
    if carried:
        lines.append(
            f"note: prefix-cache hits at rate(s) {', '.join(carried)}: prompts cached by earlier runs "
            "helped; run the server with --no-prefix-caching for a fair sweep"
        )
    return "\n".join(lines)


def run_sweep(
    base_url: str,
    model: str | None,
    workload: Workload,
    rates: Sequence[float],
    *,
    endpoint: str = "completions",
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    slo: SLO | None = None,
    target: float = ATTAINMENT_TARGET,
    out: str | None = None,
    plot_dir: str | None = None,
    trace: str | None = None,
    tokenizer: DecodingTokenizer | None = None,
    count_outputs: bool | None = None,
    show_progress: bool = True,
    stdout: TextIO | None = None,
) -> SweepResult:
    """Replay `workload` at each of `rates` in turn; print the table, write `out` (JSON) and the figure
    next to it (same name, .png), plots into `plot_dir` and a trace with one process per rate."""
    tokenizer = tokenizer or default_tokenizer()
    samples = workload_samples(workload, tokenizer)
    if model is None:
        model = asyncio.run(fetch_model_name(base_url))
    count_tokenizer = output_tokenizer(model, tokenizer, count_outputs)
    template = LoadConfig(
        base_url=base_url, model=model, endpoint=endpoint, request_rate=math.inf, burstiness=burstiness,
        max_concurrency=max_concurrency, seed=workload.seed,
    )
    points = []
    for rate in rates:
        load = replace(template, request_rate=rate)
        points.append((rate, run_once(load, samples, slo, count_tokenizer, show_progress)))
    result = SweepResult(
        points, max_rate_meeting_target([(r, p.metrics.slo_attainment) for r, p in points], target), target
    )
    print(format_sweep_table(result), file=stdout)
    if out is not None:
        write_sweep_report(out, result, template, workload)
    write_artifacts({f"rate {rate_text(r)}": p.records for r, p in points}, plot_dir, trace)
    if plot_dir is not None:
        from pdserve.bench.plots import plot_latency_vs_rate

        figure = os.path.join(plot_dir, "latency-vs-rate.png")
        plot_latency_vs_rate([(r, p.metrics) for r, p in points], figure)
    return result


def write_sweep_report(path: str, result: SweepResult, load: LoadConfig, workload: Workload) -> list[str]:
    """The JSON report at `path` and the latency-vs-rate figure beside it; returns both paths."""
    from pdserve.bench.plots import plot_latency_vs_rate

    config = load_json(load)
    del config["request_rate"]  # one per run
    config["workload"] = asdict(workload)
    report = {
        "config": config,
        "server": {
            "state": "shared: one server for every rate; prefix_cache_hit_tokens per run says whether "
            "prompts cached by earlier runs helped",
        },
        "attainment_target": result.target,
        "max_rate_meeting_target": None if result.max_rate is None else rate_json(result.max_rate),
        "runs": [{"request_rate": rate_json(rate), **result_json(r)} for rate, r in result.points],
    }
    write_json(path, report)
    figure = os.path.splitext(path)[0] + ".png"
    plot_latency_vs_rate([(r, p.metrics) for r, p in result.points], figure)
    return [path, figure]

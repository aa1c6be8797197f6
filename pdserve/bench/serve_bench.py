"""`pdserve bench`: one serving benchmark run against an OpenAI-compatible server.

Builds the workload (ShareGPT or random prompts, token lengths from the tokenizer), asks the server for
its model name if none is given, replays the workload with `client.run_requests`, prints the summary
table and writes a JSON report holding the configuration, the summary and every per-request record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from typing import TextIO

from pdserve.bench.client import LoadConfig, fetch_model_name, run_requests
from pdserve.bench.datasets import DecodingTokenizer, SampleRequest, sample_random, sample_sharegpt
from pdserve.bench.metrics import SLO, BenchMetrics, Distribution, RequestRecord, compute_metrics

DATASETS = ("sharegpt", "random")


@dataclasses.dataclass(frozen=True, slots=True)
class BenchResult:
    metrics: BenchMetrics
    records: list[RequestRecord]
    model: str


def load_samples(
    tokenizer: DecodingTokenizer,
    dataset: str,
    num_prompts: int,
    seed: int,
    random_input_len: int = 1024,
    random_output_len: int = 128,
) -> list[SampleRequest]:
    if dataset == "sharegpt":
        return sample_sharegpt(tokenizer, num_prompts, seed)
    if dataset == "random":
        return sample_random(tokenizer, num_prompts, random_input_len, random_output_len, seed)
    raise ValueError(f"unknown dataset {dataset!r}: expected one of {', '.join(DATASETS)}")


def default_tokenizer() -> DecodingTokenizer:
    """The bundled SmolLM2 tokenizer: prompt lengths are counted with it unless the caller passes another."""
    from pdserve.model.loader import default_model_path
    from pdserve.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


def run_bench(
    base_url: str,
    model: str | None,
    dataset: str,
    num_prompts: int,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    slo: SLO | None = None,
    out: str | None = None,
    *,
    endpoint: str = "completions",
    random_input_len: int = 1024,
    random_output_len: int = 128,
    tokenizer: DecodingTokenizer | None = None,
    show_progress: bool = True,
    stdout: TextIO | None = None,
) -> BenchResult:
    """Run one benchmark; print the table to `stdout` (default: sys.stdout) and write JSON to `out`."""
    samples = load_samples(
        tokenizer or default_tokenizer(), dataset, num_prompts, seed, random_input_len, random_output_len
    )
    if not samples:
        raise ValueError("the workload is empty")
    if model is None:
        model = asyncio.run(fetch_model_name(base_url))
    load = LoadConfig(base_url, model, endpoint, request_rate, burstiness, max_concurrency, seed)
    records, duration = asyncio.run(run_requests(load, samples, show_progress))
    metrics = compute_metrics(records, duration, slo)
    print(format_table(metrics, load), file=stdout)
    if out is not None:
        write_report(out, metrics, records, load, dataset)
    return BenchResult(metrics, records, model)


def format_table(m: BenchMetrics, load: LoadConfig) -> str:
    width = 50

    def row(name: str, value: object) -> str:
        text = f"{value:<10.2f}" if isinstance(value, float) else str(value)
        return f"{name:<40}{text}"

    def section(title: str) -> str:
        return title.center(width, "-")

    lines = [
        " Serving Benchmark Result ".center(width, "="),
        row("Model:", load.model),
        row("Request rate (req/s):", "inf" if math.isinf(load.request_rate) else f"{load.request_rate:g}"),
        row("Burstiness:", f"{load.burstiness:g}"),
        row("Max concurrency:", load.max_concurrency or "none"),
        row("Successful requests:", m.completed),
        row("Failed requests:", m.failed),
        row("Benchmark duration (s):", m.duration_s),
        row("Total input tokens:", m.total_input_tokens),
        row("Total generated tokens:", m.total_output_tokens),
        row("Request throughput (req/s):", m.request_throughput),
        row("Output token throughput (tok/s):", m.output_throughput),
        row("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    if m.slo is not None:
        targets = ", ".join(
            f"{k}<={v:g} ms"
            for k, v in (("ttft", m.slo.ttft_ms), ("tpot", m.slo.tpot_ms), ("itl", m.slo.itl_ms))
            if v is not None
        )
        lines += [
            row("SLO:", targets),
            row("Requests meeting the SLO:", m.num_good),
            row("Request goodput (req/s):", m.goodput),
            row("SLO attainment (%):", m.slo_attainment),
        ]

    def dist(title: str, short: str, d: Distribution) -> list[str]:
        return [
            section(f"{title}"),
            row(f"Mean {short} (ms):", d.mean),
            row(f"Median {short} (ms):", d.median),
            row(f"P90 {short} (ms):", d.p90),
            row(f"P99 {short} (ms):", d.p99),
        ]

    lines += dist("Time to First Token", "TTFT", m.ttft)
    lines += dist("Time per Output Token (excl. 1st token)", "TPOT", m.tpot)
    lines += dist("Inter-token Latency", "ITL", m.itl)
    lines += dist("End-to-end Latency", "E2EL", m.e2el)
    lines.append("=" * width)
    return "\n".join(lines)


def write_report(
    path: str, metrics: BenchMetrics, records: list[RequestRecord], load: LoadConfig, dataset: str
) -> None:
    config = dataclasses.asdict(load)
    # JSON has no infinity; keep the file readable by strict parsers.
    config["request_rate"] = "inf" if math.isinf(load.request_rate) else load.request_rate
    config["dataset"] = dataset
    report = {
        "config": config,
        "metrics": dataclasses.asdict(metrics),
        "records": [dataclasses.asdict(r) for r in records],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
